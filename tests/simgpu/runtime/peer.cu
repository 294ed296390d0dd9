// Two devices through the CUDA runtime API: identities, peer access, peer copies, per-device
// memory accounting and launches. Registered with SIMGPU_DEVICES=2 (and once more with per-device
// sizes in SIMGPU_MEMORY); on a machine with one GPU every test skips.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_check.h"
#include "simgpu/simgpu.h"

using namespace simtest;

__global__ void saxpy(int n, float a, const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

namespace {
std::atomic<int> g_lastDevice{-1};
std::atomic<int> g_saxpyLaunches{0};
}  // namespace

// Host body of saxpy(int, float, const float*, float*) on simgpu.
extern "C" void simgpu_host__Z5saxpyifPKfPf(const simgpu_launch* l) {
  int n;
  float a;
  const float* x;
  float* y;
  std::memcpy(&n, l->params[0], sizeof n);
  std::memcpy(&a, l->params[1], sizeof a);
  std::memcpy(&x, l->params[2], sizeof x);
  std::memcpy(&y, l->params[3], sizeof y);
  const long long m = std::min<long long>(n, static_cast<long long>(l->grid[0]) * l->block[0]);
  for (long long i = 0; i < m; ++i) y[i] = a * x[i] + y[i];
  g_lastDevice = l->device;
  ++g_saxpyLaunches;
}

namespace {

// Restores device 0 as the current device when a test ends.
struct DeviceGuard {
  ~DeviceGuard() { cudaSetDevice(0); }
};

#define REQUIRE_TWO_DEVICES()                                                   \
  do {                                                                          \
    if (deviceCount() < 2) GTEST_SKIP() << "needs two devices";                 \
  } while (0)

bool canAccess(int from, int to) {
  int can = 0;
  return cudaDeviceCanAccessPeer(&can, from, to) == cudaSuccess && can == 1;
}

}  // namespace

TEST(Peer, TwoDistinctDevices) {
  if (onSimgpu()) EXPECT_EQ(expectedSimgpuDevices(), deviceCount());
  REQUIRE_TWO_DEVICES();
  cudaDeviceProp p0{}, p1{};
  CUDA_ASSERT(cudaGetDeviceProperties(&p0, 0));
  CUDA_ASSERT(cudaGetDeviceProperties(&p1, 1));
  EXPECT_NE(0, std::memcmp(&p0.uuid, &p1.uuid, sizeof p0.uuid)) << "devices share a UUID";
  EXPECT_FALSE(p0.pciBusID == p1.pciBusID && p0.pciDeviceID == p1.pciDeviceID && p0.pciDomainID == p1.pciDomainID)
      << "devices share a PCI location";
  char bus0[32] = {}, bus1[32] = {};
  CUDA_ASSERT(cudaDeviceGetPCIBusId(bus0, sizeof bus0, 0));
  CUDA_ASSERT(cudaDeviceGetPCIBusId(bus1, sizeof bus1, 1));
  EXPECT_STRNE(bus0, bus1);
  int back = -1;
  CUDA_ASSERT(cudaDeviceGetByPCIBusId(&back, bus1));
  EXPECT_EQ(1, back);
  if (onSimgpu()) {
    EXPECT_EQ(0x18, p0.pciBusID);
    EXPECT_EQ(0x19, p1.pciBusID);
    for (int d = 0; d < 2; ++d) {
      cudaDeviceProp p{};
      CUDA_ASSERT(cudaGetDeviceProperties(&p, d));
      EXPECT_EQ(expectedSimgpuMemory(d), p.totalGlobalMem) << "device " << d;
      EXPECT_EQ(expectedSimgpuSms(), p.multiProcessorCount) << "device " << d;
      EXPECT_EQ(9, p.major);
    }
  }
}

TEST(Peer, CurrentDeviceIsPerThread) {
  REQUIRE_TWO_DEVICES();
  DeviceGuard guard;
  CUDA_ASSERT(cudaSetDevice(1));
  int mine = -1;
  CUDA_ASSERT(cudaGetDevice(&mine));
  EXPECT_EQ(1, mine);
  std::atomic<int> theirs{-1};
  std::thread([&] {
    int d = -1;
    if (cudaGetDevice(&d) == cudaSuccess) theirs = d;
  }).join();
  EXPECT_EQ(0, theirs.load()) << "a new thread starts on device 0";
  size_t f = 0, t = 0;
  CUDA_ASSERT(cudaMemGetInfo(&f, &t));
  if (onSimgpu()) EXPECT_EQ(expectedSimgpuMemory(1), t) << "cudaMemGetInfo reports the current device";
}

TEST(Peer, CanAccessPeer) {
  REQUIRE_TWO_DEVICES();
  int can01 = -1, can10 = -1, can00 = -1;
  CUDA_ASSERT(cudaDeviceCanAccessPeer(&can01, 0, 1));
  CUDA_ASSERT(cudaDeviceCanAccessPeer(&can10, 1, 0));
  CUDA_ASSERT(cudaDeviceCanAccessPeer(&can00, 0, 0));
  EXPECT_EQ(0, can00) << "a device is not its own peer";
  EXPECT_EQ(can01, can10);
  if (onSimgpu()) EXPECT_EQ(1, can01);
  int attr = -1;
  CUDA_ASSERT(cudaDeviceGetP2PAttribute(&attr, cudaDevP2PAttrAccessSupported, 0, 1));
  EXPECT_EQ(can01, attr);
  int bad = 0;
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaDeviceCanAccessPeer(&bad, 0, deviceCount()));
}

