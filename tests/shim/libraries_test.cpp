// libcushare.so under real NVIDIA libraries (NCCL, cuBLAS, cuDNN) on simgpu: what the libraries
// allocate, by whatever road (cudart's cudaMalloc, NCCL's cuMemCreate/cuMemMap obtained through
// cudaGetDriverEntryPoint, cuBLASLt's dlsym), is counted in the tenant's view and limited.
//
// "Counted" is checked two ways: the tenant's view (cudaMemGetInfo) moves by what the library
// took, and what the tenant's view says this process uses equals what the simulated device says it
// holds for this process (simgpu's NVML process list, which the shim does not touch).
//
// Registrations (CMakeLists.txt): NcclSmall.* under 256 MiB (too small for a communicator: NCCL
// 2.28 takes about 390 MiB on simgpu), Nccl.* under 1 GiB, Blas.*:Dnn.* under 512 MiB.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "simgpu/nvml.h"

namespace {

constexpr size_t kMiB = size_t{1} << 20;

#define RT_ASSERT(expr)                                                                        \
  do {                                                                                         \
    const cudaError_t rt_assert_e_ = (expr);                                                   \
    ASSERT_EQ(cudaSuccess, rt_assert_e_) << #expr << " -> " << cudaGetErrorName(rt_assert_e_); \
  } while (0)
#define NCCL_ASSERT(expr)                                                                     \
  do {                                                                                        \
    const ncclResult_t nccl_r_ = (expr);                                                      \
    ASSERT_EQ(ncclSuccess, nccl_r_) << #expr << " -> " << ncclGetErrorString(nccl_r_);       \
  } while (0)
#define CUBLAS_ASSERT(expr)                                                                   \
  do {                                                                                        \
    const cublasStatus_t cublas_st_ = (expr);                                                 \
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS, cublas_st_) << #expr << " -> " << cublasGetStatusName(cublas_st_); \
  } while (0)
#define CUDNN_ASSERT(expr)                                                                    \
  do {                                                                                        \
    const cudnnStatus_t cudnn_st_ = (expr);                                                   \
    ASSERT_EQ(CUDNN_STATUS_SUCCESS, cudnn_st_) << #expr << " -> " << cudnnGetErrorString(cudnn_st_); \
  } while (0)

size_t envLimit() {
  const char* v = std::getenv("CUSHARE_MEMORY_LIMIT");
  if (!v) return 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (end && std::strcmp(end, "MiB") == 0) return n * kMiB;
  if (end && std::strcmp(end, "GiB") == 0) return n * 1024 * kMiB;
  return n;
}

struct Info {
  size_t free = 0, total = 0;
};
Info memInfo() {
  Info i;
  EXPECT_EQ(cudaSuccess, cudaMemGetInfo(&i.free, &i.total));
  return i;
}

// What the simulated device holds for this process (simgpu's NVML process list: not the tenant
// view, the shim does not rewrite it). 0 when this process holds nothing.
size_t deviceUsedByThisProcess() {
  static nvmlDevice_t dev = [] {
    nvmlDevice_t d = nullptr;
    EXPECT_EQ(NVML_SUCCESS, nvmlInit_v2());
    EXPECT_EQ(NVML_SUCCESS, nvmlDeviceGetHandleByIndex_v2(0, &d));
    return d;
  }();
  nvmlProcessInfo_t procs[64];
  unsigned n = 64;
  EXPECT_EQ(NVML_SUCCESS, nvmlDeviceGetComputeRunningProcesses(dev, &n, procs));
  for (unsigned i = 0; i < n; ++i)
    if (procs[i].pid == static_cast<unsigned>(getpid())) return procs[i].usedGpuMemory;
  return 0;
}

// The tenant's use as its view reports it (this process is the tenant's only one).
size_t tenantUsed() {
  const Info i = memInfo();
  return i.total - i.free;
}

// Everything the device holds for this process is counted against the tenant (the shim counts
// at least 256 bytes per allocation, as simgpu takes; a little slack for the paths where the two
// differ).
void expectAllCounted(const char* when, size_t roundingSlack = 64 * 1024) {
  const size_t dev = deviceUsedByThisProcess(), counted = tenantUsed();
  EXPECT_LE(dev, counted + roundingSlack) << when << ": the device holds " << dev << " bytes for this process, the tenant is charged "
                                          << counted;
  EXPECT_LE(counted, dev + roundingSlack) << when << ": the tenant is charged " << counted << " bytes, the device holds " << dev;
  std::printf("%s: device holds %.2f MiB, tenant charged %.2f MiB\n", when, static_cast<double>(dev) / kMiB,
              static_cast<double>(counted) / kMiB);
}

class Limited : public ::testing::Test {
 protected:
  void SetUp() override {
    limit_ = envLimit();
    ASSERT_GT(limit_, 0u) << "CUSHARE_MEMORY_LIMIT must be set by the registration";
    RT_ASSERT(cudaSetDevice(0));
    RT_ASSERT(cudaFree(nullptr));  // the primary context
    const Info i = memInfo();
    ASSERT_EQ(limit_, i.total) << "the tenant's view";
  }
  size_t limit_ = 0;
};

