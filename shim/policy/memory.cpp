// Device-memory limits: every allocation path reserves its size in the tenant ledger before the
// driver allocates (reserve-then-allocate) and rolls the reservation back if the driver fails;
// frees return exactly what was charged. Counted: cuMemAlloc, cuMemAllocPitch, cuMemAllocManaged,
// cuMemAllocAsync / cuMemAllocFromPoolAsync (the pools' reserved memory, pools.cpp),
// cuMemCreate (charged at create, returned when released and unmapped), arrays and mipmapped
// arrays (what the driver reserves for them, padding and tiling included). Host memory is not
// counted. A context destroyed or reset frees what it owned: the charges of every allocation the
// driver no longer has are returned then. See docs/memory-accounting.md.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "policy/alloc_table.h"
#include "policy/reclaim_wait.h"
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

// Reserves bytes on the device; CUDA_ERROR_OUT_OF_MEMORY (and one log line) if over the limit:
// for memory the device can evict (managed), the limit in force; for any other, plainLimit (a
// bursting tenant's guarantee).
CUresult reserve(int ordinal, uint64_t bytes, bool evictable = false) noexcept {
  const uint64_t limit = evictable ? managedLimit(ordinal) : plainLimit(ordinal);
  if (state().ledger->reserve(state().devices[ordinal].ledgerIndex, bytes, limit)) return CUDA_SUCCESS;
  logDenied(ordinal, bytes, limit);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

void release(const Charge& c) noexcept { state().ledger->release(c.device, c.bytes); }

// The common shape of a counted allocation of the current device.
template <typename Alloc>
CUresult chargedAllocOn(int ordinal, uint64_t bytes, uintptr_t* key, Alloc&& alloc, ChargeKind kind = ChargeKind::kPointer,
                        bool evictable = false) noexcept {
  if (CUresult r = reserve(ordinal, bytes, evictable); r != CUDA_SUCCESS) return r;
  const CUresult r = allocOrWaitForReclaim(ordinal, bytes, alloc);
  const Charge c{state().devices[ordinal].ledgerIndex, kind, bytes};
  if (r != CUDA_SUCCESS) {
    release(c);
    return r;
  }
  allocations().put(*key, c);
  return CUDA_SUCCESS;
}
template <typename Alloc>
CUresult chargedAlloc(uint64_t bytes, uintptr_t* key, Alloc&& alloc, ChargeKind kind = ChargeKind::kPointer,
                      bool evictable = false) noexcept {
  if (CUresult r = devicesReady(); r != CUDA_SUCCESS) return r;
  int ordinal;
  if (CUresult r = currentOrdinal(&ordinal); r != CUDA_SUCCESS) return r;
  return chargedAllocOn(ordinal, bytes, key, alloc, kind, evictable);
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
      return 16;  // newer formats (up to four 32-bit channels in one texel): count generously
  }
}

uint64_t roundUp(uint64_t v, uint64_t a) noexcept { return (v + a - 1) / a * a; }

// cudaMalloc's documented alignment: no device places two allocations closer, so each takes at
// least this much (real drivers may take more; simgpu takes exactly this).
constexpr uint64_t kMinAllocation = 256;

// An upper bound of what a driver reserves for one image of an array, used only when the driver
// cannot tell (below): block-linear storage pads each row to a 64-byte GOB, rows to blocks of up
// to 16 GOBs (128 rows) and 3D slices to blocks of up to 32; layers are stored one after another.
uint64_t tiledBound(const CUDA_ARRAY3D_DESCRIPTOR& d) noexcept {
  const bool layered = d.Flags & CUDA_ARRAY3D_LAYERED;
  const uint64_t channels = d.NumChannels ? d.NumChannels : 1;
  const uint64_t row = roundUp(static_cast<uint64_t>(d.Width) * formatBytes(d.Format) * channels, 64);
  const uint64_t rows = roundUp(d.Height ? d.Height : 1, 128);
  const uint64_t depth = d.Depth ? d.Depth : 1;
  const uint64_t slices = layered ? depth : roundUp(depth, 32);
  const uint64_t faces = (d.Flags & CUDA_ARRAY3D_CUBEMAP) && !layered ? 6 : 1;
  return roundUp(row * rows * slices * faces, 2ull << 20);
}

