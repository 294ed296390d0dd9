// What one process holds on the device beyond its own allocations: its CUDA context, module images
// and the context's heaps. The broker charges that to the tenant (NVML's per-process figure counts
// it; the shim does not) and `context_memory` (docs/broker-configuration.md) says how much of it per
// process is a context and not memory hidden from the ledger: with hidden_memory_response
// kill_past_limit, what a process may hold beyond its slot before it is killed. Run by
// perf/gpu_check.sh on a real GPU to measure it, and by a test on simgpu (which models no context
// memory) so it is known to work. Prints one `key=value` line per step:
//   step=<name> rc=<CUresult of the step> process_used=<NVML bytes for this pid> allocated=<bytes
//   this process allocated> beyond=<process_used - allocated>
// Steps: context (primary context made current, 1 MiB allocated so it is fully made), module (the
// fatbin given as argv[1] loaded, if any), malloc_heap (cuCtxSetLimit of the device malloc heap to
// 64 MiB), stack (cuCtxSetLimit of the per-thread stack to 8 KiB: reserved for every resident
// thread of the device).
//
// NVML is loaded with dlopen; the driver is linked (no build RPATH: the real libcuda.so.1 on a GPU
// host, simgpu's through LD_PATH in the test).
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "cushare/nvml_api.h"

namespace {

struct Nvml {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*procs)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  nvmlDevice_t dev = nullptr;
};

unsigned long long processUsed(const Nvml& n) {
  nvmlProcessInfo_t infos[128];
  unsigned count = 128;
  if (n.procs(n.dev, &count, infos) != NVML_SUCCESS) return 0;
  for (unsigned i = 0; i < count; ++i)
    if (infos[i].pid == static_cast<unsigned>(getpid())) return infos[i].usedGpuMemory;
  return 0;
}

void report(const Nvml& n, const char* step, CUresult rc, size_t allocated) {
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // NVML's view settles
  const unsigned long long used = processUsed(n);
  std::printf("step=%s rc=%d process_used=%llu allocated=%zu beyond=%lld\n", step, static_cast<int>(rc), used,
              allocated, static_cast<long long>(used) - static_cast<long long>(allocated));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::printf("error=no-nvml %s\n", dlerror());
    return 2;
  }
  Nvml n;
  n.init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(lib, "nvmlInit_v2"));
  n.handle = reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  n.procs = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*)>(
      dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
  if (!n.init || !n.handle || !n.procs || n.init() != NVML_SUCCESS || n.handle(0, &n.dev) != NVML_SUCCESS) {
    std::printf("error=nvml-init\n");
    return 2;
  }
  CUdevice dev;
  CUcontext ctx;
  CUdeviceptr p = 0;
  constexpr size_t kAlloc = size_t{1} << 20;
  CUresult rc = cuInit(0);
  if (rc == CUDA_SUCCESS) rc = cuDeviceGet(&dev, 0);
  if (rc == CUDA_SUCCESS) rc = cuDevicePrimaryCtxRetain(&ctx, dev);
  if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(ctx);
  if (rc == CUDA_SUCCESS) rc = cuMemAlloc(&p, kAlloc);
  report(n, "context", rc, rc == CUDA_SUCCESS ? kAlloc : 0);
  if (rc != CUDA_SUCCESS) return 1;
  if (argc > 1) {
    CUmodule m;
    report(n, "module", cuModuleLoad(&m, argv[1]), kAlloc);
  }
  report(n, "malloc_heap", cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, size_t{64} << 20), kAlloc);
  report(n, "stack", cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 8192), kAlloc);
  cuMemFree(p);
  return 0;
}