using NcclSmall = Limited;
using Nccl = Limited;
using Blas = Limited;
using Dnn = Limited;

// Under 256 MiB a communicator does not fit: NCCL gets CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate
// and must report an error, not crash. NCCL 2.28 does not give back what it took before the
// failure (it leaves the whole 256 MiB allocated; the same happens without the shim on a 256 MiB
// simgpu device), so only the accounting is checked: what it keeps is charged, exactly.
TEST_F(NcclSmall, InitFailsCleanlyWhenTheCommunicatorDoesNotFit) {
  ASSERT_EQ(limit_, memInfo().free);
  ncclComm_t comm = nullptr;
  int dev = 0;
  const ncclResult_t r = ncclCommInitAll(&comm, 1, &dev);
  EXPECT_NE(ncclSuccess, r) << "a communicator of ~390 MiB was created under a 256 MiB limit";
  std::printf("ncclCommInitAll under %zu MiB: %s\n", limit_ / kMiB, ncclGetErrorString(r));
  if (r == ncclSuccess && comm) ncclCommDestroy(comm);
  (void)cudaGetLastError();
  const Info after = memInfo();
  EXPECT_EQ(limit_, after.total);
  EXPECT_LE(after.total - after.free, limit_);
  expectAllCounted("after the failed init");
}

// Under 1 GiB it fits: its memory (cuMemCreate pieces) is in the tenant's view while the
// communicator lives, an all-reduce works, and ncclCommDestroy gives all of it back.
TEST_F(Nccl, CommunicatorMemoryIsCountedAndReturned) {
  const size_t count = 1 << 20;
  float *send = nullptr, *recv = nullptr;
  RT_ASSERT(cudaMalloc(&send, count * sizeof(float)));
  RT_ASSERT(cudaMalloc(&recv, count * sizeof(float)));
  cudaStream_t s;
  RT_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t free0 = memInfo().free;
  EXPECT_EQ(limit_ - 8 * kMiB, free0);

  ncclComm_t comm = nullptr;
  int dev = 0;
  NCCL_ASSERT(ncclCommInitAll(&comm, 1, &dev));
  const size_t freeLive = memInfo().free;
  EXPECT_GT(free0 - freeLive, 300 * kMiB) << "the communicator's memory is not counted in the tenant's view";
  std::printf("the communicator holds %.1f MiB of the tenant's %zu MiB\n", static_cast<double>(free0 - freeLive) / kMiB,
              limit_ / kMiB);
  expectAllCounted("communicator live");
  // What is left is all the tenant can still take.
  void* p = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMalloc(&p, freeLive + kMiB));
  (void)cudaGetLastError();

  NCCL_ASSERT(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, comm, s));
  RT_ASSERT(cudaStreamSynchronize(s));
  ncclResult_t async = ncclInternalError;
  NCCL_ASSERT(ncclCommGetAsyncError(comm, &async));
  EXPECT_EQ(ncclSuccess, async);

  NCCL_ASSERT(ncclCommDestroy(comm));
  EXPECT_EQ(free0, memInfo().free) << "ncclCommDestroy left memory charged";
  expectAllCounted("communicator destroyed");
  RT_ASSERT(cudaStreamDestroy(s));
  RT_ASSERT(cudaFree(send));
  RT_ASSERT(cudaFree(recv));
  EXPECT_EQ(limit_, memInfo().free);
}

TEST_F(Blas, HandleAndSgemmAreCounted) {
  const size_t free0 = memInfo().free;
  cublasHandle_t h = nullptr;
  CUBLAS_ASSERT(cublasCreate(&h));
  const size_t freeHandle = memInfo().free;
  EXPECT_LT(freeHandle, free0) << "the handle's workspace is not counted";
  expectAllCounted("cuBLAS handle");

  constexpr int n = 64;
  float *a = nullptr, *b = nullptr, *c = nullptr;
  RT_ASSERT(cudaMalloc(&a, sizeof(float) * n * n));
  RT_ASSERT(cudaMalloc(&b, sizeof(float) * n * n));
  RT_ASSERT(cudaMalloc(&c, sizeof(float) * n * n));
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_ASSERT(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n));
  RT_ASSERT(cudaDeviceSynchronize());
  EXPECT_LE(memInfo().free + 3 * sizeof(float) * n * n, freeHandle);
  expectAllCounted("after cublasSgemm");
  // The limit holds for the library's callers as well: no room for a 512 MiB matrix.
  void* big = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMalloc(&big, limit_));
  (void)cudaGetLastError();

  RT_ASSERT(cudaFree(a));
  RT_ASSERT(cudaFree(b));
  RT_ASSERT(cudaFree(c));
  CUBLAS_ASSERT(cublasDestroy(h));
  expectAllCounted("cuBLAS handle destroyed");
}

