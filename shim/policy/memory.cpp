// Device-memory limits: every allocation path reserves its size in the tenant ledger before the
// driver allocates (reserve-then-allocate) and rolls the reservation back if the driver fails;
// frees return exactly what was charged. Counted: cuMemAlloc, cuMemAllocPitch, cuMemAllocManaged,
// cuMemAllocAsync / cuMemAllocFromPoolAsync (the pools' reserved memory, pools.cpp),
// cuMemCreate (charged at create, returned when released and unmapped), arrays and mipmapped
// arrays (texel storage). Host memory is not counted. See docs/memory-accounting.md.
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "policy/alloc_table.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {

// pools.cpp
CUresult poolAllocCurrent(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream s, bool perThread) noexcept;
void settleAllPools() noexcept;

namespace {

AllocTable& allocations() {
  static AllocTable* t = new AllocTable;  // leaked: frees can arrive during exit teardown
  return *t;
}

// The current context's device, as an ordinal this process sees.
CUresult currentOrdinal(int* ordinal) noexcept {
  CUdevice d;
  if (CUresult r = realDriver().p_cuCtxGetDevice(&d); r != CUDA_SUCCESS) return r;
  if (d < 0 || d >= state().deviceCount) return CUDA_ERROR_INVALID_DEVICE;
  *ordinal = d;
  return CUDA_SUCCESS;
}

void logDenied(int ordinal, uint64_t bytes, uint64_t limit) noexcept {
  const ShimState& s = state();
  const int idx = s.devices[ordinal].ledgerIndex;
  logLine(LogLevel::kError,
          "tenant %s device %d (%s): allocation of %llu bytes denied: %llu of %llu bytes in use",
          s.config.tenant.c_str(), ordinal, s.devices[ordinal].uuid, static_cast<unsigned long long>(bytes),
          static_cast<unsigned long long>(s.ledger->used(idx)), static_cast<unsigned long long>(limit));
  logStackRateLimited(LogLevel::kError);
}

// Reserves bytes on the device; CUDA_ERROR_OUT_OF_MEMORY (and one log line) if over the limit.
CUresult reserve(int ordinal, uint64_t bytes) noexcept {
  const uint64_t limit = effectiveLimit(ordinal);
  if (state().ledger->reserve(state().devices[ordinal].ledgerIndex, bytes, limit)) return CUDA_SUCCESS;
  logDenied(ordinal, bytes, limit);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

void release(const Charge& c) noexcept { state().ledger->release(c.device, c.bytes); }

// The common shape of a counted allocation of the current device.
template <typename Alloc>
CUresult chargedAlloc(uint64_t bytes, uintptr_t* key, Alloc&& alloc) noexcept {
  if (CUresult r = devicesReady(); r != CUDA_SUCCESS) return r;
  int ordinal;
  if (CUresult r = currentOrdinal(&ordinal); r != CUDA_SUCCESS) return r;
  if (CUresult r = reserve(ordinal, bytes); r != CUDA_SUCCESS) return r;
  const CUresult r = alloc();
  const Charge c{state().devices[ordinal].ledgerIndex, bytes};
  if (r != CUDA_SUCCESS) {
    release(c);
    return r;
  }
  allocations().put(*key, c);
  return CUDA_SUCCESS;
}

// Frees through the driver, then returns the charge (only if the driver freed it). *uncharged
// (optional) tells whether the freed memory was not charged here (e.g. a pool's).
template <typename Free>
CUresult chargedFree(uintptr_t key, Free&& free, bool* uncharged = nullptr) noexcept {
  const CUresult r = free();
  if (r == CUDA_SUCCESS && key) {
    Charge c;
    const bool found = allocations().take(key, &c);
    if (found) release(c);
    if (uncharged) *uncharged = !found;
  }
  return r;
}

size_t formatBytes(CUarray_format f) noexcept {
  switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
      return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
      return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
      return 4;
    default:
      return 4;  // newer formats: count generously rather than not at all
  }
}

uint64_t arrayBytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned channels) noexcept {
  return static_cast<uint64_t>(w) * (h ? h : 1) * (d ? d : 1) * formatBytes(f) * (channels ? channels : 1);
}

// ---- virtual memory: a handle's charge lasts until it is released and no longer mapped ----
struct VmmHandle {
  Charge charge;
  int refs = 1;  // create + retains; cuMemRelease drops one
  int maps = 0;
};
struct VmmState {
  std::mutex mu;
  std::unordered_map<CUmemGenericAllocationHandle, VmmHandle> handles;
  std::unordered_map<CUdeviceptr, std::pair<CUmemGenericAllocationHandle, size_t>> mappings;
};
VmmState& vmm() {
  static VmmState* v = new VmmState;
  return *v;
}
// Caller holds vmm().mu.
void vmmMaybeRelease(CUmemGenericAllocationHandle h) noexcept {
  auto it = vmm().handles.find(h);
  if (it == vmm().handles.end() || it->second.refs > 0 || it->second.maps > 0) return;
  release(it->second.charge);
  vmm().handles.erase(it);
}

}  // namespace