// What the driver reserves for an array (or a mipmapped array, levels > 0) of this descriptor: a
// twin made with CUDA_ARRAY3D_DEFERRED_MAPPING takes no memory, and the driver reports its size
// (cuArrayGetMemoryRequirements answers only for such arrays). A driver that cannot make the twin
// gets the tiling bound instead: never less than it reserves.
uint64_t arrayRequirement(const CUDA_ARRAY3D_DESCRIPTOR& desc, unsigned levels, int ordinal) noexcept {
  RealDriver& drv = realDriver();
  CUDA_ARRAY3D_DESCRIPTOR twin = desc;
  twin.Flags |= CUDA_ARRAY3D_DEFERRED_MAPPING;
  CUDA_ARRAY_MEMORY_REQUIREMENTS req = {};
  bool known = false;
  if (levels == 0 && drv.p_cuArray3DCreate_v2 && drv.p_cuArrayGetMemoryRequirements) {
    CUarray a = nullptr;
    if (drv.p_cuArray3DCreate_v2(&a, &twin) == CUDA_SUCCESS) {
      known = drv.p_cuArrayGetMemoryRequirements(&req, a, ordinal) == CUDA_SUCCESS;
      drv.p_cuArrayDestroy(a);
    }
  } else if (levels > 0 && drv.p_cuMipmappedArrayCreate && drv.p_cuMipmappedArrayGetMemoryRequirements) {
    CUmipmappedArray m = nullptr;
    if (drv.p_cuMipmappedArrayCreate(&m, &twin, levels) == CUDA_SUCCESS) {
      known = drv.p_cuMipmappedArrayGetMemoryRequirements(&req, m, ordinal) == CUDA_SUCCESS;
      drv.p_cuMipmappedArrayDestroy(m);
    }
  }
  if (known) return req.size;
  if (levels == 0) return tiledBound(desc);
  // Every level, halving each extent down to 1, as the driver clamps the level count.
  uint64_t total = 0;
  CUDA_ARRAY3D_DESCRIPTOR l = desc;
  const bool layered = desc.Flags & CUDA_ARRAY3D_LAYERED;
  for (unsigned i = 0; i < levels; ++i) {
    total += tiledBound(l);
    if (l.Width <= 1 && l.Height <= 1 && (layered || l.Depth <= 1)) break;
    l.Width = l.Width > 1 ? l.Width / 2 : 1;
    l.Height = l.Height > 1 ? l.Height / 2 : l.Height;
    if (!layered) l.Depth = l.Depth > 1 ? l.Depth / 2 : l.Depth;
  }
  return total;
}

// Arrays whose memory the driver does not reserve at creation: sparse and deferred-mapping
// arrays get theirs from cuMemMapArrayAsync out of cuMemCreate handles, which are charged.
bool reservesNothing(const CUDA_ARRAY3D_DESCRIPTOR& d) noexcept {
  return d.Flags & (CUDA_ARRAY3D_SPARSE | CUDA_ARRAY3D_DEFERRED_MAPPING);
}

// Creates an array charged with what the driver reserves for it.
template <typename Create>
CUresult chargedArray(const CUDA_ARRAY3D_DESCRIPTOR& desc, unsigned levels, ChargeKind kind, uintptr_t* key,
                      Create&& create) noexcept {
  if (CUresult r = devicesReady(); r != CUDA_SUCCESS) return r;
  int ordinal;
  if (CUresult r = currentOrdinal(&ordinal); r != CUDA_SUCCESS) return r;
  return chargedAlloc(arrayRequirement(desc, levels, ordinal), key, create, kind);
}