TEST(Peer, EnableAndDisablePeerAccess) {
  REQUIRE_TWO_DEVICES();
  if (!canAccess(0, 1)) GTEST_SKIP() << "devices are not peers";
  DeviceGuard guard;
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_EXPECT_ERR(cudaErrorInvalidValue, cudaDeviceEnablePeerAccess(1, 1));  // flags must be 0
  CUDA_ASSERT(cudaDeviceEnablePeerAccess(1, 0));
  CUDA_EXPECT_ERR(cudaErrorPeerAccessAlreadyEnabled, cudaDeviceEnablePeerAccess(1, 0));
  CUDA_ASSERT(cudaSetDevice(1));
  CUDA_ASSERT(cudaDeviceEnablePeerAccess(0, 0));  // the other direction is separate

  // With access enabled, a plain cudaMemcpy between the devices works (unified addressing).
  const size_t n = 1 << 20;
  std::vector<uint8_t> in(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) in[i] = patternByte(i, 51);
  void *d0 = nullptr, *d1 = nullptr;
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaMalloc(&d0, n));
  CUDA_ASSERT(cudaSetDevice(1));
  CUDA_ASSERT(cudaMalloc(&d1, n));
  CUDA_ASSERT(cudaMemcpy(d0, in.data(), n, cudaMemcpyDefault));
  CUDA_ASSERT(cudaMemcpy(d1, d0, n, cudaMemcpyDefault));
  CUDA_ASSERT(cudaMemcpy(out.data(), d1, n, cudaMemcpyDefault));
  EXPECT_EQ(0, std::memcmp(in.data(), out.data(), n));

  CUDA_ASSERT(cudaDeviceDisablePeerAccess(0));
  CUDA_EXPECT_ERR(cudaErrorPeerAccessNotEnabled, cudaDeviceDisablePeerAccess(0));
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaDeviceDisablePeerAccess(1));
  CUDA_EXPECT_ERR(cudaErrorPeerAccessNotEnabled, cudaDeviceDisablePeerAccess(1));
  CUDA_ASSERT(cudaFree(d0));
  CUDA_ASSERT(cudaFree(d1));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST(Peer, MemcpyPeer) {
  REQUIRE_TWO_DEVICES();
  DeviceGuard guard;
  const size_t n = 3 * MiB + 7;
  std::vector<uint8_t> in(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) in[i] = patternByte(i, 53);
  uint8_t *d0 = nullptr, *d1 = nullptr;
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaMalloc(&d0, n));
  CUDA_ASSERT(cudaSetDevice(1));
  CUDA_ASSERT(cudaMalloc(&d1, n));
  CUDA_ASSERT(cudaMemset(d1, 0, n));
  CUDA_ASSERT(cudaSetDevice(0));

  // Peer access is not enabled: cudaMemcpyPeer works regardless.
  CUDA_ASSERT(cudaMemcpy(d0, in.data(), n, cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpyPeer(d1, 1, d0, 0, n));
  CUDA_ASSERT(cudaSetDevice(1));
  CUDA_ASSERT(cudaMemcpy(out.data(), d1, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(in.data(), out.data(), n));

  // Back the other way, after changing the data on device 1.
  CUDA_ASSERT(cudaMemset(d1 + 1000, 0xab, 5000));
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaMemset(d0, 0, n));
  CUDA_ASSERT(cudaMemcpyPeer(d0 + 10, 0, d1 + 10, 1, n - 20));
  CUDA_ASSERT(cudaMemcpy(out.data(), d0, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    uint8_t want = in[i];
    if (i < 10 || i >= n - 10) want = 0;
    else if (i >= 1000 && i < 6000) want = 0xab;
    ASSERT_EQ(want, out[i]) << i;
  }
  CUDA_ASSERT(cudaFree(d0));
  CUDA_ASSERT(cudaFree(d1));
}

TEST(Peer, MemcpyPeerAsync) {
  REQUIRE_TWO_DEVICES();
  DeviceGuard guard;
  const size_t n = 1 * MiB;
  std::vector<uint8_t> in(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) in[i] = patternByte(i, 57);
  uint8_t *d0 = nullptr, *d1 = nullptr, *h = nullptr;
  CUDA_ASSERT(cudaMallocHost(&h, n));
  cudaStream_t s0, s1;
  CUDA_ASSERT(cudaSetDevice(1));
  CUDA_ASSERT(cudaMalloc(&d1, n));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaMalloc(&d0, n));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  int dev = -1;
  CUDA_ASSERT(cudaStreamGetDevice(s1, &dev));
  EXPECT_EQ(1, dev);

  std::memcpy(h, in.data(), n);
  CUDA_ASSERT(cudaMemcpyAsync(d0, h, n, cudaMemcpyHostToDevice, s0));
  CUDA_ASSERT(cudaMemcpyPeerAsync(d1, 1, d0, 0, n, s0));
  CUDA_ASSERT(cudaMemsetAsync(d0, 0, n, s0));
  CUDA_ASSERT(cudaMemcpyPeerAsync(d0, 0, d1, 1, n / 2, s0));
  CUDA_ASSERT(cudaMemcpyAsync(h, d0, n, cudaMemcpyDeviceToHost, s0));
  CUDA_ASSERT(cudaStreamSynchronize(s0));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(i < n / 2 ? in[i] : 0, h[i]) << i;

  // Cross-device ordering through an event: device 1's stream waits for device 0's work.
  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CUDA_ASSERT(cudaMemsetAsync(d0, 0x3e, n, s0));
  CUDA_ASSERT(cudaEventRecord(e, s0));
  CUDA_ASSERT(cudaSetDevice(1));
  CUDA_ASSERT(cudaStreamWaitEvent(s1, e, 0));
  CUDA_ASSERT(cudaMemcpyPeerAsync(d1, 1, d0, 0, n, s1));
  CUDA_ASSERT(cudaMemcpyAsync(h, d1, n, cudaMemcpyDeviceToHost, s1));
  CUDA_ASSERT(cudaStreamSynchronize(s1));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(0x3e, h[i]) << i;

  CUDA_ASSERT(cudaEventDestroy(e));
  CUDA_ASSERT(cudaStreamDestroy(s1));
  CUDA_ASSERT(cudaFree(d1));
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaStreamDestroy(s0));
  CUDA_ASSERT(cudaFree(d0));
  CUDA_ASSERT(cudaFreeHost(h));
}

