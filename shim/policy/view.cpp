// The tenant's view of its devices: cuMemGetInfo, cuDeviceTotalMem (and so
// cudaGetDeviceProperties' totalGlobalMem) and NVML's memory info report a device of the limit's
// size, so frameworks size their caches to the tenant's share:
//   total = min(limit, device total)
//   free  = min(limit - tenant's use (never below 0), the device's real free memory)
//   used  = total - free (NVML)
// With no limit on a device every call passes through unchanged. NVML devices are matched by
// UUID: to the process's CUDA devices once cuInit is done (a device CUDA does not show the process
// passes through); before cuInit (an NVML-only process: nvidia-smi, pynvml) to the tenant's ledger
// entry of that UUID directly (state.h, nvmlDeviceView), so every process of the tenant sees the
// same numbers. If that fails (a configuration NVML cannot resolve, see memoryLimitOfUuid), the
// memory queries fail with NVML_ERROR_UNKNOWN: never the whole device.
#include <algorithm>
#include <cstring>
#include <vector>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "runtime/state.h"

namespace cushare::shim {
namespace {

struct View {
  uint64_t total, free;
};

// Applies the tenant's limit to the device's real numbers.
View tenantView(const DeviceView& d, uint64_t realTotal, uint64_t realFree) noexcept {
  const uint64_t limit = effectiveLimit(d);
  if (limit == kUnlimited) return {realTotal, realFree};
  // Memory of the tenant's dead processes must not shrink the view until some allocation happens
  // to be denied: return it first when other processes hold any (a liveness check per occupied
  // slot; this is not the allocation path).
  Ledger& ledger = *state().ledger;
  uint64_t used = ledger.used(d.ledgerIndex);
  if (used > ledger.usedHere(d.ledgerIndex) && ledger.reapDead() > 0) used = ledger.used(d.ledgerIndex);
  const uint64_t total = limit < realTotal ? limit : realTotal;
  const uint64_t left = used >= total ? 0 : total - used;
  // Other tenants' bursts the device would evict for this tenant's allocations count as free
  // (docs/memory-elasticity.md): a guaranteed tenant sees the room it was promised.
  const uint64_t evictable = othersEvictable(d);
  const uint64_t obtainable =
      evictable >= realTotal || realFree > realTotal - evictable ? realTotal : realFree + evictable;
  return {total, left < obtainable ? left : obtainable};
}

// The view of an NVML device: nullptr with *r unchanged to pass through, nullptr with *r set to
// fail the call.
const DeviceView* nvmlView(nvmlDevice_t device, nvmlReturn_t* r) noexcept {
  char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
  if (!realNvml().p_nvmlDeviceGetUUID || realNvml().p_nvmlDeviceGetUUID(device, uuid, sizeof uuid) != NVML_SUCCESS) {
    *r = NVML_ERROR_UNKNOWN;  // a device the shim cannot tell the tenant's limit of
    return nullptr;
  }
  // A GPU ("GPU-<hex>") or a MIG device ("MIG-<hex>"): the shim knows a device by its UUID's 16
  // bytes (cuDeviceGetUuid_v2, a MIG device's own inside one). A legacy "MIG-GPU-.../gi/ci" name
  // is not a device of this process's CUDA: passed through.
  unsigned char bytes[16];
  if (!parseGpuUuidBytes(uuid, bytes)) return nullptr;
  const bool mig = (uuid[0] | 0x20) == 'm';
  if (devicesReady() == CUDA_SUCCESS) {
    for (int i = 0; i < state().deviceCount; ++i)
      if (sameDeviceUuid(state().devices[i].uuid, uuid)) return &state().devices[i];
    return nullptr;
  }
  // Before CUDA: a GPU's view is made from NVML alone; a MIG device's only by the process's CUDA
  // (a host lists up to 7 per GPU, more than a ledger's devices).
  if (mig) return nullptr;
  const DeviceView* v = nvmlDeviceView(formatGpuUuid(bytes).c_str());
  if (!v) *r = NVML_ERROR_UNKNOWN;
  return v;
}

}  // namespace

CUresult hook_cuMemGetInfo_v2(size_t* free, size_t* total) noexcept {
  const CUresult r = realDriver().p_cuMemGetInfo_v2(free, total);
  if (r != CUDA_SUCCESS) return r;
  if (CUresult rr = devicesReady(); rr != CUDA_SUCCESS) return rr;
  CUdevice d;
  if (realDriver().p_cuCtxGetDevice(&d) != CUDA_SUCCESS || d < 0 || d >= state().deviceCount) return r;
  const View v = tenantView(state().devices[d], *total, *free);
  *total = v.total;
  *free = v.free;
  return CUDA_SUCCESS;
}

CUresult hook_cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) noexcept {
  const CUresult r = realDriver().p_cuDeviceTotalMem_v2(bytes, dev);
  if (r != CUDA_SUCCESS) return r;
  if (CUresult rr = devicesReady(); rr != CUDA_SUCCESS) return rr;
  if (dev < 0 || dev >= state().deviceCount) return r;
  const uint64_t limit = effectiveLimit(dev);
  if (limit < *bytes) *bytes = limit;
  return CUDA_SUCCESS;
}

