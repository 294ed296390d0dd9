// A framework's first cuDNN convolution, run by scripts/test-frameworks.sh against cuDNN wheels
// from PyPI (the library found first on LD_LIBRARY_PATH), on simgpu, with and without the shim: a
// handle set to a created stream (as PyTorch does on a torch.cuda.Stream()), one forward
// convolution, a synchronize. cuDNN from 9.23.2.1 asks the driver for the stream's green context
// (cuStreamGetGreenCtx) and fails with CUDNN_STATUS_INTERNAL_ERROR on anything but success.
// simgpu runs no cuDNN kernel body, so the output is not checked, only that every call succeeds.
// Prints "cudnn ok <cudnn version>" and exits 0, or names the first call that failed and exits 1.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstdio>

#include "check.h"

constexpr const char* kProbe = "cudnn probe";
#define DNN_CHECK(call) PROBE_CHECK(call, CUDNN_STATUS_SUCCESS, cudnnGetErrorString)

int main() {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudnnHandle_t h;
  DNN_CHECK(cudnnCreate(&h));
  DNN_CHECK(cudnnSetStream(h, stream));
  // One image of 3 channels, 16 x 16; 8 filters of 3 x 3; padding 1: out 1 x 8 x 16 x 16.
  cudnnTensorDescriptor_t x, y;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t conv;
  DNN_CHECK(cudnnCreateTensorDescriptor(&x));
  DNN_CHECK(cudnnCreateTensorDescriptor(&y));
  DNN_CHECK(cudnnCreateFilterDescriptor(&w));
  DNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
  DNN_CHECK(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 3, 16, 16));
  DNN_CHECK(cudnnSetFilter4dDescriptor(w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, 8, 3, 3, 3));
  DNN_CHECK(cudnnSetConvolution2dDescriptor(conv, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  int n = 0, c = 0, hh = 0, ww = 0;
  DNN_CHECK(cudnnGetConvolution2dForwardOutputDim(conv, x, w, &n, &c, &hh, &ww));
  DNN_CHECK(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, hh, ww));
  const cudnnConvolutionFwdAlgo_t algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM;
  size_t workspace = 0;
  DNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(h, x, w, conv, y, algo, &workspace));
  float *dx = nullptr, *dw = nullptr, *dy = nullptr;
  void* dws = nullptr;
  CUDA_CHECK(cudaMalloc(&dx, sizeof(float) * 3 * 16 * 16));
  CUDA_CHECK(cudaMalloc(&dw, sizeof(float) * 8 * 3 * 3 * 3));
  CUDA_CHECK(cudaMalloc(&dy, sizeof(float) * n * c * hh * ww));
  if (workspace > 0) CUDA_CHECK(cudaMalloc(&dws, workspace));
  const float one = 1.0f, zero = 0.0f;
  DNN_CHECK(cudnnConvolutionForward(h, &one, x, dx, w, dw, conv, algo, dws, workspace, &zero, y, dy));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  DNN_CHECK(cudnnDestroyConvolutionDescriptor(conv));
  DNN_CHECK(cudnnDestroyFilterDescriptor(w));
  DNN_CHECK(cudnnDestroyTensorDescriptor(y));
  DNN_CHECK(cudnnDestroyTensorDescriptor(x));
  DNN_CHECK(cudnnDestroy(h));
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(dw), static_cast<void*>(dy), dws})
    if (p != nullptr) CUDA_CHECK(cudaFree(p));
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("cudnn ok %zu\n", cudnnGetVersion());
  return 0;
}