TEST(Peer, AllocationsChargeOnlyTheirDevice) {
  REQUIRE_TWO_DEVICES();
  DeviceGuard guard;
  size_t f0a, t0a, f1a, t1a, f0b, t0b, f1b, t1b, f1c, t1c;
  CUDA_ASSERT(cudaSetDevice(0));
  memInfo(&f0a, &t0a);
  CUDA_ASSERT(cudaSetDevice(1));
  memInfo(&f1a, &t1a);
  const size_t n = 256 * MiB;
  void* p = nullptr;
  CUDA_ASSERT(cudaMalloc(&p, n));
  cudaPointerAttributes attr{};
  CUDA_ASSERT(cudaPointerGetAttributes(&attr, p));
  EXPECT_EQ(1, attr.device);
  EXPECT_EQ(cudaMemoryTypeDevice, attr.type);
  memInfo(&f1b, &t1b);
  CUDA_ASSERT(cudaSetDevice(0));
  memInfo(&f0b, &t0b);
  ASSERT_LT(f1b, f1a);
  EXPECT_GE(f1a - f1b, n) << "device 1 was charged";
  EXPECT_LE(f1a - f1b, n + (onSimgpu() ? 2 * MiB : 64 * MiB));
  if (onSimgpu()) {
    EXPECT_EQ(f0a, f0b) << "device 0 was charged for a device-1 allocation";
    EXPECT_EQ(expectedSimgpuMemory(0), t0a);
    EXPECT_EQ(expectedSimgpuMemory(1), t1a);
  } else {
    EXPECT_GE(f0b + memSlack(), f0a);
  }
  CUDA_ASSERT(cudaFree(p));  // freed while device 0 is current
  CUDA_ASSERT(cudaSetDevice(1));
  memInfo(&f1c, &t1c);
  if (onSimgpu()) EXPECT_EQ(f1a, f1c);
}

TEST(Peer, KernelOnSecondDevice) {
  REQUIRE_TWO_DEVICES();
  DeviceGuard guard;
  CUDA_ASSERT(cudaSetDevice(1));
  const int n = 1000;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i);
    y[i] = 1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  CUDA_ASSERT(cudaMalloc(&dx, n * sizeof(float)));
  CUDA_ASSERT(cudaMalloc(&dy, n * sizeof(float)));
  CUDA_ASSERT(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  const int before = g_saxpyLaunches.load();
  saxpy<<<(n + 255) / 256, 256>>>(n, 2.0f, dx, dy);
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<float> out(n);
  CUDA_ASSERT(cudaMemcpy(out.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) ASSERT_EQ(2.0f * i + 1.0f, out[i]) << i;
  if (onSimgpu()) {
    EXPECT_EQ(before + 1, g_saxpyLaunches.load());
    EXPECT_EQ(1, g_lastDevice.load()) << "the launch ran on device 1";
  }
  CUDA_ASSERT(cudaFree(dx));
  CUDA_ASSERT(cudaFree(dy));
}
