// Helpers shared by the CUDA runtime-API test programs (tests/simgpu/runtime/*.cu).
//
// Every program here is valid CUDA: it passes on a real GPU as well as on simgpu. Checks that only
// hold on simgpu (configured sizes, host-body side effects, launch records) are guarded with
// onSimgpu().
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

extern char** environ;

// Fails the current test (and returns from it) unless `expr` is cudaSuccess.
#define CUDA_ASSERT(expr)                                                                       \
  do {                                                                                          \
    const cudaError_t cuda_assert_err_ = (expr);                                                \
    ASSERT_EQ(cudaSuccess, cuda_assert_err_)                                                    \
        << #expr << " -> " << cudaGetErrorName(cuda_assert_err_) << ": "                        \
        << cudaGetErrorString(cuda_assert_err_);                                                \
  } while (0)

// Like CUDA_ASSERT, but the test continues.
#define CUDA_EXPECT(expr)                                                                       \
  do {                                                                                          \
    const cudaError_t cuda_expect_err_ = (expr);                                                \
    EXPECT_EQ(cudaSuccess, cuda_expect_err_)                                                    \
        << #expr << " -> " << cudaGetErrorName(cuda_expect_err_) << ": "                        \
        << cudaGetErrorString(cuda_expect_err_);                                                \
  } while (0)

// Expects `expr` to fail with exactly `code` and clears the (non-sticky) last error it left.
#define CUDA_EXPECT_ERR(code, expr)                                                             \
  do {                                                                                          \
    const cudaError_t cuda_expect_err_ = (expr);                                                \
    EXPECT_EQ((code), cuda_expect_err_)                                                         \
        << #expr << " -> " << cudaGetErrorName(cuda_expect_err_);                               \
    (void)cudaGetLastError();                                                                   \
  } while (0)

namespace simtest {

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;
constexpr size_t GiB = size_t{1} << 30;

// True when the program runs on simgpu: some SIMGPU_* variable is set (the test harness always sets
// SIMGPU_STATE_DIR) or device 0's name carries the "simgpu" marker of the default name.
inline bool onSimgpu() {
  static const bool value = [] {
    for (char** e = environ; e && *e; ++e)
      if (std::strncmp(*e, "SIMGPU_", 7) == 0) return true;
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return std::strstr(p.name, "simgpu") != nullptr;
  }();
  return value;
}

// Integer environment variable, or `fallback` when unset or not a number.
inline long long envInt(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (end && *end == '\0') ? n : fallback;
}

// Parses "4GiB", "512MiB", "16GB", "1048576" (the forms SIMGPU_MEMORY accepts); 0 on error.
inline uint64_t parseSize(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  uint64_t whole = 0;
  size_t i = 0;
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) whole = whole * 10 + (s[i] - '0');
  if (i == 0) return 0;
  std::string unit(s.substr(i));
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (unit.empty() || unit == "b") return whole;
  if (unit == "k" || unit == "kib") return whole << 10;
  if (unit == "m" || unit == "mib") return whole << 20;
  if (unit == "g" || unit == "gib") return whole << 30;
  if (unit == "t" || unit == "tib") return whole << 40;
  if (unit == "kb") return whole * 1000ull;
  if (unit == "mb") return whole * 1000000ull;
  if (unit == "gb") return whole * 1000000000ull;
  if (unit == "tb") return whole * 1000000000000ull;
  return 0;
}

// The memory simgpu gives device `ordinal`: SIMGPU_MEMORY ("4GiB" for all, or "16GiB,8GiB" per
// device; a short list repeats its last size), default 16 GiB.
inline uint64_t expectedSimgpuMemory(int ordinal) {
  const char* v = std::getenv("SIMGPU_MEMORY");
  if (!v || !*v) return 16ull << 30;
  std::string_view rest(v);
  uint64_t last = 0;
  for (int d = 0;; ++d) {
    const size_t comma = rest.find(',');
    last = parseSize(rest.substr(0, comma));
    if (d == ordinal || comma == std::string_view::npos) return last;
    rest.remove_prefix(comma + 1);
  }
}

inline int expectedSimgpuSms() { return static_cast<int>(envInt("SIMGPU_SMS", 132)); }
inline int expectedSimgpuDevices() { return static_cast<int>(envInt("SIMGPU_DEVICES", 1)); }

// Number of devices, 0 when the query fails.
inline int deviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Free/total memory of the current device; asserts the call succeeds.
inline void memInfo(size_t* freeBytes, size_t* totalBytes) {
  *freeBytes = 0;
  *totalBytes = 0;
  const cudaError_t e = cudaMemGetInfo(freeBytes, totalBytes);
  EXPECT_EQ(cudaSuccess, e) << "cudaMemGetInfo: " << cudaGetErrorString(e);
}

// Slack for free-memory comparisons: simgpu accounts exactly; a real GPU's free memory moves a
// little with driver-internal allocations and other processes.
inline size_t memSlack() { return onSimgpu() ? 0 : 64 * MiB; }

// Declare after the locals that queued (asynchronous) work refers to: at scope exit, including after
// a failed ASSERT, it waits for the device before those locals are destroyed.
struct DeviceDrain {
  DeviceDrain() = default;
  DeviceDrain(const DeviceDrain&) = delete;
  DeviceDrain& operator=(const DeviceDrain&) = delete;
  ~DeviceDrain() {
    (void)cudaDeviceSynchronize();
    (void)cudaGetLastError();
  }
};

// Deterministic test pattern.
inline uint8_t patternByte(size_t i, unsigned seed) {
  return static_cast<uint8_t>((i * 131u + (i >> 8) * 7u + seed * 29u + 17u) & 0xffu);
}

}  // namespace simtest
