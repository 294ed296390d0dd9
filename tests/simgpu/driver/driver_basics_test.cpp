// simgpu's driver API (libcuda.so.1) called directly: devices, contexts, streams, events, memory, modules and launches.
//
// Three registrations (see CMakeLists.txt), each selecting its suites with --gtest_filter:
// - the default one (SIMGPU_SMS=66): every suite but BeforeInit and TwoDevices;
// - BeforeInit: a process that has not called cuInit yet (it must be the first driver use);
// - TwoDevices: SIMGPU_DEVICES=2 SIMGPU_MEMORY=1GiB,2GiB.
// Module tests load real images built by nvcc at build time (kernels.cu -> SIMGPU_TEST_FATBIN,
// SIMGPU_TEST_CUBIN); the kernels' host bodies are the simgpu_host_* functions below, found by
// the driver because this executable exports its symbols.
#include <cuda.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "simgpu/simgpu.h"

#include "cu_check.h"

namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;


long long envInt(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return (end && *end == '\0') ? n : fallback;
}

// The size simgpu gives device `ordinal` from SIMGPU_MEMORY ("4GiB", "512MiB" or "1GiB,2GiB"; the
// last size repeats), default 16 GiB.
uint64_t expectedMemory(int ordinal) {
  const char* v = std::getenv("SIMGPU_MEMORY");
  if (!v || !*v) return 16ull << 30;
  std::string s(v);
  uint64_t last = 0;
  size_t pos = 0;
  for (int d = 0;; ++d) {
    const size_t comma = s.find(',', pos);
    const std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    const unsigned long long n = std::strtoull(item.c_str(), &end, 10);
    const std::string unit(end);
    last = unit == "GiB" ? n << 30 : unit == "MiB" ? n << 20 : unit == "KiB" ? n << 10 : n;
    if (d == ordinal || comma == std::string::npos) return last;
    pos = comma + 1;
  }
}

std::vector<char> readFile(const char* path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string hex(const void* p, size_t n) {
  std::string s;
  char b[4];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", static_cast<const unsigned char*>(p)[i]);
    s += b;
  }
  return s;
}

// Runs this executable again with `filter` and the extra environment; returns its stdout.
std::string runSelf(const std::string& filter, const std::vector<std::string>& env, int* status) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return {};
  self[n] = 0;
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    const std::string arg = "--gtest_filter=" + filter;
    execl(self, self, arg.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(r));
  close(fds[0]);
  waitpid(pid, status, 0);
  return out;
}

// ---- kernel host bodies (see simgpu/simgpu.h) ----
struct LaunchRecord {
  std::atomic<int> count{0};
  std::string name;
  unsigned grid[3] = {};
  unsigned block[3] = {};
  unsigned sharedMem = 0;
  int device = -1;
  void* p = nullptr;
  int n = 0;
  double d = 0;
  bool hadExtra = false;
};
LaunchRecord gScale, gParams3;

void record(LaunchRecord& r, const simgpu_launch* l) {
  r.name = l->name;
  for (int i = 0; i < 3; ++i) {
    r.grid[i] = l->grid[i];
    r.block[i] = l->block[i];
  }
  r.sharedMem = l->shared_mem;
  r.device = l->device;
  r.hadExtra = l->extra != nullptr;
  r.count.fetch_add(1);
}

}  // namespace

extern "C" void simgpu_host__Z5scalePffi(const simgpu_launch* l) {
  float* p = *static_cast<float**>(l->params[0]);
  const float a = *static_cast<float*>(l->params[1]);
  const int n = *static_cast<int*>(l->params[2]);
  for (int i = 0; i < n; ++i) p[i] *= a;  // device memory is host memory on simgpu
  gScale.p = p;
  gScale.n = n;
  record(gScale, l);
}

extern "C" void simgpu_host__Z7params3Pfid(const simgpu_launch* l) {
  if (l->params) {
    gParams3.p = *static_cast<void**>(l->params[0]);
    gParams3.n = *static_cast<int*>(l->params[1]);
    gParams3.d = *static_cast<double*>(l->params[2]);
  } else if (l->extra) {
    // A packed argument buffer: the parameters at their offsets 0, 8 and 16.
    const char* buf = nullptr;
    for (int i = 0; l->extra[i] != CU_LAUNCH_PARAM_END; i += 2)
      if (l->extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = static_cast<const char*>(l->extra[i + 1]);
    if (buf) {
      std::memcpy(&gParams3.p, buf, 8);
      std::memcpy(&gParams3.n, buf + 8, 4);
      std::memcpy(&gParams3.d, buf + 16, 8);
    }
  }
  record(gParams3, l);
}

namespace {

// cuInit once per suite, device 0's primary context retained and current for every test.
class Driver : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
    ASSERT_EQ(CUDA_SUCCESS, cuDeviceGet(&dev_, 0));
    ASSERT_EQ(CUDA_SUCCESS, cuDevicePrimaryCtxRetain(&primary_, dev_));
    ASSERT_EQ(CUDA_SUCCESS, cuCtxSetCurrent(primary_));
  }
  static void TearDownTestSuite() {
    if (primary_) cuDevicePrimaryCtxRelease(dev_);
    primary_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(primary_, nullptr);
    CU_ASSERT(cuCtxSetCurrent(primary_));
  }
  static size_t freeMem() {
    size_t f = 0, t = 0;
    EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
    return f;
  }
  static inline CUdevice dev_ = 0;
  static inline CUcontext primary_ = nullptr;
};

using Devices = Driver;
using Contexts = Driver;
using StreamsEvents = Driver;
using Errors = Driver;
using Memory = Driver;
using Handles = Driver;
using ExportTables = Driver;

// ---------------------------------------------------------------------------------------------
// The private CUDART_INTERFACE table, called the way libcudart does (docs/simgpu.md, "Private
// export tables"). Slot 12 is what cudart 13.1 and later call at initialisation with no
// arguments, failing every runtime call with whatever non-zero it returns (PyTorch's own
// libcudart 13.2 did, with CUDA_ERROR_NOT_SUPPORTED); slot 2 retains the primary context.
TEST_F(ExportTables, CudartInterfaceAnswersWhatEveryCuda13RuntimeCalls) {
  const CUuuid cudartInterface = {{0x6b, static_cast<char>(0xd5), static_cast<char>(0xfb), 0x6c, 0x5b,
                                   static_cast<char>(0xf4), static_cast<char>(0xe7), 0x4a,
                                   static_cast<char>(0x89), static_cast<char>(0x87), static_cast<char>(0xd9),
                                   0x39, 0x12, static_cast<char>(0xfd), static_cast<char>(0x9d),
                                   static_cast<char>(0xf9)}};
  const void* table = nullptr;
  CU_ASSERT(cuGetExportTable(&table, &cudartInterface));
  ASSERT_NE(table, nullptr);
  const void* const* slots = static_cast<const void* const*>(table);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(slots[0]), 13 * sizeof(void*)) << "slot 0: the table's size";
  for (int i = 1; i < 13; ++i) EXPECT_NE(slots[i], nullptr) << "slot " << i << " must be callable";

  using Accept = CUresult (*)();
  EXPECT_EQ(reinterpret_cast<Accept>(const_cast<void*>(slots[12]))(), CUDA_SUCCESS);

  using Retain = CUresult (*)(CUcontext*, CUdevice);
  const auto retain = reinterpret_cast<Retain>(const_cast<void*>(slots[2]));
  CUcontext ctx = nullptr;
  CU_ASSERT(retain(&ctx, dev_));
  EXPECT_EQ(ctx, primary_);
  CU_ASSERT(cuDevicePrimaryCtxRelease(dev_));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, retain(nullptr, dev_));

  // A slot nothing implements is a stub, never NULL; an unknown table is refused.
  using Stub = CUresult (*)();
  EXPECT_EQ(reinterpret_cast<Stub>(const_cast<void*>(slots[11]))(), CUDA_ERROR_NOT_SUPPORTED);
  const CUuuid unknown = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}};
  table = &unknown;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_SUPPORTED, cuGetExportTable(&table, &unknown));
  EXPECT_EQ(table, nullptr);
}

// ---------------------------------------------------------------------------------------------
TEST_F(Devices, DriverVersion) {
  int v = 0;
  CU_ASSERT(cuDriverGetVersion(&v));
  EXPECT_EQ(v, 13000);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuDriverGetVersion(nullptr));
}

