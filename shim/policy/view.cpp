// The tenant's view of its devices: cuMemGetInfo, cuDeviceTotalMem (and so
// cudaGetDeviceProperties' totalGlobalMem) and NVML's memory info report a device of the limit's
// size, so frameworks size their caches to the tenant's share:
//   total = min(limit, device total)
//   free  = min(limit - tenant's use (never below 0), the device's real free memory)
//   used  = total - free (NVML)
// With no limit on a device every call passes through unchanged.
#include <cstring>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "runtime/state.h"

namespace cushare::shim {
namespace {

struct View {
  uint64_t total, free;
};

// Applies the tenant's limit to the device's real numbers.
View tenantView(int ordinal, uint64_t realTotal, uint64_t realFree) noexcept {
  const uint64_t limit = effectiveLimit(ordinal);
  if (limit == kUnlimited) return {realTotal, realFree};
  const int idx = state().devices[ordinal].ledgerIndex;
  // Memory of the tenant's dead processes must not shrink the view until some allocation happens
  // to be denied: return it first (a liveness check per occupied slot; this is not the
  // allocation path).
  if (state().ledger->used(idx) > 0) state().ledger->reapDead();
  const uint64_t used = state().ledger->used(idx);
  const uint64_t total = limit < realTotal ? limit : realTotal;
  const uint64_t left = used >= total ? 0 : total - used;
  return {total, left < realFree ? left : realFree};
}

int ordinalOfUuid(const char* uuid) noexcept {
  for (int i = 0; i < state().deviceCount; ++i)
    if (std::strcmp(state().devices[i].uuid, uuid) == 0) return i;
  return -1;
}

// NVML devices are matched to the process's CUDA devices by UUID (their numbering differs).
int ordinalOfNvmlDevice(nvmlDevice_t device) noexcept {
  if (devicesReady() != CUDA_SUCCESS || !realNvml().p_nvmlDeviceGetUUID) return -1;
  char uuid[96] = {};
  if (realNvml().p_nvmlDeviceGetUUID(device, uuid, sizeof uuid) != NVML_SUCCESS) return -1;
  for (char* p = uuid; *p; ++p) *p = static_cast<char>(std::tolower(static_cast<unsigned char>(*p)));
  if (std::strncmp(uuid, "gpu-", 4) == 0) std::memcpy(uuid, "GPU-", 4);
  return ordinalOfUuid(uuid);
}

}  // namespace

CUresult hook_cuMemGetInfo_v2(size_t* free, size_t* total) noexcept {
  const CUresult r = realDriver().p_cuMemGetInfo_v2(free, total);
  if (r != CUDA_SUCCESS) return r;
  if (CUresult rr = devicesReady(); rr != CUDA_SUCCESS) return rr;
  CUdevice d;
  if (realDriver().p_cuCtxGetDevice(&d) != CUDA_SUCCESS || d < 0 || d >= state().deviceCount) return r;
  const View v = tenantView(d, *total, *free);
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
void applyNvmlView(nvmlDevice_t device, Memory* memory, uint64_t reserved) noexcept {
  const int ordinal = ordinalOfNvmlDevice(device);
  if (ordinal < 0) return;
  const View v = tenantView(ordinal, memory->total, memory->free);
  const uint64_t taken = v.total - v.free;
  memory->total = v.total;
  memory->free = v.free;
  memory->used = taken - (reserved < taken ? reserved : 0);
}
}  // namespace

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) noexcept {
  const nvmlReturn_t r = realNvml().p_nvmlDeviceGetMemoryInfo(device, memory);
  if (r == NVML_SUCCESS) applyNvmlView(device, memory, 0);
  return r;
}

nvmlReturn_t hook_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) noexcept {
  const nvmlReturn_t r = realNvml().p_nvmlDeviceGetMemoryInfo_v2(device, memory);
  if (r == NVML_SUCCESS) applyNvmlView(device, memory, memory->reserved);
  return r;
}

}  // namespace cushare::shim
