// cuDNN (the real library, with its sub-libraries loaded on demand) on simgpu: handle life cycle,
// descriptors, algorithm choice, workspace size and one convolution forward. simgpu runs no device
// code, so the output is not checked; the statuses and the device-memory accounting are.
#include <cudnn.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

using namespace simtest;

#define CUDNN_ASSERT(expr)                                                                      \
  do {                                                                                          \
    const cudnnStatus_t cudnn_assert_st_ = (expr);                                              \
    ASSERT_EQ(CUDNN_STATUS_SUCCESS, cudnn_assert_st_)                                           \
        << #expr << " -> " << cudnnGetErrorString(cudnn_assert_st_);                            \
  } while (0)

#define CUDNN_EXPECT(expr)                                                                      \
  do {                                                                                          \
    const cudnnStatus_t cudnn_expect_st_ = (expr);                                              \
    EXPECT_EQ(CUDNN_STATUS_SUCCESS, cudnn_expect_st_)                                           \
        << #expr << " -> " << cudnnGetErrorString(cudnn_expect_st_);                            \
  } while (0)

namespace {

// Owns everything a convolution needs, so a failed ASSERT releases it all.
struct Conv {
  cudnnHandle_t handle = nullptr;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  void *dx = nullptr, *dy = nullptr, *dw = nullptr, *ws = nullptr;
  ~Conv() {
    (void)cudaDeviceSynchronize();
    if (ws) (void)cudaFree(ws);
    if (dx) (void)cudaFree(dx);
    if (dy) (void)cudaFree(dy);
    if (dw) (void)cudaFree(dw);
    if (conv) (void)cudnnDestroyConvolutionDescriptor(conv);
    if (w) (void)cudnnDestroyFilterDescriptor(w);
    if (x) (void)cudnnDestroyTensorDescriptor(x);
    if (y) (void)cudnnDestroyTensorDescriptor(y);
    if (handle) (void)cudnnDestroy(handle);
  }
};

// NCHW float: N=2, C=3, 16x16 input; K=8 filters of 3x3; padding 1, stride 1.
constexpr int kN = 2, kC = 3, kH = 16, kW = 16, kK = 8, kR = 3, kS = 3;

void describe(Conv& c) {
  CUDNN_ASSERT(cudnnCreateTensorDescriptor(&c.x));
  CUDNN_ASSERT(cudnnSetTensor4dDescriptor(c.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, kN, kC, kH, kW));
  CUDNN_ASSERT(cudnnCreateFilterDescriptor(&c.w));
  CUDNN_ASSERT(cudnnSetFilter4dDescriptor(c.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, kK, kC, kR, kS));
  CUDNN_ASSERT(cudnnCreateConvolutionDescriptor(&c.conv));
  CUDNN_ASSERT(cudnnSetConvolution2dDescriptor(c.conv, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                               CUDNN_DATA_FLOAT));
  int n = 0, k = 0, h = 0, w = 0;
  CUDNN_ASSERT(cudnnGetConvolution2dForwardOutputDim(c.conv, c.x, c.w, &n, &k, &h, &w));
  EXPECT_EQ(kN, n);
  EXPECT_EQ(kK, k);
  EXPECT_EQ(kH, h);
  EXPECT_EQ(kW, w);
  CUDNN_ASSERT(cudnnCreateTensorDescriptor(&c.y));
  CUDNN_ASSERT(cudnnSetTensor4dDescriptor(c.y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, k, h, w));
}

void allocate(Conv& c) {
  CUDA_ASSERT(cudaMalloc(&c.dx, sizeof(float) * kN * kC * kH * kW));
  CUDA_ASSERT(cudaMalloc(&c.dw, sizeof(float) * kK * kC * kR * kS));
  CUDA_ASSERT(cudaMalloc(&c.dy, sizeof(float) * kN * kK * kH * kW));
  CUDA_ASSERT(cudaMemset(c.dx, 0, sizeof(float) * kN * kC * kH * kW));
  CUDA_ASSERT(cudaMemset(c.dw, 0, sizeof(float) * kK * kC * kR * kS));
  CUDA_ASSERT(cudaMemset(c.dy, 0, sizeof(float) * kN * kK * kH * kW));
}

}  // namespace

TEST(Cudnn, VersionAndCreateDestroy) {
  EXPECT_GE(cudnnGetVersion(), 90000u);
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaFree(nullptr));  // the primary context exists before the first measurement
  size_t free0 = 0, total = 0;
  memInfo(&free0, &total);
  cudnnHandle_t h = nullptr;
  CUDNN_ASSERT(cudnnCreate(&h));
  ASSERT_NE(nullptr, h);
  size_t freeLive = 0;
  memInfo(&freeLive, &total);
  EXPECT_LE(freeLive, free0 + memSlack());
  // The handle keeps a small device buffer (about 25 KiB with cuDNN 9) while it lives.
  if (onSimgpu()) {
    EXPECT_LT(freeLive, free0) << "cudnnCreate allocated no device memory";
  }
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreate(&stream));
  CUDNN_EXPECT(cudnnSetStream(h, stream));
  cudaStream_t got = nullptr;
  CUDNN_EXPECT(cudnnGetStream(h, &got));
  EXPECT_EQ(stream, got);
  CUDNN_EXPECT(cudnnSetStream(h, nullptr));
  CUDA_EXPECT(cudaStreamDestroy(stream));
  CUDNN_ASSERT(cudnnDestroy(h));
  size_t free1 = 0;
  memInfo(&free1, &total);
  EXPECT_GE(free1 + memSlack(), free0) << "cudnnCreate/cudnnDestroy leaked device memory";
  if (onSimgpu()) {
    EXPECT_EQ(free0, free1);
  }
}