// ---- virtual memory: a handle's charge lasts until it is released and no longer mapped ----
// Shareable memory lives on in the driver while any exported descriptor or imported handle refers
// to it, which the shim cannot see: a handle once exported stays charged until this process exits
// (the ledger returns a dead process's usage); an imported handle is charged, before the driver
// maps it, for what it maps, until it is released and unmapped (the exporter's tenant pays too
// while its process lives: over-counted, never under).
struct VmmHandle {
  Charge charge;
  int refs = 1;  // create / import + retains; cuMemRelease drops one
  int maps = 0;
  bool exported = false;
  int importedOn = -1;  // an imported handle: the ordinal of its device
};
struct VmmState {
  std::mutex mu;
  std::atomic<int> imported{0};  // imported handles ever recorded: cuMemMap looks them up only then
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
  if (!it->second.exported) release(it->second.charge);
  vmm().handles.erase(it);
}

// ---- bursting (docs/memory-elasticity.md) ----
// cuMemAlloc of a bursting tenant: ordinary device memory while what it holds stays within its
// guarantee; above it, up to its limit, managed memory (the device evicts it to host memory when a
// guaranteed allocation needs the room), prefetched to the device. Memory that cannot be managed
// (the driver refuses: a stream capture in progress, no managed memory support) is refused above
// the guarantee, never given as ordinary memory: that would take memory another tenant's
// guarantee counts on.
std::atomic<uint32_t> gBurstRefusals{0};

