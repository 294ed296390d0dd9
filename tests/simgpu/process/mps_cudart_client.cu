// An nvcc-built program (static cudart) as an MPS client, for mps_test.cpp: prints, on one line,
// cudaGetDeviceProperties' status and multiProcessorCount, the multiprocessor-count attribute, and
// the status of two cudaMalloc calls of argv[1] bytes each.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0;
  cudaDeviceProp p{};
  const cudaError_t props = cudaGetDeviceProperties(&p, 0);
  int sms = -1;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  void* a = nullptr;
  void* b = nullptr;
  const cudaError_t first = cudaMalloc(&a, bytes);
  const cudaError_t second = cudaMalloc(&b, bytes);
  std::printf("%d %d %d %d %d\n", props, p.multiProcessorCount, sms, first, second);
  return 0;
}
