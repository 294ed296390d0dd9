// Device time on simgpu, seen by an unmodified runtime-API program: kernels take the time the cost
// table (device_time.costs, SIMGPU_KERNEL_COSTS) gives their blocks, in waves set by occupancy
// (threads and shared memory per SM from the cubin); events, stream queries, synchronisation and
// host functions follow that time; kernels with host bodies still run them.
//
// Registered with SIMGPU_SMS=4 (small waves) and once more with SIMGPU_TIME_SCALE=4: device
// times (events) stay the same, the wall clock stretches.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "cuda_check.h"
#include "simgpu/simgpu.h"

using namespace simtest;
using Clock = std::chrono::steady_clock;

__global__ void hog(int* flag, long long ns) {
  if (threadIdx.x == 0 && blockIdx.x == 0) flag[0] = 1;
  (void)ns;
}

template <typename T>
__global__ void fixed(T* p) {
  if (p) p[0] = T(1);
}
template __global__ void fixed<float>(float*);

__global__ void shared_heavy(int* p) {
  __shared__ int buf[10 * 1024];  // 40 KiB static (+1 KiB reserved): 5 blocks per SM
  buf[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (p) p[blockIdx.x] = buf[0];
}

__global__ void no_rule(int* p) {
  if (p) p[0] = 0;
}

namespace {

double timeScale() {
  const char* v = std::getenv("SIMGPU_TIME_SCALE");
  return v ? std::atof(v) : 1.0;
}

// The device time between two events around `launch`, with the stream kept busy before, so the
// timed work starts exactly where the previous ended (as on a GPU with a queue ahead of it).
template <typename F>
float timed(cudaStream_t s, F launch) {
  cudaEvent_t a, b;
  EXPECT_EQ(cudaEventCreate(&a), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&b), cudaSuccess);
  hog<<<1, 32, 0, s>>>(nullptr, 20'000'000);  // 20 ms ahead: the host queues the rest meanwhile
  EXPECT_EQ(cudaEventRecord(a, s), cudaSuccess);
  launch();
  EXPECT_EQ(cudaEventRecord(b, s), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(b), cudaSuccess);
  float ms = -1;
  EXPECT_EQ(cudaEventElapsedTime(&ms, a, b), cudaSuccess);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

}  // namespace

extern "C" {
// hog's host body: runs, then the kernel takes its modelled time.
void simgpu_host__Z3hogPix(const simgpu_launch* l) {
  int* flag = *static_cast<int**>(l->params[0]);
  if (flag) flag[1] = 7;
}
}

TEST(DeviceTime, WavesSetByThreadsPerSm) {
  if (!onSimgpu()) GTEST_SKIP() << "needs the simulated cost table";
  ASSERT_EQ(expectedSimgpuSms(), 4);
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // 1024 threads per block: 2 per SM, 8 per wave on 4 SMs; 100 us per block.
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<8, 1024, 0, s>>>(nullptr); }), 0.1f);
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<9, 1024, 0, s>>>(nullptr); }), 0.2f);
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<32, 1024, 0, s>>>(nullptr); }), 0.4f);
  // 32 threads per block: 32 per SM (the block limit), 128 per wave.
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<128, 32, 0, s>>>(nullptr); }), 0.1f);
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<129, 32, 0, s>>>(nullptr); }), 0.2f);
  CUDA_EXPECT(cudaStreamDestroy(s));
}

TEST(DeviceTime, WavesSetBySharedMemoryFromTheCubinAndDynamic) {
  if (!onSimgpu()) GTEST_SKIP();
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // 41 KiB per block: 5 per SM, 20 per wave; 50 us per block.
  EXPECT_FLOAT_EQ(timed(s, [&] { shared_heavy<<<20, 64, 0, s>>>(nullptr); }), 0.05f);
  EXPECT_FLOAT_EQ(timed(s, [&] { shared_heavy<<<40, 64, 0, s>>>(nullptr); }), 0.1f);
  // 60 KiB of dynamic shared memory more: 101 KiB per block, 2 per SM, 8 per wave.
  CUDA_ASSERT(cudaFuncSetAttribute(shared_heavy, cudaFuncAttributeMaxDynamicSharedMemorySize, 60 * 1024));
  EXPECT_FLOAT_EQ(timed(s, [&] { shared_heavy<<<16, 64, 60 * 1024, s>>>(nullptr); }), 0.1f);
  CUDA_EXPECT(cudaStreamDestroy(s));
}

