// A framework's first cuBLAS calls, run by scripts/test-frameworks.sh against cuBLAS wheels from
// PyPI (the library found first on LD_LIBRARY_PATH), on simgpu, with and without the shim: a handle
// on a created stream (as ONNX Runtime, CuPy and PyTorch set one), one SGEMM, a synchronize.
// cuBLAS from 13.5.1.27 asks the driver for a stream's green context (cuStreamGetGreenCtx) as the
// handle is created, and fails with CUBLAS_STATUS_INTERNAL_ERROR on anything but success (simgpu
// answered CUDA_ERROR_NOT_SUPPORTED until 2026-12-06: cublasCreate failed with 13.5.1.27 and 13.10.0.20).
// simgpu runs no cuBLAS kernel body, so the product is not checked, only that every call succeeds.
// Prints "cublas ok <cublas version>" and exits 0, or names the first call that failed and exits 1.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "check.h"

constexpr const char* kProbe = "cublas probe";
#define BLAS_CHECK(call) PROBE_CHECK(call, CUBLAS_STATUS_SUCCESS, cublasGetStatusName)

int main() {
  constexpr int n = 64;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_CHECK(cudaMalloc(&a, sizeof(float) * n * n));
  CUDA_CHECK(cudaMalloc(&b, sizeof(float) * n * n));
  CUDA_CHECK(cudaMalloc(&c, sizeof(float) * n * n));
  cublasHandle_t h;
  BLAS_CHECK(cublasCreate(&h));
  BLAS_CHECK(cublasSetStream(h, stream));
  int version = 0;
  BLAS_CHECK(cublasGetVersion(h, &version));
  const float one = 1.0f, zero = 0.0f;
  BLAS_CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, n, b, n, &zero, c, n));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  BLAS_CHECK(cublasDestroy(h));
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  CUDA_CHECK(cudaFree(c));
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("cublas ok %d\n", version);
  return 0;
}