TEST(Cudnn, ConvolutionForwardV7) {
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaFree(nullptr));
  size_t free0 = 0, total = 0;
  memInfo(&free0, &total);
  {
    Conv c;
    CUDNN_ASSERT(cudnnCreate(&c.handle));
    describe(c);
    if (HasFatalFailure()) return;
    allocate(c);
    if (HasFatalFailure()) return;
    size_t freeData = 0;
    memInfo(&freeData, &total);
    if (onSimgpu()) {
      EXPECT_LE(freeData + sizeof(float) * (kN * kC * kH * kW + kK * kC * kR * kS + kN * kK * kH * kW), free0);
    }

    int maxAlgos = 0;
    CUDNN_ASSERT(cudnnGetConvolutionForwardAlgorithmMaxCount(c.handle, &maxAlgos));
    EXPECT_GT(maxAlgos, 0);
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(std::max(maxAlgos, 1));
    int returned = 0;
    CUDNN_ASSERT(cudnnGetConvolutionForwardAlgorithm_v7(c.handle, c.x, c.w, c.conv, c.y, maxAlgos, &returned,
                                                        perf.data()));
    ASSERT_GT(returned, 0);
    // The first algorithm that reports success is the one to use.
    int chosen = -1;
    for (int i = 0; i < returned; ++i)
      if (perf[i].status == CUDNN_STATUS_SUCCESS) {
        chosen = i;
        break;
      }
    ASSERT_GE(chosen, 0) << "no usable forward algorithm among " << returned;
    const cudnnConvolutionFwdAlgo_t algo = perf[chosen].algo;

    size_t wsBytes = 0;
    CUDNN_ASSERT(cudnnGetConvolutionForwardWorkspaceSize(c.handle, c.x, c.w, c.conv, c.y, algo, &wsBytes));
    EXPECT_EQ(perf[chosen].memory, wsBytes);
    if (wsBytes) {
      CUDA_ASSERT(cudaMalloc(&c.ws, wsBytes));
    }

    const float alpha = 1.0f, beta = 0.0f;
    CUDNN_ASSERT(cudnnConvolutionForward(c.handle, &alpha, c.x, c.dx, c.w, c.dw, c.conv, algo, c.ws, wsBytes,
                                         &beta, c.y, c.dy));
    CUDA_EXPECT(cudaDeviceSynchronize());
  }
  size_t free1 = 0;
  memInfo(&free1, &total);
  EXPECT_GE(free1 + memSlack(), free0) << "the convolution left device memory behind";
}

TEST(Cudnn, FindConvolutionForwardAlgorithm) {
  Conv c;
  CUDNN_ASSERT(cudnnCreate(&c.handle));
  describe(c);
  if (HasFatalFailure()) return;
  allocate(c);
  if (HasFatalFailure()) return;
  // cudnnFind... runs every candidate (nothing is computed on simgpu) and times it with events.
  cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT] = {};
  int returned = 0;
  CUDNN_ASSERT(cudnnFindConvolutionForwardAlgorithm(c.handle, c.x, c.w, c.conv, c.y,
                                                    CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &returned, perf));
  ASSERT_GT(returned, 0);
  int ok = 0;
  for (int i = 0; i < returned; ++i) {
    std::printf("algo %d: %s, workspace %zu bytes\n", static_cast<int>(perf[i].algo),
                cudnnGetErrorString(perf[i].status), perf[i].memory);
    ok += perf[i].status == CUDNN_STATUS_SUCCESS;
  }
  EXPECT_GT(ok, 0) << "no algorithm ran";
}

// The FFT, FFT_TILING and WINOGRAD_NONFUSED engines run a cuBLASLt GEMM, which needs the same two
// private calls as cublasSgemm (TOOLS_TLS slot 2 and CONTEXT_IDS slot 4; see cublas_test.cpp).
TEST(Cudnn, ConvolutionForwardFft) {
  Conv c;
  CUDNN_ASSERT(cudnnCreate(&c.handle));
  describe(c);
  if (HasFatalFailure()) return;
  allocate(c);
  if (HasFatalFailure()) return;
  const cudnnConvolutionFwdAlgo_t algo = CUDNN_CONVOLUTION_FWD_ALGO_FFT;
  size_t wsBytes = 0;
  CUDNN_ASSERT(cudnnGetConvolutionForwardWorkspaceSize(c.handle, c.x, c.w, c.conv, c.y, algo, &wsBytes));
  EXPECT_GT(wsBytes, 0u);
  size_t free0 = 0, total = 0;
  memInfo(&free0, &total);
  CUDA_ASSERT(cudaMalloc(&c.ws, wsBytes));
  size_t free1 = 0;
  memInfo(&free1, &total);
  if (onSimgpu()) {
    EXPECT_LE(free1 + wsBytes, free0);
  }
  const float alpha = 1.0f, beta = 0.0f;
  CUDNN_ASSERT(cudnnConvolutionForward(c.handle, &alpha, c.x, c.dx, c.w, c.dw, c.conv, algo, c.ws, wsBytes, &beta,
                                       c.y, c.dy));
  CUDA_EXPECT(cudaDeviceSynchronize());
}
