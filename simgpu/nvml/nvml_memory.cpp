// simgpu's libnvidia-ml.so.1: memory, running processes and utilisation.
//
// Everything is read from the host-wide state (shared_state.h) at the time of the call, after
// returning the memory of dead processes (reap), so what NVML reports here is what every process
// using simgpu has allocated right now: total = capacity, used = the sum over live processes,
// free = total - used. simgpu reserves nothing for itself (v2's reserved is 0).
//
// Process lists follow NVML's buffer protocol: *infoCount is the caller's capacity on entry and
// the number of entries written on success; when the array is too small the call returns
// NVML_ERROR_INSUFFICIENT_SIZE and leaves the number needed in *infoCount.
#include "nvml_internal.h"

using namespace simgpu::nvml;

namespace {

void readMemory(int dev, unsigned long long* total, unsigned long long* used) {
  simgpu::SharedState* st = state();
  st->reap();
  *total = st->capacity(dev);
  const unsigned long long u = st->used(dev);
  *used = u < *total ? u : *total;  // cannot exceed, but never report a negative free
}

void fill(nvmlProcessInfo_v1_t* out, const simgpu::SharedState::ProcUsage& p) {
  out->pid = static_cast<unsigned>(p.pid);
  out->usedGpuMemory = p.used;
}

void fill(nvmlProcessInfo_v2_t* out, const simgpu::SharedState::ProcUsage& p) {
  out->pid = static_cast<unsigned>(p.pid);
  out->usedGpuMemory = p.used;
  out->gpuInstanceId = p.gi;  // 0xFFFFFFFF outside MIG
  out->computeInstanceId = p.ci;
}

template <class Info>
nvmlReturn_t computeProcesses(nvmlDevice_t handle, unsigned int* infoCount, Info* infos) {
  nvmlDevice_st* d;
  simgpu::mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!infoCount || (*infoCount > 0 && !infos)) return NVML_ERROR_INVALID_ARGUMENT;

  // One snapshot of every slot, so the count we report and the entries we write agree.
  simgpu::SharedState::ProcUsage found[simgpu::kMaxSlots];
  int total = 0;
  int n = state()->processes(d->host, found, simgpu::kMaxSlots, &total);
  if (isMig) {  // a MIG device lists the processes running in it
    int kept = 0;
    for (int i = 0; i < n; ++i)
      if (found[i].gi == m.gi && found[i].ci == m.ci) found[kept++] = found[i];
    n = kept;
  }
  if (static_cast<unsigned>(n) > *infoCount) {
    *infoCount = static_cast<unsigned>(n);
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (int i = 0; i < n; ++i) fill(&infos[i], found[i]);
  *infoCount = static_cast<unsigned>(n);
  return NVML_SUCCESS;
}

// simgpu runs no graphics or MPS clients: always an empty list (a MIG device's too).
nvmlReturn_t noProcesses(nvmlDevice_t handle, unsigned int* infoCount) {
  nvmlDevice_st* d;
  simgpu::mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
  *infoCount = 0;
  return NVML_SUCCESS;
}

}  // namespace

// A MIG device's memory is its GPU instance's: its total, and what the instance's processes hold.
static nvmlReturn_t memoryOf(nvmlDevice_t handle, unsigned long long* total, unsigned long long* used) {
  nvmlDevice_st* d;
  simgpu::mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (isMig) {  // the GPU instance's memory, and what its processes hold
    *total = m.giProfile->memoryMiB << 20;
    state()->reap();
    *used = state()->instanceUsed(d->host, m.gi);
  } else {
    readMemory(d->host, total, used);
  }
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t handle, nvmlMemory_t* memory) {
  unsigned long long total, used;
  if (nvmlReturn_t r = memoryOf(handle, &total, &used); r != NVML_SUCCESS) return r;
  if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
  memory->total = total;
  memory->used = used;
  memory->free = total - used;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t handle, nvmlMemory_v2_t* memory) {
  unsigned long long total, used;
  if (nvmlReturn_t r = memoryOf(handle, &total, &used); r != NVML_SUCCESS) return r;
  if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
  if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  memory->total = total;
  memory->reserved = 0;
  memory->used = used;
  memory->free = total - used;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t handle, unsigned int* infoCount,
                                                                  nvmlProcessInfo_v1_t* infos) {
  return computeProcesses(handle, infoCount, infos);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t handle, unsigned int* infoCount,
                                                                     nvmlProcessInfo_v2_t* infos) {
  return computeProcesses(handle, infoCount, infos);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t handle, unsigned int* infoCount,
                                                                     nvmlProcessInfo_t* infos) {
  return computeProcesses(handle, infoCount, infos);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t handle, unsigned int* infoCount,
                                                                   nvmlProcessInfo_v1_t*) {
  return noProcesses(handle, infoCount);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t handle, unsigned int* infoCount,
                                                                      nvmlProcessInfo_v2_t*) {
  return noProcesses(handle, infoCount);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t handle, unsigned int* infoCount,
                                                                      nvmlProcessInfo_t*) {
  return noProcesses(handle, infoCount);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t handle,
                                                                        unsigned int* infoCount,
                                                                        nvmlProcessInfo_t*) {
  return noProcesses(handle, infoCount);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t handle, unsigned int* infoCount,
                                                                     nvmlProcessInfo_v1_t*) {
  return noProcesses(handle, infoCount);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t handle,
                                                                        unsigned int* infoCount,
                                                                        nvmlProcessInfo_v2_t*) {
  return noProcesses(handle, infoCount);
}

// One list per mode: compute (and all) lists the processes holding memory; simgpu runs no
// graphics or MPS clients. Buffer protocol as the other lists, through numProcArrayEntries.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t handle, nvmlProcessDetailList_t* plist) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!plist || plist->version != nvmlProcessDetailList_v1 || plist->mode >= NVML_PROCESS_MODE_MAX)
    return NVML_ERROR_INVALID_ARGUMENT;
  if (plist->numProcArrayEntries > 0 && !plist->procArray) return NVML_ERROR_INVALID_ARGUMENT;
  simgpu::SharedState::ProcUsage found[simgpu::kMaxSlots];
  int total = 0;
  int n = 0;
  if (plist->mode == NVML_PROCESS_MODE_COMPUTE || plist->mode == NVML_PROCESS_MODE_ALL)
    n = state()->processes(d->host, found, simgpu::kMaxSlots, &total);
  if (static_cast<unsigned>(n) > plist->numProcArrayEntries) {
    plist->numProcArrayEntries = static_cast<unsigned>(n);
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (int i = 0; i < n; ++i) {
    nvmlProcessDetail_v1_t& out = plist->procArray[i];
    out.pid = static_cast<unsigned>(found[i].pid);
    out.usedGpuMemory = found[i].used;
    out.gpuInstanceId = found[i].gi;  // 0xFFFFFFFF outside MIG
    out.computeInstanceId = found[i].ci;
    out.usedGpuCcProtectedMemory = 0;
  }
  plist->numProcArrayEntries = static_cast<unsigned>(n);
  return NVML_SUCCESS;
}