TEST(DeviceTime, BlockTimeFromAParameterAndTheDefault) {
  if (!onSimgpu()) GTEST_SKIP();
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_FLOAT_EQ(timed(s, [&] { hog<<<4, 32, 0, s>>>(nullptr, 3'000'000); }), 3.0f);
  EXPECT_FLOAT_EQ(timed(s, [&] { hog<<<4, 32, 0, s>>>(nullptr, 1'234'567); }), 1.2345f);  // 0.5 us steps
  // No rule: 1 us per block (docs/simgpu.md); 200 blocks of 1024 threads are 25 waves.
  EXPECT_FLOAT_EQ(timed(s, [&] { no_rule<<<200, 1024, 0, s>>>(nullptr); }), 0.025f);
  CUDA_EXPECT(cudaStreamDestroy(s));
}

TEST(DeviceTime, QuerySyncAndHostFunctionsFollowDeviceTime) {
  if (!onSimgpu()) GTEST_SKIP();
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* flag = nullptr;
  CUDA_ASSERT(cudaMallocManaged(&flag, 2 * sizeof(int)));
  flag[0] = flag[1] = 0;
  static std::atomic<bool> called{false};
  called = false;
  const auto t0 = Clock::now();
  hog<<<1, 32, 0, s>>>(flag, 30'000'000);  // 30 ms
  CUDA_ASSERT(cudaLaunchHostFunc(s, [](void*) { called = true; }, nullptr));
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  EXPECT_FALSE(called.load());
  CUDA_ASSERT(cudaStreamSynchronize(s));
  const double wallMs = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_TRUE(called.load());
  EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);
  EXPECT_GE(wallMs, 30.0 * timeScale()) << "the synchronisation returned before the device time passed";
  EXPECT_EQ(flag[1], 7) << "the host body ran";
  CUDA_EXPECT(cudaFree(flag));
  CUDA_EXPECT(cudaStreamDestroy(s));
}