CUresult hook_cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) noexcept {
  if (!dptr || bytes == 0) return realDriver().p_cuMemAlloc_v2(dptr, bytes);
  uintptr_t key = 0;
  return chargedAlloc(bytes, &key, [&] {
    CUresult r = realDriver().p_cuMemAlloc_v2(dptr, bytes);
    key = *dptr;
    return r;
  });
}

CUresult hook_cuMemAllocManaged(CUdeviceptr* dptr, size_t bytes, unsigned flags) noexcept {
  if (!dptr || bytes == 0) return realDriver().p_cuMemAllocManaged(dptr, bytes, flags);
  uintptr_t key = 0;
  return chargedAlloc(bytes, &key, [&] {
    CUresult r = realDriver().p_cuMemAllocManaged(dptr, bytes, flags);
    key = *dptr;
    return r;
  });
}

CUresult hook_cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch, size_t width, size_t height,
                                 unsigned elementSize) noexcept {
  if (!dptr || !pitch || width == 0 || height == 0) return realDriver().p_cuMemAllocPitch_v2(dptr, pitch, width, height, elementSize);
  // The pitch is known only afterwards: reserve a bound (rows padded to 512 bytes, more than
  // devices use), then settle to pitch * height.
  const uint64_t bound = (static_cast<uint64_t>(width) + 511) / 512 * 512 * height;
  uintptr_t key = 0;
  CUresult r = chargedAlloc(bound, &key, [&] {
    CUresult rr = realDriver().p_cuMemAllocPitch_v2(dptr, pitch, width, height, elementSize);
    key = *dptr;
    return rr;
  });
  if (r != CUDA_SUCCESS) return r;
  Charge c;
  allocations().take(key, &c);
  const uint64_t actual = static_cast<uint64_t>(*pitch) * height;
  if (actual <= c.bytes)
    state().ledger->release(c.device, c.bytes - actual);
  else  // a driver with wider rows than the bound: record what was really allocated
    state().ledger->reserve(c.device, actual - c.bytes, kUnlimited);
  allocations().put(key, Charge{c.device, actual});
  return CUDA_SUCCESS;
}

CUresult hook_cuMemFree_v2(CUdeviceptr dptr) noexcept {
  bool uncharged = false;
  const CUresult r = chargedFree(dptr, [&] { return realDriver().p_cuMemFree_v2(dptr); }, &uncharged);
  // cuMemFree of stream-ordered memory (which is charged to its pool, not here) returns it to the
  // pool at once; only then is there a pool to settle, so plain frees stay off that path.
  if (uncharged) settleAllPools();
  return r;
}

// Stream-ordered allocations: the pools they come from are charged for what they reserve
// (pools.cpp). While the stream is capturing, the call only records a graph node:
// graph_memory.cpp charges the graph's memory when it is launched.
bool capturing(CUstream s, bool perThread) noexcept {
  auto fn = perThread ? realDriver().p_cuStreamIsCapturing_ptsz : realDriver().p_cuStreamIsCapturing;
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  return fn && fn(s, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

CUresult hook_cuMemAllocAsync(CUdeviceptr* dptr, size_t bytes, CUstream s) noexcept {
  if (!dptr || bytes == 0 || capturing(s, false)) return realDriver().p_cuMemAllocAsync(dptr, bytes, s);
  return poolAllocCurrent(dptr, bytes, nullptr, s, false);
}
CUresult hook_cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytes, CUstream s) noexcept {
  if (!dptr || bytes == 0 || capturing(s, true)) return realDriver().p_cuMemAllocAsync_ptsz(dptr, bytes, s);
  return poolAllocCurrent(dptr, bytes, nullptr, s, true);
}
CUresult hook_cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream s) noexcept {
  if (!dptr || bytes == 0 || !pool || capturing(s, false))
    return realDriver().p_cuMemAllocFromPoolAsync(dptr, bytes, pool, s);
  return poolAllocCurrent(dptr, bytes, pool, s, false);
}
CUresult hook_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream s) noexcept {
  if (!dptr || bytes == 0 || !pool || capturing(s, true))
    return realDriver().p_cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, s);
  return poolAllocCurrent(dptr, bytes, pool, s, true);
}
// A free returns memory to its pool, which keeps it until a synchronisation point or trim
// (pools.cpp settles the charge then).
CUresult hook_cuMemFreeAsync(CUdeviceptr dptr, CUstream s) noexcept {
  return chargedFree(dptr, [&] { return realDriver().p_cuMemFreeAsync(dptr, s); });
}
CUresult hook_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) noexcept {
  return chargedFree(dptr, [&] { return realDriver().p_cuMemFreeAsync_ptsz(dptr, s); });
}