TEST_F(Devices, CountGetNameUuid) {
  int count = 0;
  CU_ASSERT(cuDeviceGetCount(&count));
  EXPECT_EQ(count, envInt("SIMGPU_DEVICES", 1));
  CUdevice d = -1;
  CU_ASSERT(cuDeviceGet(&d, 0));
  EXPECT_EQ(d, 0);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&d, count));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&d, -1));

  char name[256] = {};
  CU_ASSERT(cuDeviceGetName(name, sizeof name, 0));
  if (const char* want = std::getenv("SIMGPU_NAME"))
    EXPECT_STREQ(name, want);
  else
    EXPECT_NE(std::strstr(name, "simgpu"), nullptr) << name;
  char tiny[5] = {'x', 'x', 'x', 'x', 'x'};
  CU_ASSERT(cuDeviceGetName(tiny, sizeof tiny, 0));
  EXPECT_EQ(tiny[4], '\0');  // truncated, terminated
  EXPECT_EQ(std::strncmp(tiny, name, 4), 0);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetName(name, sizeof name, count));

  CUuuid a{}, b{};
  CU_ASSERT(cuDeviceGetUuid(&a, 0));
  CU_ASSERT(cuDeviceGetUuid(&b, 0));
  EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "UUID changes between calls";
  const CUuuid zero{};
  EXPECT_NE(std::memcmp(&a, &zero, sizeof a), 0) << "UUID is all zero";
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetUuid(&a, count));
}

TEST_F(Devices, Attributes) {
  int major = 0, minor = -1, sms = 0, warp = 0, threads = 0, unified = 0, busId = -1;
  CU_ASSERT(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
  CU_ASSERT(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
  EXPECT_EQ(major, 9);
  EXPECT_EQ(minor, 0);
  CU_ASSERT(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
  EXPECT_EQ(sms, envInt("SIMGPU_SMS", 132));
  CU_ASSERT(cuDeviceGetAttribute(&warp, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0));
  EXPECT_EQ(warp, 32);
  CU_ASSERT(cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 0));
  EXPECT_EQ(threads, 1024);
  CU_ASSERT(cuDeviceGetAttribute(&unified, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0));
  EXPECT_EQ(unified, 1);
  CU_ASSERT(cuDeviceGetAttribute(&busId, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
  EXPECT_GE(busId, 0);
  int v = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuDeviceGetAttribute(&v, static_cast<CUdevice_attribute>(100000), 0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuDeviceGetAttribute(nullptr, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 99));
}

TEST_F(Devices, TotalMem) {
  size_t total = 0;
  CU_ASSERT(cuDeviceTotalMem(&total, 0));
  EXPECT_EQ(total, expectedMemory(0));
  size_t f = 0, t = 0;
  CU_ASSERT(cuMemGetInfo(&f, &t));
  EXPECT_EQ(t, total);
  EXPECT_LE(f, t);
}

TEST_F(Devices, PciBusIdRoundTrip) {
  char bus[64] = {};
  CU_ASSERT(cuDeviceGetPCIBusId(bus, sizeof bus, 0));
  unsigned domain = 99, b = 0, dv = 99, fn = 99;
  ASSERT_EQ(std::sscanf(bus, "%x:%x:%x.%x", &domain, &b, &dv, &fn), 4) << bus;
  int attrBus = -1;
  CU_ASSERT(cuDeviceGetAttribute(&attrBus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
  EXPECT_EQ(static_cast<int>(b), attrBus);
  CUdevice d = -1;
  CU_ASSERT(cuDeviceGetByPCIBusId(&d, bus));
  EXPECT_EQ(d, 0);
  // NVML's 8-digit domain form names the same device.
  char nvmlForm[64];
  std::snprintf(nvmlForm, sizeof nvmlForm, "%08x:%02x:%02x.%x", domain, b, dv, fn);
  d = -1;
  CU_ASSERT(cuDeviceGetByPCIBusId(&d, nvmlForm));
  EXPECT_EQ(d, 0);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetByPCIBusId(&d, "0000:ee:00.0"));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuDeviceGetByPCIBusId(&d, "not a bus id"));
}

// ---------------------------------------------------------------------------------------------
TEST_F(Contexts, PrimaryRetainReleaseState) {
  // The suite holds one reference.
  unsigned flags = 99;
  int active = -1;
  CU_ASSERT(cuDevicePrimaryCtxGetState(dev_, &flags, &active));
  EXPECT_EQ(active, 1);
  CUcontext again = nullptr;
  CU_ASSERT(cuDevicePrimaryCtxRetain(&again, dev_));
  EXPECT_EQ(again, primary_);
  CU_ASSERT(cuDevicePrimaryCtxRelease(dev_));
  CU_ASSERT(cuDevicePrimaryCtxGetState(dev_, &flags, &active));
  EXPECT_EQ(active, 1);

  CU_ASSERT(cuDevicePrimaryCtxSetFlags(dev_, CU_CTX_SCHED_BLOCKING_SYNC));
  CU_ASSERT(cuDevicePrimaryCtxGetState(dev_, &flags, &active));
  EXPECT_EQ(flags, static_cast<unsigned>(CU_CTX_SCHED_BLOCKING_SYNC));

  // Memory allocated in the primary context goes when its last reference does.
  const size_t before = freeMem();
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAlloc(&p, 4 * kMiB));
  EXPECT_EQ(freeMem(), before - 4 * kMiB);
  CU_ASSERT(cuDevicePrimaryCtxRelease(dev_));
  CU_ASSERT(cuDevicePrimaryCtxGetState(dev_, &flags, &active));
  EXPECT_EQ(active, 0);
  CUdeviceptr q = 0;
  EXPECT_NE(CUDA_SUCCESS, cuMemAlloc(&q, kMiB)) << "allocation in a released primary context";
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuDevicePrimaryCtxRelease(dev_));  // not retained

  CU_ASSERT(cuDevicePrimaryCtxRetain(&again, dev_));
  EXPECT_EQ(again, primary_);
  primary_ = again;
  CU_ASSERT(cuCtxSetCurrent(primary_));
  CU_ASSERT(cuDevicePrimaryCtxGetState(dev_, &flags, &active));
  EXPECT_EQ(active, 1);
  EXPECT_EQ(freeMem(), before) << "the released context's memory was not returned";
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFree(p));  // freed with the context
  CU_ASSERT(cuDevicePrimaryCtxSetFlags(dev_, 0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDevicePrimaryCtxRetain(&again, 42));
}

TEST_F(Contexts, CreatePushPopDestroy) {
  CUcontext cur = nullptr;
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, primary_);

  CUcontext ctx = nullptr;
  CU_ASSERT(cuCtxCreate(&ctx, nullptr, 0, dev_));  // cuCtxCreate_v4
  ASSERT_NE(ctx, nullptr);
  EXPECT_NE(ctx, primary_);
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, ctx) << "a created context is made current";
  CUdevice d = -1;
  CU_ASSERT(cuCtxGetDevice(&d));
  EXPECT_EQ(d, dev_);
  unsigned long long idA = 0, idB = 0;
  CU_ASSERT(cuCtxGetId(ctx, &idA));
  CU_ASSERT(cuCtxGetId(primary_, &idB));
  EXPECT_NE(idA, idB);

  // Push the primary over it, pop it back.
  CU_ASSERT(cuCtxPushCurrent(primary_));
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, primary_);
  CUcontext popped = nullptr;
  CU_ASSERT(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, primary_);
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, ctx);

  // Memory of a created context is freed with it.
  const size_t before = freeMem();
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAlloc(&p, 8 * kMiB));
  EXPECT_EQ(freeMem(), before - 8 * kMiB);
  CUcontext ptrCtx = nullptr;
  CU_ASSERT(cuPointerGetAttribute(&ptrCtx, CU_POINTER_ATTRIBUTE_CONTEXT, p));
  EXPECT_EQ(ptrCtx, ctx);

  CU_ASSERT(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, ctx);
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, primary_);
  CU_ASSERT(cuCtxDestroy(ctx));
  EXPECT_EQ(freeMem(), before);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxPushCurrent(ctx));  // destroyed
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxDestroy(ctx));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxSetCurrent(ctx));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxDestroy(primary_));  // primaries are not destroyed
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuCtxCreate(&ctx, nullptr, 0, 77));

  // Destroying a current context leaves the thread with the one below.
  CUcontext c2 = nullptr;
  CU_ASSERT(cuCtxCreate(&c2, nullptr, 0, dev_));
  CU_ASSERT(cuCtxDestroy(c2));
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, primary_);
}

TEST_F(Contexts, EmptyStackAndSynchronize) {
  CU_ASSERT(cuCtxSynchronize());
  CUcontext popped = nullptr;
  CU_ASSERT(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, primary_);
  CUcontext cur = reinterpret_cast<CUcontext>(0x1);
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, nullptr);
  CUdeviceptr p = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuMemAlloc(&p, kMiB));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxSynchronize());
  CU_ASSERT(cuCtxPushCurrent(primary_));
}