namespace {
// NVML's v1 and v2 memory structs share total/free/used; v2's `used` excludes `reserved`.
template <typename Memory>
nvmlReturn_t applyNvmlView(nvmlDevice_t device, Memory* memory, uint64_t reserved) noexcept {
  nvmlReturn_t r = NVML_SUCCESS;
  const DeviceView* d = nvmlView(device, &r);
  if (!d) return r;
  const View v = tenantView(*d, memory->total, memory->free);
  const uint64_t taken = v.total - v.free;
  memory->total = v.total;
  memory->free = v.free;
  memory->used = taken - (reserved < taken ? reserved : 0);
  return NVML_SUCCESS;
}
}  // namespace

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) noexcept {
  const nvmlReturn_t r = realNvml().p_nvmlDeviceGetMemoryInfo(device, memory);
  return r == NVML_SUCCESS ? applyNvmlView(device, memory, 0) : r;
}

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) noexcept {
  const nvmlReturn_t r = realNvml().p_nvmlDeviceGetMemoryInfo_v2(device, memory);
  return r == NVML_SUCCESS ? applyNvmlView(device, memory, memory->reserved) : r;
}

namespace {
// A per-process list of a device the tenant is limited on shows the tenant's own processes only:
// those the tenant's ledger has a live slot for (pids as this process sees them), with what the
// device reports for each. Other tenants' processes and usage stay hidden, as the memory figures
// do. NVML's buffer protocol is kept for the filtered list: *infoCount is the caller's capacity on
// entry; when the tenant's entries do not fit, NVML_ERROR_INSUFFICIENT_SIZE with the number needed.
// A device the shim does not limit (no limit, a MIG handle, one CUDA does not show) passes through.
// Keeps, in order, the entries of processes the tenant's ledger has a live slot for; their count.
template <typename Info>
unsigned keepTenants(const DeviceView& d, std::vector<Info>* all) {
  const std::vector<Ledger::ProcUsage> mine = state().ledger->processes(d.ledgerIndex);
  unsigned kept = 0;
  for (const Info& info : *all) {
    const bool ours = std::any_of(mine.begin(), mine.end(), [&](const Ledger::ProcUsage& p) {
      return p.pid > 0 && static_cast<unsigned>(p.pid) == info.pid;
    });
    if (ours) (*all)[kept++] = info;
  }
  return kept;
}

// fetch(unsigned* n, Info* buf) is the real query with the caller's other arguments bound; real
// the same with the caller's own count and array (a pass-through).
template <typename Info, typename Fetch>
nvmlReturn_t tenantProcesses(nvmlDevice_t device, unsigned* infoCount, Info* infos, Fetch fetch) noexcept {
  if (!infoCount) return fetch(infoCount, infos);  // NVML's own refusal
  nvmlReturn_t r = NVML_SUCCESS;
  const DeviceView* d = nvmlView(device, &r);
  if (!d) return r == NVML_SUCCESS ? fetch(infoCount, infos) : r;
  if (effectiveLimit(*d) == kUnlimited) return fetch(infoCount, infos);
  const unsigned capacity = infos ? *infoCount : 0;  // a null array is a size query
  try {
    std::vector<Info> all(std::max(capacity, 64u));
    for (int tries = 0;; ++tries) {  // the list may grow between the calls: retry a few times
      unsigned n = static_cast<unsigned>(all.size());
      r = fetch(&n, all.data());
      if (r == NVML_SUCCESS) {
        all.resize(n);
        break;
      }
      if (r != NVML_ERROR_INSUFFICIENT_SIZE) return r;
      if (tries == 4) return NVML_ERROR_UNKNOWN;
      all.resize(static_cast<size_t>(n) + 16);
    }
    const unsigned kept = keepTenants(*d, &all);
    if (kept > capacity) {
      *infoCount = kept;
      return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    std::copy(all.begin(), all.begin() + kept, infos);
    *infoCount = kept;
    return NVML_SUCCESS;
  } catch (...) {  // bad_alloc
    return NVML_ERROR_UNKNOWN;
  }
}
}  // namespace

// The detail list (CUDA 12.6+), one mode per call: the same filter and protocol, through the
// struct's numProcArrayEntries and procArray. A list the real library refuses (null, a version or
// mode it does not know) is its answer.
nvmlReturn_t hook_nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t* plist) noexcept {
  const auto real = realNvml().p_nvmlDeviceGetRunningProcessDetailList;
  if (!plist || plist->version != nvmlProcessDetailList_v1 || (plist->numProcArrayEntries > 0 && !plist->procArray))
    return real(device, plist);
  nvmlReturn_t r = NVML_SUCCESS;
  const DeviceView* d = nvmlView(device, &r);
  if (!d) return r == NVML_SUCCESS ? real(device, plist) : r;
  if (effectiveLimit(*d) == kUnlimited) return real(device, plist);
  try {
    std::vector<nvmlProcessDetail_v1_t> all(std::max(plist->numProcArrayEntries, 64u));
    nvmlProcessDetailList_t mine = *plist;
    for (int tries = 0;; ++tries) {
      mine.numProcArrayEntries = static_cast<unsigned>(all.size());
      mine.procArray = all.data();
      r = real(device, &mine);
      if (r == NVML_SUCCESS) {
        all.resize(mine.numProcArrayEntries);
        break;
      }
      if (r != NVML_ERROR_INSUFFICIENT_SIZE) return r;
      if (tries == 4) return NVML_ERROR_UNKNOWN;
      all.resize(static_cast<size_t>(mine.numProcArrayEntries) + 16);
    }
    const unsigned kept = keepTenants(*d, &all);
    if (kept > plist->numProcArrayEntries) {
      plist->numProcArrayEntries = kept;
      return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    std::copy(all.begin(), all.begin() + kept, plist->procArray);
    plist->numProcArrayEntries = kept;
    return NVML_SUCCESS;
  } catch (...) {  // bad_alloc
    return NVML_ERROR_UNKNOWN;
  }
}

#define CUSHARE_PROCESS_LIST_HOOK(sym, Info)                                                   \
  nvmlReturn_t hook_##sym(nvmlDevice_t device, unsigned int* infoCount, Info* infos) noexcept { \
    return tenantProcesses(device, infoCount, infos, [device](unsigned* n, Info* buf) {        \
      return realNvml().p_##sym(device, n, buf);                                                \
    });                                                                                         \
  }
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
CUSHARE_PROCESS_LIST_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)
#undef CUSHARE_PROCESS_LIST_HOOK

// Per-process utilisation samples name pids too: the tenant's own only, by the same rule.
nvmlReturn_t hook_nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t* utilization,
                                                  unsigned int* processSamplesCount,
                                                  unsigned long long lastSeenTimeStamp) noexcept {
  return tenantProcesses(device, processSamplesCount, utilization,
                         [device, lastSeenTimeStamp](unsigned* n, nvmlProcessUtilizationSample_t* buf) {
                           return realNvml().p_nvmlDeviceGetProcessUtilization(device, buf, n, lastSeenTimeStamp);
                         });
}

// nvmlInit*: the wrapper has set up the process state (configuration, ledger) first, so a
// configuration the shim refuses fails here, in NVML's terms, before anything is reported.
nvmlReturn_t hook_nvmlInit_v2() noexcept { return realNvml().p_nvmlInit_v2(); }
nvmlReturn_t hook_nvmlInit() noexcept { return realNvml().p_nvmlInit(); }
nvmlReturn_t hook_nvmlInitWithFlags(unsigned int flags) noexcept { return realNvml().p_nvmlInitWithFlags(flags); }

}  // namespace cushare::shim