// ---- virtual memory ----
CUresult hook_cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                          unsigned long long flags) noexcept {
  RealDriver& d = realDriver();
  if (!handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return d.p_cuMemCreate(handle, size, prop, flags);
  if (CUresult r = devicesReady(); r != CUDA_SUCCESS) return r;
  const int ordinal = prop->location.id;
  if (ordinal < 0 || ordinal >= state().deviceCount) return d.p_cuMemCreate(handle, size, prop, flags);
  if (CUresult r = reserve(ordinal, size); r != CUDA_SUCCESS) return r;
  const Charge c{state().devices[ordinal].ledgerIndex, size};
  const CUresult r = d.p_cuMemCreate(handle, size, prop, flags);
  if (r != CUDA_SUCCESS) {
    release(c);
    return r;
  }
  std::lock_guard<std::mutex> g(vmm().mu);
  vmm().handles[*handle] = VmmHandle{c, 1, 0};
  return CUDA_SUCCESS;
}

CUresult hook_cuMemRelease(CUmemGenericAllocationHandle handle) noexcept {
  const CUresult r = realDriver().p_cuMemRelease(handle);
  if (r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> g(vmm().mu);
  auto it = vmm().handles.find(handle);
  if (it != vmm().handles.end()) {
    --it->second.refs;
    vmmMaybeRelease(handle);
  }
  return r;
}

CUresult hook_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                       unsigned long long flags) noexcept {
  const CUresult r = realDriver().p_cuMemMap(ptr, size, offset, handle, flags);
  if (r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> g(vmm().mu);
  auto it = vmm().handles.find(handle);
  if (it != vmm().handles.end()) {
    ++it->second.maps;
    vmm().mappings[ptr] = {handle, size};
  }
  return r;
}

CUresult hook_cuMemUnmap(CUdeviceptr ptr, size_t size) noexcept {
  const CUresult r = realDriver().p_cuMemUnmap(ptr, size);
  if (r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> g(vmm().mu);
  for (auto it = vmm().mappings.begin(); it != vmm().mappings.end();) {
    if (it->first >= ptr && it->first < ptr + size) {
      const CUmemGenericAllocationHandle h = it->second.first;
      it = vmm().mappings.erase(it);
      auto hit = vmm().handles.find(h);
      if (hit != vmm().handles.end()) {
        --hit->second.maps;
        vmmMaybeRelease(h);
      }
    } else {
      ++it;
    }
  }
  return r;
}

CUresult hook_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) noexcept {
  const CUresult r = realDriver().p_cuMemRetainAllocationHandle(handle, addr);
  if (r != CUDA_SUCCESS || !handle) return r;
  std::lock_guard<std::mutex> g(vmm().mu);
  auto it = vmm().handles.find(*handle);
  if (it != vmm().handles.end()) ++it->second.refs;
  return r;
}

// ---- arrays ----
CUresult hook_cuArrayCreate_v2(CUarray* array, const CUDA_ARRAY_DESCRIPTOR* desc) noexcept {
  if (!array || !desc) return realDriver().p_cuArrayCreate_v2(array, desc);
  uintptr_t key = 0;
  return chargedAlloc(arrayBytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels), &key, [&] {
    CUresult r = realDriver().p_cuArrayCreate_v2(array, desc);
    key = reinterpret_cast<uintptr_t>(*array);
    return r;
  });
}

CUresult hook_cuArray3DCreate_v2(CUarray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc) noexcept {
  if (!array || !desc) return realDriver().p_cuArray3DCreate_v2(array, desc);
  uintptr_t key = 0;
  return chargedAlloc(arrayBytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels), &key, [&] {
    CUresult r = realDriver().p_cuArray3DCreate_v2(array, desc);
    key = reinterpret_cast<uintptr_t>(*array);
    return r;
  });
}

CUresult hook_cuArrayDestroy(CUarray array) noexcept {
  return chargedFree(reinterpret_cast<uintptr_t>(array), [&] { return realDriver().p_cuArrayDestroy(array); });
}

CUresult hook_cuMipmappedArrayCreate(CUmipmappedArray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc,
                                     unsigned levels) noexcept {
  if (!array || !desc) return realDriver().p_cuMipmappedArrayCreate(array, desc, levels);
  // Every level, halving each extent down to 1, as the driver clamps the level count.
  uint64_t total = 0;
  size_t w = desc->Width, h = desc->Height, d = desc->Depth;
  const bool layered = desc->Flags & CUDA_ARRAY3D_LAYERED;
  for (unsigned i = 0; i < levels; ++i) {
    total += arrayBytes(w, h, d, desc->Format, desc->NumChannels);
    if (w <= 1 && h <= 1 && (layered || d <= 1)) break;
    w = w > 1 ? w / 2 : 1;
    h = h > 1 ? h / 2 : h;
    if (!layered) d = d > 1 ? d / 2 : d;
  }
  uintptr_t key = 0;
  return chargedAlloc(total, &key, [&] {
    CUresult r = realDriver().p_cuMipmappedArrayCreate(array, desc, levels);
    key = reinterpret_cast<uintptr_t>(*array);
    return r;
  });
}

CUresult hook_cuMipmappedArrayDestroy(CUmipmappedArray array) noexcept {
  return chargedFree(reinterpret_cast<uintptr_t>(array), [&] { return realDriver().p_cuMipmappedArrayDestroy(array); });
}

}  // namespace cushare::shim