// ---------------------------------------------------------------------------------------------
TEST_F(StreamsEvents, PriorityRangeAndStreams) {
  int least = 99, greatest = 99;
  CU_ASSERT(cuCtxGetStreamPriorityRange(&least, &greatest));
  EXPECT_LT(greatest, least) << "greatest priority is numerically lower";
  EXPECT_EQ(least, 0);

  CUstream hi = nullptr, lo = nullptr, plain = nullptr, clampHi = nullptr, clampLo = nullptr;
  CU_ASSERT(cuStreamCreateWithPriority(&hi, CU_STREAM_NON_BLOCKING, greatest));
  CU_ASSERT(cuStreamCreateWithPriority(&lo, CU_STREAM_DEFAULT, least));
  CU_ASSERT(cuStreamCreate(&plain, CU_STREAM_DEFAULT));
  CU_ASSERT(cuStreamCreateWithPriority(&clampHi, 0, greatest - 100));
  CU_ASSERT(cuStreamCreateWithPriority(&clampLo, 0, least + 100));
  int p = 99;
  CU_ASSERT(cuStreamGetPriority(hi, &p));
  EXPECT_EQ(p, greatest);
  CU_ASSERT(cuStreamGetPriority(lo, &p));
  EXPECT_EQ(p, least);
  CU_ASSERT(cuStreamGetPriority(plain, &p));
  EXPECT_EQ(p, 0);
  CU_ASSERT(cuStreamGetPriority(clampHi, &p));
  EXPECT_EQ(p, greatest) << "out-of-range priorities are clamped";
  CU_ASSERT(cuStreamGetPriority(clampLo, &p));
  EXPECT_EQ(p, least);
  unsigned flags = 99;
  CU_ASSERT(cuStreamGetFlags(hi, &flags));
  EXPECT_EQ(flags, static_cast<unsigned>(CU_STREAM_NON_BLOCKING));
  CU_ASSERT(cuStreamGetFlags(lo, &flags));
  EXPECT_EQ(flags, static_cast<unsigned>(CU_STREAM_DEFAULT));
  CUcontext sc = nullptr;
  CU_ASSERT(cuStreamGetCtx(hi, &sc));
  EXPECT_EQ(sc, primary_);
  // No green contexts: success and NULL, for created and special streams alike (cuBLAS and cuDNN
  // from PyPI ask this and fail to start on an error).
  for (CUstream s : {hi, static_cast<CUstream>(nullptr), CU_STREAM_LEGACY, CU_STREAM_PER_THREAD}) {
    CUgreenCtx green = reinterpret_cast<CUgreenCtx>(uintptr_t{1});
    CU_ASSERT(cuStreamGetGreenCtx(s, &green));
    EXPECT_EQ(green, nullptr);
  }
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamGetGreenCtx(hi, nullptr));
  unsigned long long id1 = 0, id2 = 0;
  CU_ASSERT(cuStreamGetId(hi, &id1));
  CU_ASSERT(cuStreamGetId(lo, &id2));
  EXPECT_NE(id1, id2);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamCreate(&plain, 0x80));

  // Work on a stream completes in order.
  CUdeviceptr d = 0;
  CU_ASSERT(cuMemAlloc(&d, 4096));
  std::vector<uint32_t> host(1024, 7), back(1024, 0);
  CU_ASSERT(cuMemcpyHtoDAsync(d, host.data(), 4096, hi));
  CU_ASSERT(cuMemsetD32Async(d, 0xdeadbeef, 16, hi));
  CU_ASSERT(cuMemcpyDtoHAsync(back.data(), d, 4096, hi));
  CU_ASSERT(cuStreamSynchronize(hi));
  CU_EXPECT(cuStreamQuery(hi));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(back[i], 0xdeadbeefu);
  for (int i = 16; i < 1024; ++i) ASSERT_EQ(back[i], 7u);
  CU_ASSERT(cuMemFree(d));

  for (CUstream s : {hi, lo, plain, clampHi, clampLo}) CU_EXPECT(cuStreamDestroy(s));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamDestroy(hi));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamSynchronize(hi));
}

void sleepHost(void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms))); }

// PyTorch records an event, makes another stream wait on it and destroys it at once, while the
// record is still queued: legal in CUDA. The queued record must not write into the destroyed
// event (it did, and corrupted PyTorch's heap). The record is held back by a host function until
// the event's memory has been freed and, most likely, handed out again: blocks of every small size
// are allocated and filled with a pattern, which must survive the record running.
TEST_F(StreamsEvents, DestroyingAnEventWithAQueuedRecordIsSafe) {
  CUstream s;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  std::atomic<bool> release{false};
  auto gate = [](void* p) {
    while (!static_cast<std::atomic<bool>*>(p)->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  CU_ASSERT(cuLaunchHostFunc(s, gate, &release));
  CUevent e;
  CU_ASSERT(cuEventCreate(&e, CU_EVENT_DEFAULT));
  CU_ASSERT(cuEventRecord(e, s));
  CUstream waiter;
  CU_ASSERT(cuStreamCreate(&waiter, CU_STREAM_NON_BLOCKING));
  CU_ASSERT(cuStreamWaitEvent(waiter, e, 0));
  CU_ASSERT(cuEventDestroy(e));
  std::vector<std::vector<unsigned char>> blocks;
  for (size_t size = 16; size <= 1024; size += 8) blocks.emplace_back(size, 0xAB);
  release = true;
  CU_ASSERT(cuStreamSynchronize(s));
  CU_ASSERT(cuStreamSynchronize(waiter));
  for (const auto& b : blocks)
    for (size_t i = 0; i < b.size(); ++i)
      ASSERT_EQ(b[i], 0xAB) << "byte " << i << " of a " << b.size() << "-byte block was overwritten";
  CU_ASSERT(cuStreamDestroy(waiter));
  CU_ASSERT(cuStreamDestroy(s));
}

TEST_F(StreamsEvents, EventsElapsedTime) {
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent start = nullptr, stop = nullptr, untimed = nullptr, never = nullptr;
  CU_ASSERT(cuEventCreate(&start, CU_EVENT_DEFAULT));
  CU_ASSERT(cuEventCreate(&stop, CU_EVENT_BLOCKING_SYNC));
  CU_ASSERT(cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
  CU_ASSERT(cuEventCreate(&never, CU_EVENT_DEFAULT));

  CU_ASSERT(cuEventRecord(start, s));
  int ms = 30;
  CU_ASSERT(cuLaunchHostFunc(s, sleepHost, &ms));
  CU_ASSERT(cuEventRecord(stop, s));
  CU_ASSERT(cuEventRecord(untimed, s));
  CU_ASSERT(cuEventSynchronize(stop));
  CU_EXPECT(cuEventQuery(stop));
  float elapsed = -1;
  CU_ASSERT(cuEventElapsedTime(&elapsed, start, stop));
  EXPECT_GE(elapsed, 25.0f) << "the host function slept 30 ms between the records";
  EXPECT_LT(elapsed, 5000.0f);
  float back = 0;
  CU_ASSERT(cuEventElapsedTime(&back, stop, start));
  EXPECT_LE(back, 0.0f);

  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(&elapsed, start, untimed));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(&elapsed, start, never));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuEventElapsedTime(nullptr, start, stop));

  // A stream waiting on an event, and events on the legacy stream.
  CU_ASSERT(cuStreamWaitEvent(s, stop, 0));
  CU_ASSERT(cuEventRecord(start, nullptr));
  CU_ASSERT(cuEventSynchronize(start));

  for (CUevent e : {start, stop, untimed, never}) CU_EXPECT(cuEventDestroy(e));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventRecord(start, s));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventQuery(start));
  CU_EXPECT(cuStreamDestroy(s));
}

