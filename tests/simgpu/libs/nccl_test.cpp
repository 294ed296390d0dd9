// NCCL (the real library) on simgpu: one communicator per visible device in one process
// (ncclCommInitAll), an all-reduce, and the device memory the communicators hold. Run once with
// one simulated device and once with two (SIMGPU_DEVICES). simgpu runs no device code, so the
// reduced values are not checked; the statuses and the memory accounting are.
//
// NCCL finds the devices' topology through NVML (simgpu's libnvidia-ml.so.1) and allocates its
// device memory through the driver's virtual-memory calls (cuMemCreate/cuMemMap), which
// cudaMemGetInfo must account for.
#include <nccl.h>

#include <cstdio>
#include <vector>

#include "cuda_check.h"

using namespace simtest;

#define NCCL_ASSERT(expr)                                                                       \
  do {                                                                                          \
    const ncclResult_t nccl_assert_r_ = (expr);                                                 \
    ASSERT_EQ(ncclSuccess, nccl_assert_r_) << #expr << " -> " << ncclGetErrorString(nccl_assert_r_); \
  } while (0)

#define NCCL_EXPECT(expr)                                                                       \
  do {                                                                                          \
    const ncclResult_t nccl_expect_r_ = (expr);                                                 \
    EXPECT_EQ(ncclSuccess, nccl_expect_r_) << #expr << " -> " << ncclGetErrorString(nccl_expect_r_); \
  } while (0)

namespace {

// Free memory of every device, in order.
std::vector<size_t> freePerDevice(int n) {
  std::vector<size_t> out(n, 0);
  for (int d = 0; d < n; ++d) {
    size_t total = 0;
    EXPECT_EQ(cudaSuccess, cudaSetDevice(d));
    memInfo(&out[d], &total);
  }
  return out;
}

// Everything one test run owns, released in the right order even after a failed ASSERT.
struct World {
  int n = 0;
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
  std::vector<float*> send, recv;
  ~World() {
    for (int d = 0; d < n; ++d) {
      (void)cudaSetDevice(d);
      (void)cudaDeviceSynchronize();
    }
    for (ncclComm_t c : comms)
      if (c) (void)ncclCommDestroy(c);
    for (int d = 0; d < n; ++d) {
      (void)cudaSetDevice(d);
      if (d < static_cast<int>(streams.size()) && streams[d]) (void)cudaStreamDestroy(streams[d]);
      if (d < static_cast<int>(send.size()) && send[d]) (void)cudaFree(send[d]);
      if (d < static_cast<int>(recv.size()) && recv[d]) (void)cudaFree(recv[d]);
    }
    (void)cudaSetDevice(0);
  }
};

}  // namespace

TEST(Nccl, Version) {
  int version = 0;
  NCCL_ASSERT(ncclGetVersion(&version));
  EXPECT_GE(version, 22800);
}

