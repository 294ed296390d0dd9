// Cost of the shim on the allocation path and the launch path, on simgpu. Run the same binary
// with and without LD_PRELOAD=libcushare.so (perf/shim_overhead.sh does both and prints the
// differences); absolute times drift on shared machines, the difference within one run is the
// figure that matters.
#include <benchmark/benchmark.h>
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <vector>

namespace {

CUcontext gCtx = nullptr;
CUfunction gFn = nullptr;
CUstream gStream = nullptr;

void setUp() {
  if (gCtx) return;
  if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&gCtx, 0) != CUDA_SUCCESS ||
      cuCtxSetCurrent(gCtx) != CUDA_SUCCESS) {
    std::fprintf(stderr, "shim_bench: no CUDA device\n");
    std::exit(1);
  }
  // A module without a parsed image: simgpu accepts any kernel name, launches do nothing.
  static const char kPtx[] = "// empty module for the launch benchmark\n";
  CUmodule m;
  if (cuModuleLoadData(&m, kPtx) != CUDA_SUCCESS || cuModuleGetFunction(&gFn, m, "noop") != CUDA_SUCCESS) {
    std::fprintf(stderr, "shim_bench: cannot load a module\n");
    std::exit(1);
  }
  cuStreamCreate(&gStream, CU_STREAM_NON_BLOCKING);
}

void BM_MemAllocFree(benchmark::State& state) {
  setUp();
  const size_t bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    CUdeviceptr p;
    if (cuMemAlloc(&p, bytes) != CUDA_SUCCESS) state.SkipWithError("cuMemAlloc failed");
    cuMemFree(p);
  }
}
BENCHMARK(BM_MemAllocFree)->Arg(4096)->Arg(1 << 20);

void BM_LaunchKernel(benchmark::State& state) {
  setUp();
  int x = 0;
  void* params[] = {&x};
  unsigned n = 0;
  for (auto _ : state) {
    cuLaunchKernel(gFn, 1, 1, 1, 32, 1, 1, 0, gStream, params, nullptr);
    if ((++n & 1023) == 0) cuStreamSynchronize(gStream);  // keep simgpu's queue short
  }
  cuStreamSynchronize(gStream);
}
BENCHMARK(BM_LaunchKernel);

void BM_MemGetInfo(benchmark::State& state) {
  setUp();
  for (auto _ : state) {
    size_t f, t;
    cuMemGetInfo(&f, &t);
    benchmark::DoNotOptimize(f);
  }
}
BENCHMARK(BM_MemGetInfo);

}  // namespace

BENCHMARK_MAIN();