// ---------------------------------------------------------------------------------------------
// Stream memory operations (v2): a wait holds its stream's later work until another stream (or
// the host) writes the value; writes land in stream order; every comparison; bad arguments refused.
TEST_F(StreamsEvents, MemoryOperationsWaitAndWriteInStreamOrder) {
  CUdeviceptr words = 0;
  CU_ASSERT(cuMemAlloc(&words, 64));
  CU_ASSERT(cuMemsetD8(words, 0, 64));
  const CUdeviceptr flag = words, out = words + 4, wide = words + 8, out64 = words + 16;
  CUstream a = nullptr, b = nullptr;
  CU_ASSERT(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
  CU_ASSERT(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
  CU_ASSERT(cuStreamWaitValue32(a, flag, 1, CU_STREAM_WAIT_VALUE_EQ));
  CU_ASSERT(cuStreamWriteValue32(a, out, 7, 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CU_EXPECT_ERR(CUDA_ERROR_NOT_READY, cuStreamQuery(a));
  uint32_t seen = 99;
  CU_ASSERT(cuMemcpyDtoH(&seen, out, 4));
  EXPECT_EQ(seen, 0u) << "the write after the wait ran before the value came";
  CU_ASSERT(cuStreamWriteValue32(b, flag, 1, 0));  // releases a
  CU_ASSERT(cuStreamSynchronize(a));
  CU_ASSERT(cuMemcpyDtoH(&seen, out, 4));
  EXPECT_EQ(seen, 7u);

  // 64-bit through the batch call: write, then wait for a bit of it (AND), then a barrier.
  CUstreamBatchMemOpParams ops[3] = {};
  ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  ops[0].writeValue.address = wide;
  ops[0].writeValue.value64 = 0x100000000ull;
  ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  ops[1].waitValue.address = wide;
  ops[1].waitValue.value64 = 0x100000000ull;
  ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_AND;
  ops[2].memoryBarrier.operation = CU_STREAM_MEM_OP_BARRIER;
  CU_ASSERT(cuStreamBatchMemOp(a, 3, ops, 0));
  CU_ASSERT(cuStreamWriteValue64(a, out64, 0xfeedfacecafeull, 0));
  CU_ASSERT(cuStreamSynchronize(a));
  uint64_t seen64 = 0;
  CU_ASSERT(cuMemcpyDtoH(&seen64, out64, 8));
  EXPECT_EQ(seen64, 0xfeedfacecafeull);

  // GEQ is cyclic: 5 is "after" 0xfffffffe at 32 bits, so a wait for >= 0xfffffff0 passes at 5.
  CU_ASSERT(cuStreamWriteValue32(a, flag, 5, 0));
  CU_ASSERT(cuStreamWaitValue32(a, flag, 0xfffffff0u, CU_STREAM_WAIT_VALUE_GEQ));
  // NOR: ~(5 | 0) is non-zero at 32 bits: passes.
  CU_ASSERT(cuStreamWaitValue32(a, flag, 0, CU_STREAM_WAIT_VALUE_NOR));
  CU_ASSERT(cuStreamSynchronize(a));

  uint32_t host = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue32(a, out + 1, 1, 0));  // misaligned
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue64(a, out, 1, 0));      // 8-byte alignment
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue32(a, reinterpret_cast<CUdeviceptr>(&host), 1, 0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue32(a, words + 64, 1, 0));  // one past the end
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue32(a, out, 1, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWaitValue32(a, flag, 1, CU_STREAM_WAIT_VALUE_FLUSH));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamBatchMemOp(a, 0, ops, 0));
  std::vector<CUstreamBatchMemOpParams> many(256, ops[2]);  // barriers: at most 255 in one call
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamBatchMemOp(a, 256, many.data(), 0));
  CU_EXPECT(cuStreamBatchMemOp(a, 255, many.data(), 0));
  CUdeviceptr managed = 0;
  CU_ASSERT(cuMemAllocManaged(&managed, 64, CU_MEM_ATTACH_GLOBAL));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue32(a, managed, 1, 0));  // cuda.h: not on managed memory
  CU_EXPECT(cuMemFree(managed));
  ops[0].operation = CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuStreamBatchMemOp(a, 1, ops, 0));
  // Not recorded into graphs: the capture ends invalid.
  CU_ASSERT(cuStreamBeginCapture(b, CU_STREAM_CAPTURE_MODE_RELAXED));
  CU_EXPECT_ERR(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, cuStreamWriteValue32(b, out, 1, 0));
  CUgraph g = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, cuStreamEndCapture(b, &g));
  CU_EXPECT(cuStreamDestroy(a));
  CU_EXPECT(cuStreamDestroy(b));
  CU_EXPECT(cuMemFree(words));
}

// A memset captured at an address nothing allocated is recorded, as the real driver does (cuDNN
// 9.28 captures one at 0x80 and drops the graph; ONNX Runtime's first convolution failed when
// simgpu refused it); outside capture the address is checked at once.
TEST_F(StreamsEvents, CapturedMemsetIsRecordedWithoutLookingTheAddressUp) {
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CU_ASSERT(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  CU_EXPECT(cuMemsetD8Async(0x80, 0, 0x4000, s));
  CUgraph g = nullptr;
  CU_ASSERT(cuStreamEndCapture(s, &g));
  ASSERT_NE(g, nullptr);
  CU_EXPECT(cuGraphDestroy(g));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemsetD8Async(0x80, 0, 0x4000, s));
  CU_EXPECT(cuStreamDestroy(s));
}

// The first ABIs whose signatures did not change run today's; the profiler calls succeed in a
// context (no profiler attached); cuProfilerInitialize is NOT_SUPPORTED since CUDA 12.
TEST_F(Contexts, FirstAbisAndProfilerControl) {
  void* drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(drv, nullptr);
  auto create = reinterpret_cast<CUresult (*)(CUcontext*, unsigned, CUdevice)>(dlsym(drv, "cuCtxCreate"));
  auto destroy = reinterpret_cast<CUresult (*)(CUcontext)>(dlsym(drv, "cuCtxDestroy"));
  auto pop = reinterpret_cast<CUresult (*)(CUcontext*)>(dlsym(drv, "cuCtxPopCurrent"));
  auto push = reinterpret_cast<CUresult (*)(CUcontext)>(dlsym(drv, "cuCtxPushCurrent"));
  auto streamDestroy = reinterpret_cast<CUresult (*)(CUstream)>(dlsym(drv, "cuStreamDestroy"));
  auto eventDestroy = reinterpret_cast<CUresult (*)(CUevent)>(dlsym(drv, "cuEventDestroy"));
  auto start = reinterpret_cast<CUresult (*)()>(dlsym(drv, "cuProfilerStart"));
  auto stop = reinterpret_cast<CUresult (*)()>(dlsym(drv, "cuProfilerStop"));
  auto init = reinterpret_cast<CUresult (*)(const char*, const char*, int)>(dlsym(drv, "cuProfilerInitialize"));
  ASSERT_TRUE(create && destroy && pop && push && streamDestroy && eventDestroy && start && stop && init);
  CUcontext c = nullptr, popped = nullptr;
  CU_ASSERT(create(&c, 0, dev_));
  CUcontext cur = nullptr;
  CU_ASSERT(cuCtxGetCurrent(&cur));
  EXPECT_EQ(cur, c);
  CU_EXPECT(start());
  CU_EXPECT(stop());
  CU_EXPECT_ERR(CUDA_ERROR_NOT_SUPPORTED, init("cfg", "out", 0));
  CUstream s = nullptr;
  CUevent e = nullptr;
  CU_ASSERT(cuStreamCreate(&s, 0));
  CU_ASSERT(cuEventCreate(&e, 0));
  CU_EXPECT(streamDestroy(s));
  CU_EXPECT(eventDestroy(e));
  CU_ASSERT(pop(&popped));
  EXPECT_EQ(popped, c);
  CU_ASSERT(push(c));
  CU_EXPECT(destroy(c));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, destroy(c));
  CU_ASSERT(cuCtxSetCurrent(nullptr));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, start());
  CU_ASSERT(cuCtxSetCurrent(primary_));
  // The first cuDevicePrimaryCtxSetFlags refuses an active primary context; _v2 takes it.
  auto setFlags = reinterpret_cast<CUresult (*)(CUdevice, unsigned)>(dlsym(drv, "cuDevicePrimaryCtxSetFlags"));
  ASSERT_NE(setFlags, nullptr);
  CU_EXPECT_ERR(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, setFlags(dev_, CU_CTX_SCHED_SPIN));
  unsigned flags = 0;
  int active = 0;
  CU_ASSERT(cuDevicePrimaryCtxGetState(dev_, &flags, &active));
  CU_ASSERT(cuDevicePrimaryCtxSetFlags(dev_, flags));
}

