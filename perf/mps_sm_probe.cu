// The multiprocessor count an MPS client sees (perf/gpu_check.sh under a real MPS daemon at
// several active thread percentages; mps_test.cpp under simgpu's): the attribute and
// cudaGetDeviceProperties' count.
//
//   usage: mps_sm_probe
//   prints: sms attribute=<n> properties=<n>   (or "sms error=<cudaError_t>")
#include <cuda_runtime.h>

#include <cstdio>

int main() {
  int attr = -1;
  cudaDeviceProp p{};
  cudaError_t e = cudaDeviceGetAttribute(&attr, cudaDevAttrMultiProcessorCount, 0);
  if (e == cudaSuccess) e = cudaGetDeviceProperties(&p, 0);
  if (e != cudaSuccess) {
    std::printf("sms error=%d\n", static_cast<int>(e));
    return 1;
  }
  std::printf("sms attribute=%d properties=%d\n", attr, p.multiProcessorCount);
  return 0;
}