// Two streams' kernels, each 4 blocks of 1024 threads (two of the four SMs), run side by side.
// Both wait on the engine behind a 500 ms kernel filling every SM (8 blocks of 1024 threads) on a
// third stream, so they start together when the SMs free. Each stream's worker thread hands its
// work to the engine: the filler's first (once the event before it is done, its worker is past
// it: 100 ms are left for the microseconds to the hand-over), the two kernels then within the
// filler's 500 ms (400 ms left). Before, the second stream waited for an event on the first, and
// its worker, woken 5 ms of device time late on a loaded host, handed its kernel over when the
// first had ended: 10 ms for 5, three times in two 20-repeat hunts (the engine does not go back
// in time; docs/simgpu.md). Then, with no event before the filler, a kernel handed over before
// the filler ran at once (0 ms).
TEST(DeviceTime, StreamsOfOneContextRunSideBySide) {
  if (!onSimgpu()) GTEST_SKIP();
  cudaStream_t s0, s1, s2;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t before, filled, end1, end2;
  for (cudaEvent_t* e : {&before, &filled, &end1, &end2}) CUDA_ASSERT(cudaEventCreate(e));
  CUDA_ASSERT(cudaEventRecord(before, s0));
  hog<<<8, 1024, 0, s0>>>(nullptr, 500'000'000);
  CUDA_ASSERT(cudaEventRecord(filled, s0));
  while (cudaEventQuery(before) == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  hog<<<4, 1024, 0, s1>>>(nullptr, 5'000'000);
  hog<<<4, 1024, 0, s2>>>(nullptr, 5'000'000);
  CUDA_ASSERT(cudaEventRecord(end1, s1));
  CUDA_ASSERT(cudaEventRecord(end2, s2));
  CUDA_ASSERT(cudaDeviceSynchronize());
  float ms1 = 0, ms2 = 0;
  CUDA_ASSERT(cudaEventElapsedTime(&ms1, filled, end1));
  CUDA_ASSERT(cudaEventElapsedTime(&ms2, filled, end2));
  EXPECT_FLOAT_EQ(ms1, 5.0f) << "the first stream's kernel started as the SMs freed";
  EXPECT_FLOAT_EQ(ms2, 5.0f) << "side by side, not one after the other (10 ms)";
  for (cudaEvent_t e : {before, filled, end1, end2}) CUDA_EXPECT(cudaEventDestroy(e));
  for (cudaStream_t s : {s0, s1, s2}) CUDA_EXPECT(cudaStreamDestroy(s));
}

TEST(DeviceTime, StreamPriorityOrdersWaitingBlocksNotRunningOnes) {
  if (!onSimgpu()) GTEST_SKIP();
  cudaStream_t fill, low, high;
  CUDA_ASSERT(cudaStreamCreateWithPriority(&fill, cudaStreamNonBlocking, 0));
  CUDA_ASSERT(cudaStreamCreateWithPriority(&low, cudaStreamNonBlocking, 0));
  CUDA_ASSERT(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, -5));
  cudaEvent_t before, filled, lowDone, highDone;
  for (cudaEvent_t* e : {&before, &filled, &lowDone, &highDone}) CUDA_ASSERT(cudaEventCreate(e));
  // Streams reach simgpu's engine through their own worker threads: wait until the fill stream's
  // worker has passed `before` (it then hands the fill kernel over within microseconds), so the
  // other kernels find the SMs full, as they would behind a GPU's in-order launch queue. On a
  // loaded host that worker can still be preempted before the hand-over, and then the fill kernel
  // is not first (the scenario did not happen, its events read negative): such a try is repeated.
  bool scenario = false;
  for (int attempt = 0; attempt < 5 && !scenario; ++attempt) {
    CUDA_ASSERT(cudaEventRecord(before, fill));
    hog<<<8, 1024, 0, fill>>>(nullptr, 20'000'000);  // fills the 4 SMs for 20 ms
    CUDA_ASSERT(cudaEventRecord(filled, fill));
    CUDA_ASSERT(cudaEventSynchronize(before));
    hog<<<8, 1024, 0, low>>>(nullptr, 1'000'000);   // waits, submitted first...
    hog<<<8, 1024, 0, high>>>(nullptr, 1'000'000);  // ...this one, higher priority, goes first
    CUDA_ASSERT(cudaEventRecord(lowDone, low));
    CUDA_ASSERT(cudaEventRecord(highDone, high));
    CUDA_ASSERT(cudaDeviceSynchronize());
    float h = 0, l = 0;
    CUDA_ASSERT(cudaEventElapsedTime(&h, filled, highDone));
    CUDA_ASSERT(cudaEventElapsedTime(&l, filled, lowDone));
    if (h < 0 || l < 0) continue;  // the fill kernel was not first: try again
    scenario = true;
    EXPECT_FLOAT_EQ(h, 1.0f);
    EXPECT_FLOAT_EQ(l, 2.0f);
  }
  EXPECT_TRUE(scenario) << "the fill kernel never reached the engine first in 5 tries";
  for (cudaStream_t s : {fill, low, high}) CUDA_EXPECT(cudaStreamDestroy(s));
}

// Registered with SIMGPU_TEST_SM_CAP=2 (the cap an MPS client gets; the test-only variable stands
// in until the simulated MPS sets it): the context's blocks occupy at most 2 of the 4 SMs.
TEST(DeviceTime, SmCapHalvesTheWave) {
  if (!onSimgpu() || !std::getenv("SIMGPU_TEST_SM_CAP")) GTEST_SKIP() << "registered with SIMGPU_TEST_SM_CAP=2";
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // 1024 threads per block: 2 per SM, 4 per wave on 2 SMs (8 without the cap).
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<4, 1024, 0, s>>>(nullptr); }), 0.1f);
  EXPECT_FLOAT_EQ(timed(s, [&] { fixed<float><<<8, 1024, 0, s>>>(nullptr); }), 0.2f);
  CUDA_EXPECT(cudaStreamDestroy(s));
}