TEST_F(Errors, NamesAndStrings) {
  struct Case {
    CUresult code;
    const char* name;
    const char* text;
  };
  const Case cases[] = {
      {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
      {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
      {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
      {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
      {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", nullptr},
      {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", nullptr},
      {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", nullptr},
      {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", nullptr},
      {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
      {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
  };
  for (const Case& c : cases) {
    const char* name = nullptr;
    const char* text = nullptr;
    CU_EXPECT(cuGetErrorName(c.code, &name));
    CU_EXPECT(cuGetErrorString(c.code, &text));
    ASSERT_NE(name, nullptr) << c.name;
    ASSERT_NE(text, nullptr) << c.name;
    EXPECT_STREQ(name, c.name);
    if (c.text) {
      EXPECT_STREQ(text, c.text);
    }
    EXPECT_GT(std::strlen(text), 0u);
  }
  const char* s = reinterpret_cast<const char*>(0x1);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuGetErrorName(static_cast<CUresult>(123456), &s));
  EXPECT_EQ(s, nullptr);
  s = reinterpret_cast<const char*>(0x1);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuGetErrorString(static_cast<CUresult>(123456), &s));
  EXPECT_EQ(s, nullptr);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuGetErrorName(CUDA_SUCCESS, nullptr));
}

// ---------------------------------------------------------------------------------------------
TEST_F(Memory, AllocCopyFree) {
  const size_t before = freeMem();
  CUdeviceptr a = 0, b = 0;
  CU_ASSERT(cuMemAlloc(&a, kMiB));
  CU_ASSERT(cuMemAlloc(&b, kMiB));
  EXPECT_NE(a, 0u);
  EXPECT_EQ(a % 256, 0u) << "cuMemAlloc alignment";
  EXPECT_EQ(freeMem(), before - 2 * kMiB);

  std::vector<uint8_t> src(kMiB), dst(kMiB, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  CU_ASSERT(cuMemcpyHtoD(a, src.data(), kMiB));
  CU_ASSERT(cuMemcpyDtoD(b, a, kMiB));
  CU_ASSERT(cuMemcpyDtoH(dst.data(), b, kMiB));
  EXPECT_EQ(src, dst);
  // Offsets inside an allocation.
  std::vector<uint8_t> part(1000);
  CU_ASSERT(cuMemcpyDtoH(part.data(), a + 12345, part.size()));
  EXPECT_EQ(std::memcmp(part.data(), src.data() + 12345, part.size()), 0);
  // cuMemcpy with unified addresses (device to host memory here).
  std::vector<uint8_t> viaUnified(4096, 0);
  CU_ASSERT(cuMemcpy(reinterpret_cast<CUdeviceptr>(viaUnified.data()), a, viaUnified.size()));
  EXPECT_EQ(std::memcmp(viaUnified.data(), src.data(), viaUnified.size()), 0);

  // Copies past the end of an allocation are refused, not performed.
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpyHtoD(a + kMiB - 16, src.data(), 32));

  CU_ASSERT(cuMemFree(a));
  CU_ASSERT(cuMemFree(b));
  EXPECT_EQ(freeMem(), before);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFree(a));  // double free
  CU_EXPECT(cuMemFree(0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemAlloc(&a, 0));
  size_t total = 0;
  CU_ASSERT(cuDeviceTotalMem(&total, dev_));
  CU_EXPECT_ERR(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&a, total + kMiB));
  EXPECT_EQ(freeMem(), before);
}

TEST_F(Memory, Memsets) {
  CUdeviceptr d = 0;
  CU_ASSERT(cuMemAlloc(&d, 64 * kKiB));
  CU_ASSERT(cuMemsetD8(d, 0, 64 * kKiB));
  CU_ASSERT(cuMemsetD32(d + 64, 0x12345678u, 100));
  std::vector<uint32_t> w(16 * 1024);
  CU_ASSERT(cuMemcpyDtoH(w.data(), d, 64 * kKiB));
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], (i >= 16 && i < 116) ? 0x12345678u : 0u) << i;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemsetD32(d + 2, 1, 4));  // misaligned
  CU_ASSERT(cuMemsetD16(d, 0xabcd, 3));
  uint16_t h[4] = {};
  CU_ASSERT(cuMemcpyDtoH(h, d, sizeof h));
  EXPECT_EQ(h[0], 0xabcd);
  EXPECT_EQ(h[2], 0xabcd);
  EXPECT_EQ(h[3], 0);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemsetD8(d + 64 * kKiB - 8, 1, 16));  // past the end
  CU_ASSERT(cuMemFree(d));
}

TEST_F(Memory, PitchAndMemset2D) {
  const size_t before = freeMem();
  CUdeviceptr d = 0;
  size_t pitch = 0;
  const size_t width = 100, height = 8;
  CU_ASSERT(cuMemAllocPitch(&d, &pitch, width, height, 4));
  EXPECT_GE(pitch, width);
  EXPECT_EQ(pitch % 32, 0u);
  EXPECT_EQ(freeMem(), before - pitch * height);
  CU_ASSERT(cuMemsetD8(d, 0, pitch * height));
  CU_ASSERT(cuMemsetD2D8(d, pitch, 0xab, width, height));
  std::vector<uint8_t> h(pitch * height);
  CU_ASSERT(cuMemcpyDtoH(h.data(), d, h.size()));
  for (size_t y = 0; y < height; ++y)
    for (size_t x = 0; x < pitch; ++x) ASSERT_EQ(h[y * pitch + x], x < width ? 0xab : 0) << x << "," << y;

  // 2D copy out of the pitched allocation into a packed host buffer.
  std::vector<uint8_t> packed(width * height, 0);
  CUDA_MEMCPY2D c{};
  c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  c.srcDevice = d;
  c.srcPitch = pitch;
  c.dstMemoryType = CU_MEMORYTYPE_HOST;
  c.dstHost = packed.data();
  c.dstPitch = width;
  c.WidthInBytes = width;
  c.Height = height;
  CU_ASSERT(cuMemcpy2D(&c));
  for (uint8_t v : packed) ASSERT_EQ(v, 0xab);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemAllocPitch(&d, &pitch, width, height, 3));
  CU_ASSERT(cuMemFree(d));
  EXPECT_EQ(freeMem(), before);
}

TEST_F(Memory, AddressRangeAndPointerAttributes) {
  CUdeviceptr d = 0;
  CU_ASSERT(cuMemAlloc(&d, kMiB));
  CUdeviceptr base = 0;
  size_t size = 0;
  CU_ASSERT(cuMemGetAddressRange(&base, &size, d + 4321));
  EXPECT_EQ(base, d);
  EXPECT_EQ(size, kMiB);
  CU_ASSERT(cuMemGetAddressRange(&base, nullptr, d + kMiB - 1));
  EXPECT_EQ(base, d);
  int local = 0;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(&local)));

  CUmemorytype type = CU_MEMORYTYPE_HOST;
  CU_ASSERT(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d + 10));
  EXPECT_EQ(type, CU_MEMORYTYPE_DEVICE);
  CUcontext ctx = nullptr;
  CU_ASSERT(cuPointerGetAttribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, d));
  EXPECT_EQ(ctx, primary_);
  int ordinal = -1;
  CU_ASSERT(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d));
  EXPECT_EQ(ordinal, 0);
  CUdeviceptr start = 0;
  CU_ASSERT(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, d + 77));
  EXPECT_EQ(start, d);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE,
                cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(&local)));

  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_CONTEXT,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID};
  unsigned memType = 0;
  CUcontext actx = nullptr;
  int aord = -1, managed = -1;
  size_t rsize = 0;
  unsigned long long id1 = 0, id2 = 0;
  void* data[] = {&memType, &actx, &aord, &managed, &rsize, &id1};
  CU_ASSERT(cuPointerGetAttributes(6, attrs, data, d + 5));
  EXPECT_EQ(memType, static_cast<unsigned>(CU_MEMORYTYPE_DEVICE));
  EXPECT_EQ(actx, primary_);
  EXPECT_EQ(aord, 0);
  EXPECT_EQ(managed, 0);
  EXPECT_EQ(rsize, kMiB);
  CUdeviceptr other = 0;
  CU_ASSERT(cuMemAlloc(&other, 4096));
  data[5] = &id2;
  CU_ASSERT(cuPointerGetAttributes(6, attrs, data, other));
  EXPECT_NE(id1, id2) << "buffer ids are unique";
  // Memory the driver does not know: success, null/zero values.
  memType = 99;
  actx = primary_;
  CU_ASSERT(cuPointerGetAttributes(2, attrs, data, reinterpret_cast<CUdeviceptr>(&local)));
  EXPECT_EQ(memType, 0u);
  EXPECT_EQ(actx, nullptr);
  CU_ASSERT(cuMemFree(d));
  CU_ASSERT(cuMemFree(other));
}

TEST_F(Memory, ManagedHostAccess) {
  CUdeviceptr m = 0;
  CU_ASSERT(cuMemAllocManaged(&m, 64 * kKiB, CU_MEM_ATTACH_GLOBAL));
  auto* host = reinterpret_cast<uint32_t*>(m);
  for (int i = 0; i < 16 * 1024; ++i) host[i] = static_cast<uint32_t>(i * 3);  // direct host access
  std::vector<uint32_t> back(16 * 1024);
  CU_ASSERT(cuMemcpyDtoH(back.data(), m, 64 * kKiB));
  for (int i = 0; i < 16 * 1024; ++i) ASSERT_EQ(back[i], static_cast<uint32_t>(i * 3));
  CU_ASSERT(cuMemsetD32(m + 16, 0xfeedu, 4));
  EXPECT_EQ(host[4], 0xfeedu);  // device writes are visible to the host
  int isManaged = 0;
  CU_ASSERT(cuPointerGetAttribute(&isManaged, CU_POINTER_ATTRIBUTE_IS_MANAGED, m));
  EXPECT_EQ(isManaged, 1);
  void* hp = nullptr;
  CU_ASSERT(cuPointerGetAttribute(&hp, CU_POINTER_ATTRIBUTE_HOST_POINTER, m));
  EXPECT_EQ(hp, reinterpret_cast<void*>(m));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemAllocManaged(&m, 4096, 0x100));
  CU_ASSERT(cuMemFree(reinterpret_cast<CUdeviceptr>(host)));
}

