// simgpu-smi: lists the GPUs NVML reports with their memory and compute processes, like a tiny
// nvidia-smi. The listing uses only the NVML API, so it works on simgpu's NVML and on a real one.
//
// `simgpu-smi --json`: simgpu's ground truth for tests, one JSON object: per device, NVML's memory
// and, from the device's time-slice board (timeslice_board.h), the context switches and per
// process what its engine really ran: busy_ns (time with its blocks running), busy_sm_ns (SM-time),
// blocks, kernels, sliced_out_ns (time it had work while another process held the device). An MPS
// server (one slot to the slicer, the sum of its clients) has "mps": "server"; each of its clients
// follows with what the server's engine gave it, "mps": "client", "server": <its server's pid>.
// Per device also the managed memory moved since the state file was made (every process):
// managed_in_bytes (made resident by touches and prefetches) and managed_evicted_bytes (evicted to
// the host for room): what thrashing is judged by.
//
// MIG, as nvidia-smi spells it (simgpu_smi_mig.cpp; docs/simgpu.md, "MIG"): `-L`, `[-i N] -mig 0|1`,
// `mig -lgip | -lgipp | -lgi | -lci | -cgi ... | -cci ... | -dci | -dgi`, and `[-i N] --gpu-reset`
// (simgpu's own: a pending MIG mode becomes current and the instances go, as on a real reset).
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "config.h"
#include "mig.h"
#include "shared_state.h"
#include "simgpu/nvml.h"
#include "simgpu_smi_mig.h"
#include "timeslice_board.h"

namespace {

int printJson(unsigned count) {
  simgpu::Config cfg;
  std::string err;
  if (!simgpu::loadConfig(&cfg, &err)) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return 1;
  }
  // The state file's counts; without it (no process ever ran) nothing moved.
  simgpu::SharedState* state = simgpu::SharedState::open(cfg.stateDir, cfg.deviceCount, cfg.memory, cfg.smCount, &err);
  std::printf("{\"devices\": [");
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != NVML_SUCCESS) continue;
    nvmlMemory_t mem = {};
    nvmlDeviceGetMemoryInfo(dev, &mem);
    simgpu::Board* b = simgpu::openBoard(cfg.stateDir, static_cast<int>(i), &err);
    const int host = static_cast<int>(i) < cfg.containerCount ? cfg.container[i] : static_cast<int>(i);  // NVML index -> host device
    const bool counted = state != nullptr && host < state->deviceCount();
    std::printf("%s{\"index\": %u, \"memory_used\": %llu, \"switches\": %llu, \"managed_in_bytes\": %llu, "
                "\"managed_evicted_bytes\": %llu, \"processes\": [", i ? ", " : "", i,
                static_cast<unsigned long long>(mem.used),
                static_cast<unsigned long long>(b ? b->switches.load() : 0),
                static_cast<unsigned long long>(counted ? state->migratedIn(host) : 0),
                static_cast<unsigned long long>(counted ? state->evictedOut(host) : 0));
    bool first = true;
    if (b)
      simgpu::forEachProcess(*b, [&](const simgpu::ProcessDeviceStats& p) {
        std::printf("%s{\"pid\": %d, \"busy_ns\": %llu, \"busy_sm_ns\": %llu, \"blocks\": %llu, \"kernels\": %llu, "
                    "\"sliced_out_ns\": %llu",
                    first ? "" : ", ", p.pid, static_cast<unsigned long long>(p.busyNs),
                    static_cast<unsigned long long>(p.busySmNs), static_cast<unsigned long long>(p.blocksRun),
                    static_cast<unsigned long long>(p.kernelsRun), static_cast<unsigned long long>(p.slicedOutNs));
        if (p.isMpsServer) std::printf(", \"mps\": \"server\"");
        if (p.mpsServer) std::printf(", \"mps\": \"client\", \"server\": %d", p.mpsServer);
        std::printf("}");
        first = false;
      });
    std::printf("]}");
  }
  std::printf("]}\n");
  return 0;
}

