// Stream-ordered allocation through memory pools. What a pool holds on the device is its reserved
// memory: blocks in use plus freed blocks it keeps for reuse until a synchronisation point or a
// trim releases them (above its release threshold). The shim charges each pool's reserved memory,
// not the allocations in it:
//  - before an allocation it reserves the request (the pool grows by at most about that much),
//    lets the driver allocate, then settles the pool's charge to its RESERVED_MEM_CURRENT; if the
//    pool grew past the limit (a driver growing in large chunks), the allocation is freed, the
//    pool trimmed back and the call denied;
//  - a free changes nothing at once (the pool still holds the memory); after every
//    synchronisation call and trim the shim reads each pool again and returns what it released.
// So cached pool memory counts, and a tenant cannot hold more device memory than its limit by
// freeing into a pool and allocating elsewhere. A pool's memory is charged to the pool's own
// device (recorded when cuMemPoolCreate made it; a device's default and current pools are that
// device's), whichever context is current and whichever stream allocates.
#include <mutex>
#include <unordered_map>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "policy/reclaim_wait.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {

namespace {

struct PoolCharge {
  int ordinal = -1;
  uint64_t charged = 0;
};

struct PoolState {
  std::mutex mu;  // process-local; held across the driver's allocation so settlements are exact
  std::unordered_map<CUmemoryPool, PoolCharge> pools;
  std::atomic<int> count{0};
};
PoolState& pools() {
  static PoolState* p = new PoolState;
  return *p;
}

uint64_t reservedOf(CUmemoryPool pool) noexcept {
  cuuint64_t v = 0;
  if (!realDriver().p_cuMemPoolGetAttribute ||
      realDriver().p_cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
    return 0;
  return v;
}

// Caller holds pools().mu: sets the pool's charge to what it reserves now.
void settleLocked(CUmemoryPool pool, PoolCharge& c) noexcept {
  if (c.ordinal < 0) return;  // a pool of host memory
  const uint64_t now = reservedOf(pool);
  const int idx = state().devices[c.ordinal].ledgerIndex;
  if (now > c.charged)
    state().ledger->reserve(idx, now - c.charged, kUnlimited);  // growth already covered (see below)
  else if (now < c.charged)
    state().ledger->release(idx, c.charged - now);
  c.charged = now;
}

}  // namespace

void settleAllPools() noexcept {
  if (pools().count.load(std::memory_order_acquire) == 0 || devicesReady() != CUDA_SUCCESS) return;
  std::lock_guard<std::mutex> g(pools().mu);
  for (auto& [pool, c] : pools().pools) settleLocked(pool, c);
}

// Caller holds pools().mu. The pool's entry, made on its first use: its device is the one it was
// made for (cuMemPoolCreate; -1 for a pool of host memory), else `known` (the device whose current
// pool it was found as), else a device whose default or current pool it is. Null for a pool the
// shim cannot place: refused rather than charged to the wrong device.
PoolCharge* entryLocked(CUmemoryPool pool, int known) noexcept {
  auto it = pools().pools.find(pool);
  if (it != pools().pools.end()) return &it->second;
  RealDriver& d = realDriver();
  for (int dev = 0; dev < state().deviceCount && known < 0; ++dev) {
    CUmemoryPool p = nullptr;
    if ((d.p_cuDeviceGetMemPool && d.p_cuDeviceGetMemPool(&p, dev) == CUDA_SUCCESS && p == pool) ||
        (d.p_cuDeviceGetDefaultMemPool && d.p_cuDeviceGetDefaultMemPool(&p, dev) == CUDA_SUCCESS && p == pool))
      known = dev;
  }
  if (known < 0) return nullptr;
  pools().count.fetch_add(1, std::memory_order_release);
  return &pools().pools.try_emplace(pool, PoolCharge{known, 0}).first->second;
}

// A stream-ordered allocation from `pool` (`known`: its device, if the caller knows it, else -1);
// *ordinal receives the pool's device.
template <typename Alloc>
CUresult poolAllocate(CUmemoryPool pool, int known, uint64_t bytes, Alloc&& alloc, int* ordinal) noexcept {
  std::unique_lock<std::mutex> g(pools().mu);
  PoolCharge* entry = entryLocked(pool, known);
  if (!entry) {
    logLine(LogLevel::kError, "tenant %s: a stream-ordered allocation from a memory pool of unknown device is refused",
            state().config.tenant.c_str());
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  PoolCharge& c = *entry;
  *ordinal = c.ordinal;
  if (c.ordinal < 0) return alloc(pool);  // host memory
  settleLocked(pool, c);
  const int idx = state().devices[c.ordinal].ledgerIndex;
  // Room for the pool to grow by the request. Without it, the allocation may still fit in what
  // the pool already caches: let the driver try, and judge by how much the pool grew.
  const bool covered = state().ledger->reserve(idx, bytes, plainLimit(c.ordinal));
  CUresult r = alloc(pool);
  PoolCharge* now = &c;
  if (r == CUDA_ERROR_OUT_OF_MEMORY && covered) {
    // Within what the tenant may hold, the device is full: wait for other tenants' plain bursts
    // like the other roads, the reservation held (it is what the wait is believed up to), the
    // pools' lock released between tries and taken for each, and kept after one that did not run
    // out of memory, so that its growth is settled here before anyone else sees it.
    const int dev = c.ordinal;
    g.unlock();
    r = waitForReclaimAndRetry(dev, bytes, r, [&] {
      g.lock();
      const CUresult rr = alloc(pool);
      if (rr == CUDA_ERROR_OUT_OF_MEMORY) g.unlock();
      return rr;
    });
    if (!g.owns_lock()) g.lock();
    // The pool may have been destroyed meanwhile (its entry with it): look it up again.
    const auto it = pools().pools.find(pool);
    now = it == pools().pools.end() ? nullptr : &it->second;
    if (now == nullptr) {
      if (covered) state().ledger->release(idx, bytes);
      return r == CUDA_SUCCESS ? CUDA_ERROR_INVALID_VALUE : r;
    }
  }
  if (covered) state().ledger->release(idx, bytes);
  if (r != CUDA_SUCCESS) return r;
  PoolCharge& cur = *now;
  const uint64_t before = cur.charged;
  settleLocked(pool, cur);
  const uint64_t grew = cur.charged > before ? cur.charged - before : 0;
  if ((!covered && grew > 0) || state().ledger->used(idx) > plainLimit(cur.ordinal)) {
    return CUDA_ERROR_OUT_OF_MEMORY;  // caller frees the allocation and trims (see undo)
  }
  return CUDA_SUCCESS;
}

CUresult poolAllocCurrent(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream s, bool perThread) noexcept {
  if (CUresult r = devicesReady(); r != CUDA_SUCCESS) return r;
  RealDriver& d = realDriver();
  auto allocate = [&](CUmemoryPool) {
    if (pool) return perThread ? d.p_cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, s)
                               : d.p_cuMemAllocFromPoolAsync(dptr, bytes, pool, s);
    return perThread ? d.p_cuMemAllocAsync_ptsz(dptr, bytes, s) : d.p_cuMemAllocAsync(dptr, bytes, s);
  };
  CUmemoryPool used = pool;
  CUdevice known = -1;
  if (!pool) {
    // cuMemAllocAsync: the current pool of the stream's device.
    if (!d.p_cuStreamGetDevice || d.p_cuStreamGetDevice(s, &known) != CUDA_SUCCESS)
      if (CUresult r = d.p_cuCtxGetDevice(&known); r != CUDA_SUCCESS) return r;
    if (known < 0 || known >= state().deviceCount) return CUDA_ERROR_INVALID_DEVICE;
    if (!d.p_cuDeviceGetMemPool || d.p_cuDeviceGetMemPool(&used, known) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
  }
  int dev = -1;
  if (dptr) *dptr = 0;  // so that a refusal of the driver's own is never taken for one to undo
  const CUresult r = poolAllocate(used, known, bytes, allocate, &dev);
  if (r == CUDA_ERROR_OUT_OF_MEMORY && *dptr && dev >= 0) {
    // The pool grew past the limit: undo the allocation and give the growth back.
    (perThread ? d.p_cuMemFreeAsync_ptsz : d.p_cuMemFreeAsync)(*dptr, s);
    (perThread ? d.p_cuStreamSynchronize_ptsz : d.p_cuStreamSynchronize)(s);
    d.p_cuMemPoolTrimTo(used, 0);
    settleAllPools();
    *dptr = 0;
    logLine(LogLevel::kError, "tenant %s device %d: stream-ordered allocation of %llu bytes denied: the pool would hold more than the limit of %llu bytes",
            state().config.tenant.c_str(), static_cast<int>(dev), static_cast<unsigned long long>(bytes),
            static_cast<unsigned long long>(effectiveLimit(dev)));
    logStackRateLimited(LogLevel::kError);
  }
  return r;
}

// Synchronisation points: pools release memory above their threshold there.
CUresult hook_cuStreamSynchronize(CUstream s) noexcept {
  const CUresult r = realDriver().p_cuStreamSynchronize(s);
  settleAllPools();
  return r;
}
CUresult hook_cuStreamSynchronize_ptsz(CUstream s) noexcept {
  const CUresult r = realDriver().p_cuStreamSynchronize_ptsz(s);
  settleAllPools();
  return r;
}
CUresult hook_cuCtxSynchronize() noexcept {
  const CUresult r = realDriver().p_cuCtxSynchronize();
  settleAllPools();
  return r;
}
CUresult hook_cuCtxSynchronize_v2(CUcontext ctx) noexcept {
  const CUresult r = realDriver().p_cuCtxSynchronize_v2(ctx);
  settleAllPools();
  return r;
}
CUresult hook_cuEventSynchronize(CUevent e) noexcept {
  const CUresult r = realDriver().p_cuEventSynchronize(e);
  settleAllPools();
  return r;
}
CUresult hook_cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) noexcept {
  const CUresult r = realDriver().p_cuMemPoolTrimTo(pool, keep);
  settleAllPools();
  return r;
}
CUresult hook_cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) noexcept {
  const CUresult r = realDriver().p_cuMemPoolCreate(pool, props);
  if (r != CUDA_SUCCESS || !pool || !props || devicesReady() != CUDA_SUCCESS) return r;
  const bool device = props->location.type == CU_MEM_LOCATION_TYPE_DEVICE && props->location.id >= 0 &&
                      props->location.id < state().deviceCount;
  std::lock_guard<std::mutex> g(pools().mu);
  auto [it, fresh] = pools().pools.insert_or_assign(*pool, PoolCharge{device ? props->location.id : -1, 0});
  (void)it;
  if (fresh) pools().count.fetch_add(1, std::memory_order_release);
  return r;
}

CUresult hook_cuMemPoolDestroy(CUmemoryPool pool) noexcept {
  const CUresult r = realDriver().p_cuMemPoolDestroy(pool);
  if (r != CUDA_SUCCESS || devicesReady() != CUDA_SUCCESS) return r;
  std::lock_guard<std::mutex> g(pools().mu);
  auto it = pools().pools.find(pool);
  if (it != pools().pools.end()) {
    if (it->second.ordinal >= 0) state().ledger->release(state().devices[it->second.ordinal].ledgerIndex, it->second.charged);
    pools().pools.erase(it);
  }
  return r;
}

}  // namespace cushare::shim