TEST_F(Memory, HostAllocMapped) {
  const size_t before = freeMem();
  void* p = nullptr;
  CU_ASSERT(cuMemHostAlloc(&p, 64 * kKiB, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(freeMem(), before) << "page-locked host memory is not device memory";
  unsigned flags = 0;
  CU_ASSERT(cuMemHostGetFlags(&flags, p));
  EXPECT_TRUE(flags & CU_MEMHOSTALLOC_DEVICEMAP);
  EXPECT_TRUE(flags & CU_MEMHOSTALLOC_PORTABLE);
  CUdeviceptr dp = 0;
  CU_ASSERT(cuMemHostGetDevicePointer(&dp, p, 0));
  ASSERT_NE(dp, 0u);
  auto* h = static_cast<uint8_t*>(p);
  for (size_t i = 0; i < 64 * kKiB; ++i) h[i] = static_cast<uint8_t>(i);
  std::vector<uint8_t> back(64 * kKiB);
  CU_ASSERT(cuMemcpyDtoH(back.data(), dp, back.size()));  // read through the device mapping
  EXPECT_EQ(std::memcmp(back.data(), h, back.size()), 0);
  CU_ASSERT(cuMemsetD8(dp + 100, 0x5a, 10));  // write through it
  EXPECT_EQ(h[100], 0x5a);
  EXPECT_EQ(h[109], 0x5a);
  EXPECT_EQ(h[110], 110);
  unsigned type = 0;
  CU_ASSERT(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(p)));
  EXPECT_EQ(type, static_cast<unsigned>(CU_MEMORYTYPE_HOST));
  CU_ASSERT(cuMemFreeHost(p));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFreeHost(p));
}

// Freeing memory that queued work still uses: the real driver waits for the work (cuMemFreeHost
// synchronises; a context's memory goes only after its work is done). simgpu's device and pinned
// memory is host memory of this process, so freeing it early makes the stream worker write into
// unmapped memory. Each case runs in a child process (PendingWorkChild), where a failure is a crash.
std::string describeStatus(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

TEST_F(Memory, FreesWaitForPendingWork) {
  for (const char* c : {"free", "freehost", "primaryrelease"}) {
    int status = -1;
    const std::string out = runSelf("PendingWorkChild.Run", {std::string("SIMGPU_TEST_PENDING_CASE=") + c}, &status);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "case " << c << ": " << describeStatus(status) << "\n" << out;
  }
}

void sleep100(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }

// Child half of Memory.FreesWaitForPendingWork.
TEST(PendingWorkChild, Run) {
  const char* which = std::getenv("SIMGPU_TEST_PENDING_CASE");
  if (!which) GTEST_SKIP() << "run by Memory.FreesWaitForPendingWork";
  const std::string c = which;
  CUcontext ctx = nullptr;
  CU_ASSERT(cuInit(0));
  CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx, 0));
  CU_ASSERT(cuCtxSetCurrent(ctx));
  const size_t n = 4 * kMiB;
  CUdeviceptr d = 0;
  CU_ASSERT(cuMemAlloc(&d, n));
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CU_ASSERT(cuLaunchHostFunc(s, sleep100, nullptr));  // keeps what follows queued for a while
  if (c == "free") {
    std::vector<uint8_t> src(n, 1);
    CU_ASSERT(cuMemcpyHtoDAsync(d, src.data(), n, s));
    CU_ASSERT(cuMemsetD8Async(d, 2, n, s));
    CU_EXPECT(cuMemFree(d));  // waits for the memset
    CU_EXPECT(cuStreamSynchronize(s));
  } else if (c == "freehost") {
    void* h = nullptr;
    CU_ASSERT(cuMemHostAlloc(&h, n, 0));
    CU_ASSERT(cuMemsetD8(d, 3, n));
    CU_ASSERT(cuMemcpyDtoHAsync(h, d, n, s));
    CU_EXPECT(cuMemFreeHost(h));  // cudaFreeHost synchronises: the copy completes first
    CU_EXPECT(cuStreamSynchronize(s));
  } else if (c == "primaryrelease") {
    // A kernel whose host body writes the buffer, queued behind the sleep.
    const std::vector<char> image = readFile(SIMGPU_TEST_FATBIN);
    CUmodule m = nullptr;
    CU_ASSERT(cuModuleLoadData(&m, image.data()));
    CUfunction f = nullptr;
    CU_ASSERT(cuModuleGetFunction(&f, m, "_Z5scalePffi"));
    float a = 2.0f;
    int count = static_cast<int>(n / sizeof(float));
    void* params[] = {&d, &a, &count};
    CU_ASSERT(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr));
    CU_EXPECT(cuDevicePrimaryCtxRelease(0));  // the last reference: the context and its memory go
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the worker reach the memset
  }
  std::printf("case %s done\n", which);
}

// ---------------------------------------------------------------------------------------------
using Modules = Driver;

void loadImage(const char* path, CUmodule* m) {
  const std::vector<char> image = readFile(path);
  ASSERT_GT(image.size(), 64u) << "cannot read " << path;
  CU_ASSERT(cuModuleLoadData(m, image.data()));
}

void scaleLaunchChecks(CUmodule m, bool viaEx) {
  CUfunction f = nullptr;
  CU_ASSERT(cuModuleGetFunction(&f, m, "_Z5scalePffi"));
  CUdeviceptr d = 0;
  const int n = 1000;
  CU_ASSERT(cuMemAlloc(&d, n * sizeof(float)));
  std::vector<float> h(n);
  for (int i = 0; i < n; ++i) h[i] = static_cast<float>(i);
  CU_ASSERT(cuMemcpyHtoD(d, h.data(), n * sizeof(float)));
  float a = 2.5f;
  int count = n;
  void* params[] = {&d, &a, &count};
  const int launchesBefore = gScale.count.load();
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  if (viaEx) {
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PRIORITY;
    attr.value.priority = 0;
    CUlaunchConfig cfg{};
    cfg.gridDimX = 4;
    cfg.gridDimY = 2;
    cfg.gridDimZ = 1;
    cfg.blockDimX = 128;
    cfg.blockDimY = 1;
    cfg.blockDimZ = 2;
    cfg.sharedMemBytes = 512;
    cfg.hStream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CU_ASSERT(cuLaunchKernelEx(&cfg, f, params, nullptr));
  } else {
    CU_ASSERT(cuLaunchKernel(f, 4, 2, 1, 128, 1, 2, 512, s, params, nullptr));
  }
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(gScale.count.load(), launchesBefore + 1) << "the host body did not run";
  EXPECT_EQ(gScale.name, "_Z5scalePffi");
  EXPECT_EQ(gScale.grid[0], 4u);
  EXPECT_EQ(gScale.grid[1], 2u);
  EXPECT_EQ(gScale.grid[2], 1u);
  EXPECT_EQ(gScale.block[0], 128u);
  EXPECT_EQ(gScale.block[2], 2u);
  EXPECT_EQ(gScale.sharedMem, 512u);
  EXPECT_EQ(gScale.device, 0);
  EXPECT_EQ(gScale.p, reinterpret_cast<void*>(d));
  std::vector<float> back(n);
  CU_ASSERT(cuMemcpyDtoH(back.data(), d, n * sizeof(float)));
  for (int i = 0; i < n; ++i) ASSERT_EQ(back[i], 2.5f * static_cast<float>(i)) << i;
  CU_ASSERT(cuStreamDestroy(s));
  CU_ASSERT(cuMemFree(d));
}

void paramInfoChecks(CUmodule m) {
  CUfunction f = nullptr;
  CU_ASSERT(cuModuleGetFunction(&f, m, "_Z7params3Pfid"));
  const size_t wantOffset[] = {0, 8, 16}, wantSize[] = {8, 4, 8};
  for (size_t i = 0; i < 3; ++i) {
    size_t off = 99, size = 99;
    CU_ASSERT(cuFuncGetParamInfo(f, i, &off, &size));
    EXPECT_EQ(off, wantOffset[i]) << "param " << i;
    EXPECT_EQ(size, wantSize[i]) << "param " << i;
  }
  size_t off = 0, size = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuFuncGetParamInfo(f, 3, &off, &size));
}