TEST_F(Dnn, ConvolutionForwardIsCounted) {
  constexpr int kN = 8, kC = 16, kH = 64, kW = 64, kK = 32, kR = 3, kS = 3;
  const size_t free0 = memInfo().free;
  cudnnHandle_t h = nullptr;
  CUDNN_ASSERT(cudnnCreate(&h));
  EXPECT_LT(memInfo().free, free0) << "the handle's device buffer is not counted";
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  CUDNN_ASSERT(cudnnCreateTensorDescriptor(&x));
  CUDNN_ASSERT(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, kN, kC, kH, kW));
  CUDNN_ASSERT(cudnnCreateFilterDescriptor(&w));
  CUDNN_ASSERT(cudnnSetFilter4dDescriptor(w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, kK, kC, kR, kS));
  CUDNN_ASSERT(cudnnCreateConvolutionDescriptor(&conv));
  CUDNN_ASSERT(cudnnSetConvolution2dDescriptor(conv, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  int n = 0, k = 0, oh = 0, ow = 0;
  CUDNN_ASSERT(cudnnGetConvolution2dForwardOutputDim(conv, x, w, &n, &k, &oh, &ow));
  CUDNN_ASSERT(cudnnCreateTensorDescriptor(&y));
  CUDNN_ASSERT(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k, oh, ow));
  const size_t xb = sizeof(float) * kN * kC * kH * kW, wb = sizeof(float) * kK * kC * kR * kS,
               yb = sizeof(float) * n * k * oh * ow;
  void *dx = nullptr, *dw = nullptr, *dy = nullptr, *ws = nullptr;
  RT_ASSERT(cudaMalloc(&dx, xb));
  RT_ASSERT(cudaMalloc(&dw, wb));
  RT_ASSERT(cudaMalloc(&dy, yb));

  int maxAlgos = 0;
  CUDNN_ASSERT(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &maxAlgos));
  std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(std::max(maxAlgos, 1));
  int returned = 0;
  CUDNN_ASSERT(cudnnGetConvolutionForwardAlgorithm_v7(h, x, w, conv, y, maxAlgos, &returned, perf.data()));
  int chosen = -1;
  for (int i = 0; i < returned && chosen < 0; ++i)
    if (perf[i].status == CUDNN_STATUS_SUCCESS) chosen = i;
  ASSERT_GE(chosen, 0);
  size_t wsBytes = 0;
  CUDNN_ASSERT(cudnnGetConvolutionForwardWorkspaceSize(h, x, w, conv, y, perf[chosen].algo, &wsBytes));
  if (wsBytes) RT_ASSERT(cudaMalloc(&ws, wsBytes));
  const float alpha = 1.0f, beta = 0.0f;
  CUDNN_ASSERT(cudnnConvolutionForward(h, &alpha, x, dx, w, dw, conv, perf[chosen].algo, ws, wsBytes, &beta, y, dy));
  RT_ASSERT(cudaDeviceSynchronize());
  EXPECT_LE(memInfo().free + xb + wb + yb + wsBytes, free0);
  expectAllCounted("after cudnnConvolutionForward");

  if (ws) RT_ASSERT(cudaFree(ws));
  RT_ASSERT(cudaFree(dx));
  RT_ASSERT(cudaFree(dw));
  RT_ASSERT(cudaFree(dy));
  cudnnDestroyTensorDescriptor(x);
  cudnnDestroyTensorDescriptor(y);
  cudnnDestroyFilterDescriptor(w);
  cudnnDestroyConvolutionDescriptor(conv);
  CUDNN_ASSERT(cudnnDestroy(h));
  expectAllCounted("cuDNN handle destroyed");
}

// Not a shim test: a simgpu regression test found while writing these. cublasSgemm of 512 x 512
// matrices takes a different kernel path (sm80_xmma_gemm_..._tilesize64x64x8) than 64 x 64, which
// needs the CONTEXT_IDS table's slots 51 (public stream -> private stream) and 39 (stream id)
// (simgpu/src/export_tables.cpp). Registered without the shim.
TEST(BlasOnSimgpu, Sgemm512) {
  RT_ASSERT(cudaSetDevice(0));
  cublasHandle_t h = nullptr;
  CUBLAS_ASSERT(cublasCreate(&h));
  constexpr int n = 512;
  float *a = nullptr, *b = nullptr, *c = nullptr;
  RT_ASSERT(cudaMalloc(&a, sizeof(float) * n * n));
  RT_ASSERT(cudaMalloc(&b, sizeof(float) * n * n));
  RT_ASSERT(cudaMalloc(&c, sizeof(float) * n * n));
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t st = cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n);
  EXPECT_EQ(CUBLAS_STATUS_SUCCESS, st) << cublasGetStatusName(st);
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cublasDestroy(h);
}

}  // namespace