TEST(Nccl, InitAllAllReduceDestroy) {
  World w;
  w.n = deviceCount();
  ASSERT_GT(w.n, 0);
  if (onSimgpu()) {
    ASSERT_EQ(expectedSimgpuDevices(), w.n);
  }
  const size_t count = 1 << 20;  // floats per rank
  w.streams.assign(w.n, nullptr);
  w.send.assign(w.n, nullptr);
  w.recv.assign(w.n, nullptr);
  for (int d = 0; d < w.n; ++d) {
    CUDA_ASSERT(cudaSetDevice(d));
    CUDA_ASSERT(cudaStreamCreateWithFlags(&w.streams[d], cudaStreamNonBlocking));
    CUDA_ASSERT(cudaMalloc(&w.send[d], count * sizeof(float)));
    CUDA_ASSERT(cudaMalloc(&w.recv[d], count * sizeof(float)));
    std::vector<float> host(count, static_cast<float>(d + 1));
    CUDA_ASSERT(cudaMemcpy(w.send[d], host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemset(w.recv[d], 0, count * sizeof(float)));
  }
  const std::vector<size_t> free0 = freePerDevice(w.n);

  std::vector<int> devs(w.n);
  for (int d = 0; d < w.n; ++d) devs[d] = d;
  w.comms.assign(w.n, nullptr);
  NCCL_ASSERT(ncclCommInitAll(w.comms.data(), w.n, devs.data()));
  for (int d = 0; d < w.n; ++d) {
    SCOPED_TRACE("rank " + std::to_string(d));
    ASSERT_NE(nullptr, w.comms[d]);
    int nranks = 0, rank = -1, dev = -1;
    NCCL_EXPECT(ncclCommCount(w.comms[d], &nranks));
    NCCL_EXPECT(ncclCommUserRank(w.comms[d], &rank));
    NCCL_EXPECT(ncclCommCuDevice(w.comms[d], &dev));
    EXPECT_EQ(w.n, nranks);
    EXPECT_EQ(d, rank);
    EXPECT_EQ(d, dev);
  }

  // The communicators hold device memory on every device while they live (NCCL 2.28 on simgpu:
  // about 390 MiB for one rank, 34 MiB each for two, in 2 MiB cuMemCreate pieces).
  const std::vector<size_t> freeLive = freePerDevice(w.n);
  for (int d = 0; d < w.n; ++d) {
    SCOPED_TRACE("device " + std::to_string(d));
    EXPECT_LT(freeLive[d], free0[d]) << "the communicator's memory does not show in cudaMemGetInfo";
    if (freeLive[d] < free0[d])
      std::printf("device %d: the communicator holds %.1f MiB\n", d,
                  static_cast<double>(free0[d] - freeLive[d]) / static_cast<double>(MiB));
    if (onSimgpu()) {
      EXPECT_GE(free0[d] - freeLive[d], 2 * MiB);
    }
  }

  NCCL_ASSERT(ncclGroupStart());
  for (int d = 0; d < w.n; ++d)
    NCCL_EXPECT(ncclAllReduce(w.send[d], w.recv[d], count, ncclFloat, ncclSum, w.comms[d], w.streams[d]));
  NCCL_ASSERT(ncclGroupEnd());
  for (int d = 0; d < w.n; ++d) {
    CUDA_ASSERT(cudaSetDevice(d));
    CUDA_EXPECT(cudaStreamSynchronize(w.streams[d]));
  }
  // A second operation through the same communicators: in place this time.
  NCCL_ASSERT(ncclGroupStart());
  for (int d = 0; d < w.n; ++d)
    NCCL_EXPECT(ncclAllReduce(w.recv[d], w.recv[d], count, ncclFloat, ncclMax, w.comms[d], w.streams[d]));
  NCCL_ASSERT(ncclGroupEnd());
  for (int d = 0; d < w.n; ++d) {
    CUDA_ASSERT(cudaSetDevice(d));
    CUDA_EXPECT(cudaStreamSynchronize(w.streams[d]));
  }
  for (int d = 0; d < w.n; ++d) {
    ncclResult_t async = ncclInternalError;
    NCCL_EXPECT(ncclCommGetAsyncError(w.comms[d], &async));
    EXPECT_EQ(ncclSuccess, async) << ncclGetErrorString(async);
  }

  for (int d = 0; d < w.n; ++d) {
    NCCL_EXPECT(ncclCommDestroy(w.comms[d]));
    w.comms[d] = nullptr;
  }
  // Everything the communicators took is back.
  const std::vector<size_t> free1 = freePerDevice(w.n);
  for (int d = 0; d < w.n; ++d) {
    SCOPED_TRACE("device " + std::to_string(d));
    EXPECT_GE(free1[d] + memSlack(), free0[d]) << "ncclCommDestroy left device memory behind";
    if (onSimgpu()) {
      EXPECT_EQ(free0[d], free1[d]);
    }
  }
}