TEST_F(Modules, FatbinLoadLaunchParamsGlobals) {
  CUmodule m = nullptr;
  ASSERT_NO_FATAL_FAILURE(loadImage(SIMGPU_TEST_FATBIN, &m));
  ASSERT_NO_FATAL_FAILURE(scaleLaunchChecks(m, false));
  ASSERT_NO_FATAL_FAILURE(paramInfoChecks(m));

  CUfunction f = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, cuModuleGetFunction(&f, m, "_Z9no_kernelv"));
  unsigned nfn = 0;
  CU_ASSERT(cuModuleGetFunctionCount(&nfn, m));
  EXPECT_EQ(nfn, 3u);

  // Parameters arrive as passed.
  CU_ASSERT(cuModuleGetFunction(&f, m, "_Z7params3Pfid"));
  float* fp = reinterpret_cast<float*>(0x1000);
  int n = 77;
  double dv = 3.25;
  void* params[] = {&fp, &n, &dv};
  CU_ASSERT(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));
  n = -1;  // the launch owns a copy of its arguments
  CU_ASSERT(cuCtxSynchronize());
  EXPECT_EQ(gParams3.p, fp);
  EXPECT_EQ(gParams3.n, 77);
  EXPECT_EQ(gParams3.d, 3.25);
  EXPECT_FALSE(gParams3.hadExtra);
  // The same through a packed argument buffer (`extra`).
  struct {
    float* p;
    int n;
    int pad;
    double d;
  } packed = {fp, 78, 0, 4.5};
  size_t packedSize = sizeof packed;
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &packedSize,
                   CU_LAUNCH_PARAM_END};
  const int before = gParams3.count.load();
  CU_ASSERT(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, extra));
  packed.n = -1;
  CU_ASSERT(cuCtxSynchronize());
  EXPECT_EQ(gParams3.count.load(), before + 1);
  EXPECT_TRUE(gParams3.hadExtra);
  EXPECT_EQ(gParams3.p, fp);
  EXPECT_EQ(gParams3.n, 78);
  EXPECT_EQ(gParams3.d, 4.5);
  // Invalid launch configurations.
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(f, 1, 1, 1, 2048, 1, 1, 0, nullptr, params, nullptr));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuLaunchKernel(f, 0, 1, 1, 32, 1, 1, 0, nullptr, params, nullptr));

  // A kernel without a host body completes doing nothing.
  CUfunction nobody = nullptr;
  CU_ASSERT(cuModuleGetFunction(&nobody, m, "nobody"));
  int* np = nullptr;
  void* nparams[] = {&np};
  CU_EXPECT(cuLaunchKernel(nobody, 1, 1, 1, 1, 1, 1, 0, nullptr, nparams, nullptr));
  CU_EXPECT(cuCtxSynchronize());

  // A module global: `__device__ int table[64]`.
  CUdeviceptr table = 0;
  size_t bytes = 0;
  CU_ASSERT(cuModuleGetGlobal(&table, &bytes, m, "table"));
  EXPECT_EQ(bytes, 256u);
  ASSERT_NE(table, 0u);
  CUdeviceptr table2 = 0;
  CU_ASSERT(cuModuleGetGlobal(&table2, nullptr, m, "table"));
  EXPECT_EQ(table, table2) << "a global has one address";
  int values[64];
  for (int i = 0; i < 64; ++i) values[i] = i * i;
  CU_ASSERT(cuMemcpyHtoD(table, values, sizeof values));
  int back[64] = {};
  CU_ASSERT(cuMemcpyDtoH(back, table, sizeof back));
  EXPECT_EQ(std::memcmp(values, back, sizeof values), 0);
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, cuModuleGetGlobal(&table, &bytes, m, "no_such_global"));

  CU_ASSERT(cuModuleUnload(m));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuModuleGetFunction(&f, m, "_Z5scalePffi"));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuModuleUnload(m));
}

TEST_F(Modules, LaunchKernelEx) {
  CUmodule m = nullptr;
  ASSERT_NO_FATAL_FAILURE(loadImage(SIMGPU_TEST_FATBIN, &m));
  ASSERT_NO_FATAL_FAILURE(scaleLaunchChecks(m, true));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuLaunchKernelEx(nullptr, nullptr, nullptr, nullptr));
  CU_ASSERT(cuModuleUnload(m));
}

// PTX text: each .entry's parameters from its declaration, laid out as the cubin's (nvcc's PTX of
// the same kernels), a by-value struct at its .align, a pointer whose .align is its pointee's; a
// declaration simgpu does not understand drops the layouts of that text, never guesses them.
TEST_F(Modules, PtxLoadKnowsEachKernelsParameters) {
  std::vector<char> image = readFile(SIMGPU_TEST_PTX);
  ASSERT_GT(image.size(), 64u) << "cannot read " << SIMGPU_TEST_PTX;
  image.push_back('\0');
  CUmodule m = nullptr;
  CU_ASSERT(cuModuleLoadData(&m, image.data()));
  ASSERT_NO_FATAL_FAILURE(scaleLaunchChecks(m, false));
  ASSERT_NO_FATAL_FAILURE(paramInfoChecks(m));
  CUfunction f = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, cuModuleGetFunction(&f, m, "not_in_the_ptx"));
  CU_ASSERT(cuModuleUnload(m));

  static const char kPtx[] =
      ".version 8.0\n.target sm_90\n.address_size 64\n"
      ".visible .entry k(.param .u8 c, .param .align 8 .b8 s[24], .param .u64 .ptr .global .align 1 q, .param .f32 x)\n"
      "{\n ret;\n}\n"
      ".visible .entry none()\n{\n ret;\n}\n";
  CU_ASSERT(cuModuleLoadData(&m, kPtx));
  CU_ASSERT(cuModuleGetFunction(&f, m, "k"));
  const size_t wantOffset[] = {0, 8, 32, 40}, wantSize[] = {1, 24, 8, 4};
  for (size_t i = 0; i < 4; ++i) {
    size_t off = 99, size = 99;
    CU_ASSERT(cuFuncGetParamInfo(f, i, &off, &size));
    EXPECT_EQ(off, wantOffset[i]) << "param " << i;
    EXPECT_EQ(size, wantSize[i]) << "param " << i;
  }
  CU_ASSERT(cuModuleGetFunction(&f, m, "none"));
  size_t off = 0, size = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuFuncGetParamInfo(f, 0, &off, &size));  // no parameters
  CU_ASSERT(cuModuleUnload(m));

  // Comments are not declarations: neither the commented-out entry nor the bracket in a comment.
  static const char kCommented[] =
      "// .visible .entry ghost(.param .u64 g)\n.version 8.0\n.target sm_90\n.address_size 64\n"
      ".visible .entry c(.param .u64 p /* buf[4096] */, .param .u32 n) // .param .u64 q\n{\n ret;\n}\n";
  CU_ASSERT(cuModuleLoadData(&m, kCommented));
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, cuModuleGetFunction(&f, m, "ghost"));
  CU_ASSERT(cuModuleGetFunction(&f, m, "c"));
  CU_ASSERT(cuFuncGetParamInfo(f, 0, &off, &size));
  EXPECT_EQ(size, 8u);
  CU_ASSERT(cuFuncGetParamInfo(f, 1, &off, &size));
  EXPECT_EQ(off, 8u);
  EXPECT_EQ(size, 4u);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuFuncGetParamInfo(f, 2, &off, &size));
  // A PTX module's globals are not listed: any name maps (as before layouts were read).
  CUdeviceptr gp = 0;
  size_t gbytes = 0;
  CU_ASSERT(cuModuleGetGlobal(&gp, &gbytes, m, "some_constant"));
  EXPECT_GT(gbytes, 0u);
  CU_ASSERT(cuModuleUnload(m));

  // Not understood (a texture reference; more than a launch may pass): no layout, never a guess.
  for (const char* odd : {".version 8.0\n.target sm_90\n.address_size 64\n"
                          ".visible .entry t(.param .texref tex, .param .u64 p)\n{\n ret;\n}\n",
                          ".version 8.0\n.target sm_90\n.address_size 64\n"
                          ".visible .entry t(.param .align 8 .b8 big[32768])\n{\n ret;\n}\n",
                          ".version 8.0\n.target sm_90\n.address_size 64\n"
                          ".visible .entry t(.param .f16x2 h)\n{\n ret;\n}\n",
                          ".version 8.0\n.target sm_90\n.address_size 64\n"
                          ".visible .entry t(.param .b8 a[4][2])\n{\n ret;\n}\n"}) {
    CU_ASSERT(cuModuleLoadData(&m, odd));
    CU_ASSERT(cuModuleGetFunction(&f, m, "t"));
    CU_EXPECT_ERR(CUDA_ERROR_NOT_SUPPORTED, cuFuncGetParamInfo(f, 0, &off, &size));
    CU_ASSERT(cuModuleUnload(m));
  }
}

TEST_F(Modules, CubinLoad) {
  CUmodule m = nullptr;
  ASSERT_NO_FATAL_FAILURE(loadImage(SIMGPU_TEST_CUBIN, &m));
  ASSERT_NO_FATAL_FAILURE(scaleLaunchChecks(m, false));
  ASSERT_NO_FATAL_FAILURE(paramInfoChecks(m));
  CUdeviceptr table = 0;
  size_t bytes = 0;
  CU_ASSERT(cuModuleGetGlobal(&table, &bytes, m, "table"));
  EXPECT_EQ(bytes, 256u);
  CU_ASSERT(cuModuleUnload(m));
}