// `--gpu-reset [-i N]`: what resetting a simulated GPU does to MIG (simgpu's own, not NVML's):
// a pending mode becomes current and the GPU and compute instances are gone, as on a real reset.
// Root only, and refused while a process has a context or memory on the GPU.
int gpuReset(int index) {
  if (::geteuid() != 0) {
    std::fprintf(stderr, "simgpu-smi: --gpu-reset: only root can reset a GPU\n");
    return 1;
  }
  simgpu::Config cfg;
  std::string err;
  if (!simgpu::loadConfig(&cfg, &err)) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return 1;
  }
  return forEachGpu(index, [&](unsigned i, nvmlDevice_t dev) {
    unsigned n = 0;
    nvmlProcessInfo_t procs[1];
    if (nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, procs) != NVML_SUCCESS || n > 0) {
      std::fprintf(stderr, "simgpu-smi: GPU %u is in use by %u process(es); stop them before a reset\n", i, n);
      return 1;
    }
    const int host = cfg.container[i];
    simgpu::mig::update(
        cfg.stateDir,
        [&](simgpu::mig::State* s) {
          simgpu::mig::DeviceMig& d = s->dev[host];
          d.current = d.pending;
          for (simgpu::mig::Gi& gi : d.gi) gi = simgpu::mig::Gi{};
          return true;
        },
        &err);
    if (!err.empty()) {
      std::fprintf(stderr, "%s\n", err.c_str());
      return 1;
    }
    std::printf("GPU %u was reset.\n", i);
    return 0;
  });
}

}  // namespace

int main(int argc, char** argv) {
  const bool json = argc > 1 && std::strcmp(argv[1], "--json") == 0;
  nvmlReturn_t r = nvmlInit_v2();
  if (r != NVML_SUCCESS) {
    std::fprintf(stderr, "simgpu-smi: nvmlInit failed: %s\n", nvmlErrorString(r));
    return 1;
  }
  // MIG and reset commands (simgpu_smi_mig.cpp): [-i N] -mig 0|1, -L, mig ..., [-i N] --gpu-reset.
  if (argc > 1 && std::strcmp(argv[1], "mig") == 0) return smiMig(argc - 2, argv + 2);
  if (argc > 1 && std::strcmp(argv[1], "-L") == 0) return smiListWithMig();
  {
    // [-i N] -mig 0|1, [-i N] --gpu-reset, in any order.
    int index = -1;
    const char* mode = nullptr;
    bool reset = false, other = false;
    for (int a = 1; a < argc; ++a) {
      if (std::strcmp(argv[a], "-i") == 0 && a + 1 < argc) index = std::atoi(argv[++a]);
      else if (std::strcmp(argv[a], "-mig") == 0 && a + 1 < argc) mode = argv[++a];
      else if (std::strcmp(argv[a], "--gpu-reset") == 0) reset = true;
      else other = true;
    }
    if (!other && mode && !reset) return smiSetMigMode(index, mode);
    if (!other && reset && !mode) return gpuReset(index);
    if (!json && (mode || reset || index >= 0 || other)) {
      std::fprintf(stderr, "simgpu-smi: usage: simgpu-smi [--json] | -L | [-i N] -mig 0|1 | [-i N] --gpu-reset | mig ...\n");
      return 1;
    }
  }
  unsigned count = 0;
  nvmlDeviceGetCount_v2(&count);
  if (json) {
    const int rc = printJson(count);
    nvmlShutdown();
    return rc;
  }
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != NVML_SUCCESS) continue;
    char name[96] = {}, uuid[96] = {};
    nvmlDeviceGetName(dev, name, sizeof name);
    nvmlDeviceGetUUID(dev, uuid, sizeof uuid);
    nvmlMemory_t mem = {};
    nvmlDeviceGetMemoryInfo(dev, &mem);
    nvmlUtilization_t util = {};
    nvmlDeviceGetUtilizationRates(dev, &util);
    std::printf("GPU %u  %-34s %s\n       memory %8llu MiB used / %8llu MiB total, gpu %u %%\n", i, name, uuid,
                static_cast<unsigned long long>(mem.used >> 20), static_cast<unsigned long long>(mem.total >> 20),
                util.gpu);
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
