// cuFFT on simgpu: plan creation, execution and destruction succeed, and the plan's device memory
// shows in cudaMemGetInfo. cuFFT needs two private tables beyond cudart's (CONTEXT_IDS and
// MODULE_CALLBACKS in simgpu/src/export_tables.cpp). Results are not computed on simgpu, so data
// is not checked.
#include <cuda_runtime.h>
#include <cufft.h>
#include <gtest/gtest.h>

#include "cuda_check.h"

namespace {

size_t freeBytes() {
  size_t f = 0, t = 0;
  EXPECT_EQ(cudaSuccess, cudaMemGetInfo(&f, &t));
  return f;
}

TEST(Cufft, Plan1dExecDestroy) {
  CUDA_ASSERT(cudaFree(nullptr));  // create the context before measuring
  const size_t before = freeBytes();
  const int n = 1024, batch = 4;
  cufftComplex* data = nullptr;
  CUDA_ASSERT(cudaMalloc(&data, sizeof(cufftComplex) * n * batch));
  cufftHandle plan;
  ASSERT_EQ(CUFFT_SUCCESS, cufftPlan1d(&plan, n, CUFFT_C2C, batch));
  size_t work = 0;
  ASSERT_EQ(CUFFT_SUCCESS, cufftGetSize(plan, &work));
  EXPECT_LT(freeBytes(), before - sizeof(cufftComplex) * n * batch) << "the plan's memory is counted";
  ASSERT_EQ(CUFFT_SUCCESS, cufftExecC2C(plan, data, data, CUFFT_FORWARD));
  CUDA_ASSERT(cudaDeviceSynchronize());
  ASSERT_EQ(CUFFT_SUCCESS, cufftDestroy(plan));
  CUDA_ASSERT(cudaFree(data));
}

}  // namespace
