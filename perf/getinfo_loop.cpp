// cuMemGetInfo N times (N from argv[1]) on the primary context of device 0, holding argv[2] bytes
// allocated with cuMemAlloc (default none): the program
// perf/getinfo_instructions.sh runs under callgrind, with and without the shim, over the null
// driver (perf/null_driver.cpp), to count the instructions the shim adds to one call.
#include <cuda.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 1000;
  CUcontext ctx;
  if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::fprintf(stderr, "getinfo_loop: no device\n");
    return 1;
  }
  CUdeviceptr held = 0;
  const size_t hold = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0;
  if (hold && cuMemAlloc(&held, hold) != CUDA_SUCCESS) return 1;
  size_t free = 0, total = 0, sum = 0;
  for (long i = 0; i < n; ++i) {
    if (cuMemGetInfo(&free, &total) != CUDA_SUCCESS) return 1;
    sum += free;
  }
  std::printf("%zu %zu\n", total, sum / (n ? n : 1));
  return 0;
}