TEST_F(Modules, LibraryApi) {
  const std::vector<char> image = readFile(SIMGPU_TEST_FATBIN);
  ASSERT_GT(image.size(), 64u);
  CUlibrary lib = nullptr;
  CU_ASSERT(cuLibraryLoadData(&lib, image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel k = nullptr;
  CU_ASSERT(cuLibraryGetKernel(&k, lib, "_Z7params3Pfid"));
  size_t off = 0, size = 0;
  CU_ASSERT(cuKernelGetParamInfo(k, 2, &off, &size));
  EXPECT_EQ(off, 16u);
  EXPECT_EQ(size, 8u);
  CUfunction f = nullptr;
  CU_ASSERT(cuKernelGetFunction(&f, k));
  float* fp = nullptr;
  int n = 5;
  double dv = 1.5;
  void* params[] = {&fp, &n, &dv};
  CU_ASSERT(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, params, nullptr));
  CU_ASSERT(cuCtxSynchronize());
  EXPECT_EQ(gParams3.n, 5);
  CUdeviceptr g = 0;
  size_t bytes = 0;
  CU_ASSERT(cuLibraryGetGlobal(&g, &bytes, lib, "table"));
  EXPECT_EQ(bytes, 256u);
  CU_ASSERT(cuLibraryUnload(lib));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuLibraryGetKernel(&k, lib, "_Z7params3Pfid"));
}

// ---------------------------------------------------------------------------------------------
TEST_F(Handles, InvalidHandlesAreRefused) {
  // Both readable memory that is not a handle and a wild address: neither may be dereferenced.
  alignas(64) static char notAHandle[256] = {};
  void* const bogus[] = {notAHandle, reinterpret_cast<void*>(0x1234), reinterpret_cast<void*>(~uintptr_t{0} - 4095)};
  for (void* b : bogus) {
    SCOPED_TRACE(b);
    auto s = static_cast<CUstream>(b);
    auto e = static_cast<CUevent>(b);
    auto m = static_cast<CUmodule>(b);
    auto f = static_cast<CUfunction>(b);
    auto a = static_cast<CUarray>(b);
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamDestroy(s));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamSynchronize(s));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamQuery(s));
    int prio = 0;
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamGetPriority(s, &prio));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventDestroy(e));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventRecord(e, nullptr));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventSynchronize(e));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventQuery(e));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuStreamWaitEvent(nullptr, e, 0));
    float ms = 0;
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuEventElapsedTime(&ms, e, e));
    CUfunction out = nullptr;
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuModuleGetFunction(&out, m, "_Z5scalePffi"));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuModuleUnload(m));
    CUdeviceptr gp = 0;
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuModuleGetGlobal(&gp, nullptr, m, "table"));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
    size_t off = 0;
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuFuncGetParamInfo(f, 0, &off, nullptr));
    int attr = 0;
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuFuncGetAttribute(&attr, CU_FUNC_ATTRIBUTE_NUM_REGS, f));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuArrayDestroy(a));
    CUDA_ARRAY_DESCRIPTOR desc{};
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuArrayGetDescriptor(&desc, a));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuMemcpyHtoDAsync(0, notAHandle, 16, s));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxPushCurrent(static_cast<CUcontext>(b)));
    CU_EXPECT_ERR(CUDA_ERROR_INVALID_CONTEXT, cuCtxDestroy(static_cast<CUcontext>(b)));
    // Graph objects: refused (the driver documents INVALID_VALUE for these), never dereferenced.
    EXPECT_NE(CUDA_SUCCESS, cuGraphDestroy(static_cast<CUgraph>(b)));
    EXPECT_NE(CUDA_SUCCESS, cuGraphLaunch(static_cast<CUgraphExec>(b), nullptr));
  }
}

// ---------------------------------------------------------------------------------------------
// Calls before cuInit (a process of its own: the registration runs only this suite).
TEST(BeforeInit, CallsFailWithNotInitialized) {
  int count = -1;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetCount(&count));
  CUdevice d = -1;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGet(&d, 0));
  char name[64];
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetName(name, sizeof name, 0));
  int v = 0;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 0));
  size_t total = 0;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuDeviceTotalMem(&total, 0));
  CUcontext ctx = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuDevicePrimaryCtxRetain(&ctx, 0));
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuCtxCreate(&ctx, nullptr, 0, 0));
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuCtxGetCurrent(&ctx));
  CUdeviceptr p = 0;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuMemAlloc(&p, 1024));
  size_t f = 0, t = 0;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuMemGetInfo(&f, &t));
  CUstream s = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuStreamCreate(&s, 0));
  CUmodule m = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuModuleLoadData(&m, "junk"));
  CUevent e = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_NOT_INITIALIZED, cuEventCreate(&e, 0));

  // These work without cuInit.
  int ver = 0;
  CU_EXPECT(cuDriverGetVersion(&ver));
  EXPECT_EQ(ver, 13000);
  const char* s1 = nullptr;
  CU_EXPECT(cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &s1));
  EXPECT_STREQ(s1, "CUDA_ERROR_NOT_INITIALIZED");

  // Bad flags are refused; cuInit(0) then initialises.
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuInit(1));
  CU_ASSERT(cuInit(0));
  CU_ASSERT(cuDeviceGetCount(&count));
  EXPECT_GE(count, 1);
}

// ---------------------------------------------------------------------------------------------
// Two simulated devices.
class TwoDevices : public ::testing::Test {
 protected:
  void SetUp() override {
    if (envInt("SIMGPU_DEVICES", 1) != 2) GTEST_SKIP() << "needs SIMGPU_DEVICES=2";
    ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
  }
};

TEST_F(TwoDevices, DistinctStableIdentities) {
  int count = 0;
  CU_ASSERT(cuDeviceGetCount(&count));
  ASSERT_EQ(count, 2);
  CUuuid u[2];
  std::set<std::string> buses;
  for (int i = 0; i < 2; ++i) {
    CU_ASSERT(cuDeviceGetUuid(&u[i], i));
    CUuuid again{};
    CU_ASSERT(cuDeviceGetUuid(&again, i));
    EXPECT_EQ(std::memcmp(&u[i], &again, sizeof again), 0);
    char bus[64] = {};
    CU_ASSERT(cuDeviceGetPCIBusId(bus, sizeof bus, i));
    buses.insert(bus);
    CUdevice d = -1;
    CU_ASSERT(cuDeviceGetByPCIBusId(&d, bus));
    EXPECT_EQ(d, i) << bus;
    size_t total = 0;
    CU_ASSERT(cuDeviceTotalMem(&total, i));
    EXPECT_EQ(total, expectedMemory(i));
  }
  EXPECT_NE(std::memcmp(&u[0], &u[1], sizeof u[0]), 0) << "devices share a UUID";
  EXPECT_EQ(buses.size(), 2u) << "devices share a PCI bus id";

  // The same UUIDs in another process.
  int status = -1;
  const std::string out = runSelf("TwoDevices.PrintUuids", {"SIMGPU_TEST_PRINT_UUIDS=1"}, &status);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("UUID0=" + hex(&u[0], 16)), std::string::npos) << out;
  EXPECT_NE(out.find("UUID1=" + hex(&u[1], 16)), std::string::npos) << out;
}

TEST_F(TwoDevices, ContextsPerDevice) {
  CUcontext c0 = nullptr, c1 = nullptr;
  CU_ASSERT(cuDevicePrimaryCtxRetain(&c0, 0));
  CU_ASSERT(cuDevicePrimaryCtxRetain(&c1, 1));
  EXPECT_NE(c0, c1);
  CU_ASSERT(cuCtxSetCurrent(c1));
  CUdevice d = -1;
  CU_ASSERT(cuCtxGetDevice(&d));
  EXPECT_EQ(d, 1);
  size_t f = 0, t = 0;
  CU_ASSERT(cuMemGetInfo(&f, &t));
  EXPECT_EQ(t, expectedMemory(1));
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAlloc(&p, kMiB));
  int ordinal = -1;
  CU_ASSERT(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
  EXPECT_EQ(ordinal, 1);
  size_t f2 = 0;
  CU_ASSERT(cuMemGetInfo(&f2, &t));
  EXPECT_EQ(f2, f - kMiB);
  CU_ASSERT(cuCtxSetCurrent(c0));
  size_t f0 = 0;
  CU_ASSERT(cuMemGetInfo(&f0, &t));
  EXPECT_EQ(t, expectedMemory(0));
  EXPECT_EQ(f0, t) << "device 1's allocation is not device 0's";
  CU_ASSERT(cuMemFree(p));
  CU_ASSERT(cuDevicePrimaryCtxRelease(0));
  CU_ASSERT(cuDevicePrimaryCtxRelease(1));
  (void)kGiB;
}

// Child half of DistinctStableIdentities.
TEST_F(TwoDevices, PrintUuids) {
  if (!std::getenv("SIMGPU_TEST_PRINT_UUIDS")) GTEST_SKIP() << "run by DistinctStableIdentities";
  for (int i = 0; i < 2; ++i) {
    CUuuid u{};
    CU_ASSERT(cuDeviceGetUuid(&u, i));
    std::printf("UUID%d=%s\n", i, hex(&u, 16).c_str());
  }
  std::fflush(stdout);
}

}  // namespace
