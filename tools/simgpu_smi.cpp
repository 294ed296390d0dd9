// simgpu-smi: lists the GPUs NVML reports with their memory and compute processes, like a tiny
// nvidia-smi. It uses only the NVML API, so it works on simgpu's NVML and on a real one.
#include <dlfcn.h>

#include <cstdio>

#include "simgpu/nvml.h"

int main() {
  nvmlReturn_t r = nvmlInit_v2();
  if (r != NVML_SUCCESS) {
    std::fprintf(stderr, "simgpu-smi: nvmlInit failed: %s\n", nvmlErrorString(r));
    return 1;
  }
  unsigned count = 0;
  nvmlDeviceGetCount_v2(&count);
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != NVML_SUCCESS) continue;
    char name[96] = {}, uuid[96] = {};
    nvmlDeviceGetName(dev, name, sizeof name);
    nvmlDeviceGetUUID(dev, uuid, sizeof uuid);
    nvmlMemory_t mem = {};
    nvmlDeviceGetMemoryInfo(dev, &mem);
    std::printf("GPU %u  %-34s %s\n       memory %8llu MiB used / %8llu MiB total\n", i, name, uuid,
                static_cast<unsigned long long>(mem.used >> 20), static_cast<unsigned long long>(mem.total >> 20));
    nvmlProcessInfo_t procs[64];
    unsigned n = 64;
    if (nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, procs) == NVML_SUCCESS)
      for (unsigned k = 0; k < n; ++k)
        std::printf("       pid %-8u %8llu MiB\n", procs[k].pid,
                    static_cast<unsigned long long>(procs[k].usedGpuMemory >> 20));
  }
  nvmlShutdown();
  return 0;
}