// The current context's stream for burst prefetches: made once per context (a stream costs the
// driver a few microseconds, and simgpu a thread) and forgotten when contexts are torn down
// (burstForgetContexts: the driver destroys a context's streams with it).
struct BurstStreams {
  std::mutex mu;
  CUcontext ctx[8] = {};
  CUstream stream[8] = {};
  int ordinal[8] = {};
};
BurstStreams& burstStreams() {
  static BurstStreams* b = new BurstStreams;  // leaked: used until exit
  return *b;
}
CUstream burstStream(int ordinal) noexcept {
  RealDriver& drv = realDriver();
  CUcontext ctx = nullptr;
  if (!drv.p_cuCtxGetCurrent || drv.p_cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr || !drv.p_cuStreamCreate)
    return nullptr;
  BurstStreams& b = burstStreams();
  std::lock_guard<std::mutex> g(b.mu);
  int free = -1;
  for (int i = 0; i < 8; ++i) {
    if (b.ctx[i] == ctx) return b.stream[i];
    if (b.ctx[i] == nullptr && free < 0) free = i;
  }
  if (free < 0) return nullptr;  // more than 8 contexts: no prefetch (populated on first touch)
  CUstream s = nullptr;
  if (drv.p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return nullptr;
  b.ctx[free] = ctx;
  b.stream[free] = s;
  b.ordinal[free] = ordinal;
  return s;
}
CUresult burstingAlloc(int ordinal, uint64_t guarantee, CUdeviceptr* dptr, size_t bytes, uint64_t charge) noexcept {
  ShimState& s = state();
  const int idx = s.devices[ordinal].ledgerIndex;
  const uint64_t limit = effectiveLimit(ordinal);
  const Charge c{idx, ChargeKind::kPointer, charge};
  if (s.ledger->tryReserve(idx, charge, guarantee < limit ? guarantee : limit)) {  // within its guarantee
    // Guaranteed memory: it may wait for other tenants' plain bursts like any.
    const CUresult r = allocOrWaitForReclaim(ordinal, charge, [&] { return realDriver().p_cuMemAlloc_v2(dptr, bytes); });
    if (r != CUDA_SUCCESS) {
      release(c);
      return r;
    }
    allocations().put(*dptr, c);
    return CUDA_SUCCESS;
  }
  if (!s.devices[ordinal].managedEvictable) {
    if (gBurstRefusals.fetch_add(1, std::memory_order_relaxed) < 8)
      logLine(LogLevel::kWarn,
              "tenant %s device %d (%s): allocation of %llu bytes above its guarantee refused: the driver cannot "
              "evict managed memory on this device (no concurrent managed access: Windows, WSL or a GPU older than "
              "Pascal), so the tenant cannot burst here (docs/memory-elasticity.md)",
              s.config.tenant.c_str(), ordinal, s.devices[ordinal].uuid, static_cast<unsigned long long>(bytes));
    logDenied(ordinal, charge, guarantee < limit ? guarantee : limit);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (CUresult r = reserve(ordinal, charge, /*evictable=*/true); r != CUDA_SUCCESS) return r;
  CUresult r = realDriver().p_cuMemAllocManaged(dptr, bytes, CU_MEM_ATTACH_GLOBAL);
  if (r != CUDA_SUCCESS) {
    release(c);
    if (r != CUDA_ERROR_OUT_OF_MEMORY && gBurstRefusals.fetch_add(1, std::memory_order_relaxed) < 8) {
      const char* name = nullptr;
      if (realDriver().p_cuGetErrorName) realDriver().p_cuGetErrorName(r, &name);
      logLine(LogLevel::kWarn,
              "tenant %s device %d (%s): allocation of %llu bytes above its guarantee refused: the driver would "
              "not make it managed memory (%s); above its guarantee a tenant gets only memory the device can "
              "evict (docs/memory-elasticity.md)",
              s.config.tenant.c_str(), ordinal, s.devices[ordinal].uuid, static_cast<unsigned long long>(bytes),
              name ? name : "error");
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // Resident at once where there is room, as ordinary memory would be (no fault on first touch).
  // On a stream of the shim's own, non-blocking: the legacy stream would join (and break) a
  // capture in progress on a blocking stream of another thread.
  if (realDriver().p_cuMemPrefetchAsync_v2)
    if (CUstream side = burstStream(ordinal); side != nullptr) {
      const CUmemLocation loc{CU_MEM_LOCATION_TYPE_DEVICE, ordinal};
      realDriver().p_cuMemPrefetchAsync_v2(*dptr, bytes, loc, 0, side);
    }
  allocations().put(*dptr, c);
  return CUDA_SUCCESS;
}

}  // namespace

// A context destroyed (ctx), or a device's primary context reset or released for the last time
// (ctx null, ordinal): its prefetch stream went with it. (A context of the device created apart
// from the primary one loses its entry too: it makes a new stream, the old one stays until the
// context goes.)
void burstForgetContexts(CUcontext ctx, int ordinal) noexcept {
  BurstStreams& b = burstStreams();
  std::lock_guard<std::mutex> g(b.mu);
  for (int i = 0; i < 8; ++i)
    if (b.ctx[i] != nullptr && (ctx != nullptr ? b.ctx[i] == ctx : b.ordinal[i] == ordinal))
      b.ctx[i] = nullptr, b.stream[i] = nullptr;
}

CUresult hook_cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) noexcept {
  if (!dptr || bytes == 0) return realDriver().p_cuMemAlloc_v2(dptr, bytes);
  if (CUresult r = devicesReady(); r != CUDA_SUCCESS) return r;
  int ordinal;
  if (CUresult r = currentOrdinal(&ordinal); r != CUDA_SUCCESS) return r;
  if (const uint64_t g = burstAbove(ordinal); g != kUnlimited)
    return burstingAlloc(ordinal, g, dptr, bytes, roundUp(bytes, kMinAllocation));
  uintptr_t key = 0;
  return chargedAllocOn(ordinal, roundUp(bytes, kMinAllocation), &key, [&] {
    CUresult r = realDriver().p_cuMemAlloc_v2(dptr, bytes);
    key = *dptr;
    return r;
  });
}

CUresult hook_cuMemAllocManaged(CUdeviceptr* dptr, size_t bytes, unsigned flags) noexcept {
  if (!dptr || bytes == 0) return realDriver().p_cuMemAllocManaged(dptr, bytes, flags);
  uintptr_t key = 0;
  // Managed memory the device can evict: up to the limit, above a bursting tenant's guarantee too.
  return chargedAlloc(roundUp(bytes, kMinAllocation), &key, [&] {
    CUresult r = realDriver().p_cuMemAllocManaged(dptr, bytes, flags);
    key = *dptr;
    return r;
  }, ChargeKind::kPointer, /*evictable=*/true);
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
  allocations().put(key, Charge{c.device, ChargeKind::kPointer, actual});
  return CUDA_SUCCESS;
}

// The first ABI's free (32-bit device pointer): counted like cuMemFree_v2.
CUresult hook_cuMemFree(unsigned int dptr) noexcept {
  bool uncharged = false;
  const CUresult r = chargedFree(dptr, [&] { return realDriver().p_cuMemFree(dptr); }, &uncharged);
  if (uncharged) settleAllPools();
  return r;
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
  const Charge c{state().devices[ordinal].ledgerIndex, ChargeKind::kPointer, size};
  const CUresult r = allocOrWaitForReclaim(ordinal, size, [&] { return d.p_cuMemCreate(handle, size, prop, flags); });
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
  // An imported handle is charged for what it maps, before the driver maps it.
  Charge extra{-1, ChargeKind::kPointer, 0};
  int ordinal = -1;
  if (vmm().imported.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> g(vmm().mu);
    auto it = vmm().handles.find(handle);
    if (it != vmm().handles.end() && it->second.importedOn >= 0) {
      ordinal = it->second.importedOn;
      extra = Charge{it->second.charge.device, ChargeKind::kPointer, size};
    }
  }
  if (ordinal >= 0)
    if (CUresult r = reserve(ordinal, size); r != CUDA_SUCCESS) return r;
  const CUresult r = realDriver().p_cuMemMap(ptr, size, offset, handle, flags);
  if (r != CUDA_SUCCESS) {
    if (extra.device >= 0) release(extra);
    return r;
  }
  std::lock_guard<std::mutex> g(vmm().mu);
  auto it = vmm().handles.find(handle);
  if (it != vmm().handles.end()) {
    ++it->second.maps;
    it->second.charge.bytes += extra.bytes;
    vmm().mappings[ptr] = {handle, size};
  } else if (extra.device >= 0) {
    release(extra);  // released meanwhile (a race the application made): nothing to hold it
  }
  return r;
}

CUresult hook_cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType type, unsigned long long flags) noexcept {
  const CUresult r = realDriver().p_cuMemExportToShareableHandle(shareable, handle, type, flags);
  if (r != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> g(vmm().mu);
  auto it = vmm().handles.find(handle);
  if (it != vmm().handles.end()) it->second.exported = true;
  return r;
}

CUresult hook_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* osHandle,
                                             CUmemAllocationHandleType type) noexcept {
  RealDriver& d = realDriver();
  const CUresult r = d.p_cuMemImportFromShareableHandle(handle, osHandle, type);
  if (r != CUDA_SUCCESS || !handle || devicesReady() != CUDA_SUCCESS) return r;
  CUmemAllocationProp prop = {};
  int ordinal = -1;
  if (d.p_cuMemGetAllocationPropertiesFromHandle &&
      d.p_cuMemGetAllocationPropertiesFromHandle(&prop, *handle) == CUDA_SUCCESS &&
      prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop.location.id >= 0 &&
      prop.location.id < state().deviceCount)
    ordinal = prop.location.id;
  if (ordinal < 0) {
    // Cannot tell which device holds it: refuse rather than map it uncounted.
    d.p_cuMemRelease(*handle);
    logLine(LogLevel::kError, "tenant %s: imported memory of unknown device refused", state().config.tenant.c_str());
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  std::lock_guard<std::mutex> g(vmm().mu);
  auto [it, fresh] = vmm().handles.try_emplace(*handle);
  if (!fresh) {
    ++it->second.refs;  // a driver that hands out the same handle again: one more reference
    return r;
  }
  it->second.charge = Charge{state().devices[ordinal].ledgerIndex, ChargeKind::kPointer, 0};
  it->second.importedOn = ordinal;
  vmm().imported.fetch_add(1, std::memory_order_release);
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
  CUDA_ARRAY3D_DESCRIPTOR d = {};
  d.Width = desc->Width;
  d.Height = desc->Height;
  d.Format = desc->Format;
  d.NumChannels = desc->NumChannels;
  uintptr_t key = 0;
  return chargedArray(d, 0, ChargeKind::kArray, &key, [&] {
    CUresult r = realDriver().p_cuArrayCreate_v2(array, desc);
    key = reinterpret_cast<uintptr_t>(*array);
    return r;
  });
}

CUresult hook_cuArray3DCreate_v2(CUarray* array, const CUDA_ARRAY3D_DESCRIPTOR* desc) noexcept {
  if (!array || !desc || reservesNothing(*desc)) return realDriver().p_cuArray3DCreate_v2(array, desc);
  uintptr_t key = 0;
  return chargedArray(*desc, 0, ChargeKind::kArray, &key, [&] {
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
  if (!array || !desc || levels == 0 || reservesNothing(*desc))
    return realDriver().p_cuMipmappedArrayCreate(array, desc, levels);
  uintptr_t key = 0;
  return chargedArray(*desc, levels, ChargeKind::kMipmappedArray, &key, [&] {
    CUresult r = realDriver().p_cuMipmappedArrayCreate(array, desc, levels);
    key = reinterpret_cast<uintptr_t>(*array);
    return r;
  });
}

CUresult hook_cuMipmappedArrayDestroy(CUmipmappedArray array) noexcept {
  return chargedFree(reinterpret_cast<uintptr_t>(array), [&] { return realDriver().p_cuMipmappedArrayDestroy(array); });
}

// ---- context teardown ----
namespace {
// Whether the driver still has what key names (after a context was destroyed or reset). Only a
// definite "no such thing" answer counts as gone: a failing query keeps the charge.
bool stillAllocated(uintptr_t key, ChargeKind kind) noexcept {
  RealDriver& d = realDriver();
  switch (kind) {
    case ChargeKind::kPointer: {
      CUdeviceptr base = 0;
      return !d.p_cuPointerGetAttribute ||
             d.p_cuPointerGetAttribute(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, key) != CUDA_ERROR_INVALID_VALUE;
    }
    case ChargeKind::kArray: {
      CUDA_ARRAY3D_DESCRIPTOR desc;
      return !d.p_cuArray3DGetDescriptor_v2 ||
             d.p_cuArray3DGetDescriptor_v2(&desc, reinterpret_cast<CUarray>(key)) != CUDA_ERROR_INVALID_HANDLE;
    }
    case ChargeKind::kMipmappedArray: {
      CUarray level;
      return !d.p_cuMipmappedArrayGetLevel ||
             d.p_cuMipmappedArrayGetLevel(&level, reinterpret_cast<CUmipmappedArray>(key), 0) != CUDA_ERROR_INVALID_HANDLE;
    }
  }
  return true;
}
}  // namespace

void settleFreedAllocations() noexcept {
  if (devicesReady() != CUDA_SUCCESS) return;
  std::vector<std::pair<uintptr_t, ChargeKind>> keys;
  allocations().forEach([&](uintptr_t key, const Charge& c) {
    try {
      keys.emplace_back(key, c.kind);
    } catch (...) {
      // No host memory: what is not listed stays charged (over-counted, never under).
    }
  });
  for (const auto& [key, kind] : keys) {
    if (stillAllocated(key, kind)) continue;
    Charge c;
    if (allocations().take(key, &c)) release(c);
  }
}

}  // namespace cushare::shim
