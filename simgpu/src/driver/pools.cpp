// Stream-ordered allocation and memory pools. A pool keeps freed blocks for reuse (they stay
// counted against the device, as on real hardware, where cudaMemGetInfo shows pool reservations)
// and gives memory above its release threshold back at synchronisation points and on trim.
// Blocks are reused only at exactly the same rounded size: simple, and never hands out a block
// larger than asked without saying so.
#include <algorithm>

#include "driver.h"

namespace simgpu {

struct Pool {
  int device = 0;
  bool isDefault = false;
  std::mutex mu;
  std::multimap<size_t, CUdeviceptr> freeBlocks;  // rounded size -> block
  uint64_t releaseThreshold = 0;
  uint64_t reserved = 0, used = 0, reservedHigh = 0, usedHigh = 0;
  int reuseFollowEvents = 1, reuseOpportunistic = 1, reuseInternal = 1;
};

namespace {
constexpr size_t kPoolGranularity = 512;

std::mutex& poolsMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::vector<Pool*>& allPools() {
  static auto* v = new std::vector<Pool*>;
  return *v;
}
Pool* gDefault[kMaxDevices];
Pool* gCurrent[kMaxDevices];

Pool* newPool(int dev, bool isDefault) {
  auto* p = new Pool;
  p->device = dev;
  p->isDefault = isDefault;
  handleAdd(p, HandleType::kMemPool);
  std::lock_guard g(poolsMutex());
  allPools().push_back(p);
  return p;
}

Pool* defaultPool(int dev) {
  std::unique_lock g(poolsMutex());
  if (!gDefault[dev]) {
    g.unlock();
    Pool* p = newPool(dev, true);
    g.lock();
    if (!gDefault[dev]) gDefault[dev] = p;
  }
  return gDefault[dev];
}

Pool* currentPool(int dev) {
  {
    std::lock_guard g(poolsMutex());
    if (gCurrent[dev]) return gCurrent[dev];
  }
  return defaultPool(dev);
}

// Caller holds p->mu. Releases free blocks until reserved <= keep.
void trimLocked(Pool* p, uint64_t keep) {
  for (auto it = p->freeBlocks.begin(); it != p->freeBlocks.end() && p->reserved > keep;) {
    Allocation a;
    if (registryRemove(it->second, &a)) {
      hostUnmap(a.mapping, a.mappingSize);
      deviceRelease(a.device, a.accounted);
      p->reserved -= a.accounted;
    }
    it = p->freeBlocks.erase(it);
  }
}

CUresult poolAlloc(Pool* p, size_t bytes, CUdeviceptr* out) {
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  const size_t rounded = (bytes + kPoolGranularity - 1) / kPoolGranularity * kPoolGranularity;
  std::lock_guard g(p->mu);
  auto it = p->freeBlocks.find(rounded);
  if (it != p->freeBlocks.end()) {
    *out = it->second;
    p->freeBlocks.erase(it);
  } else {
    if (!deviceReserve(p->device, rounded)) {
      trimLocked(p, 0);  // give back what this pool holds idle, then try once more
      if (!deviceReserve(p->device, rounded)) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t mapped;
    void* m = hostMap(rounded, &mapped);
    if (!m) {
      deviceRelease(p->device, rounded);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    Allocation a;
    a.base = reinterpret_cast<uintptr_t>(m);
    a.size = rounded;
    a.device = p->device;
    a.kind = MemKind::kPool;
    a.accounted = rounded;
    a.mapping = m;
    a.mappingSize = mapped;
    a.owner = p;
    a.id = nextId();
    registryAdd(a);
    p->reserved += rounded;
    p->reservedHigh = std::max(p->reservedHigh, p->reserved);
    *out = a.base;
  }
  p->used += rounded;
  p->usedHigh = std::max(p->usedHigh, p->used);
  return CUDA_SUCCESS;
}

CUresult poolFree(CUdeviceptr ptr) {
  Allocation a;
  if (!registryFind(ptr, &a) || a.base != ptr) return CUDA_ERROR_INVALID_VALUE;
  if (a.kind == MemKind::kGraph) return graphMemFree(ptr) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  if (a.kind == MemKind::kDevice || a.kind == MemKind::kManaged) return freeDevice(ptr);
  if (a.kind != MemKind::kPool) return CUDA_ERROR_INVALID_VALUE;
  auto* p = static_cast<Pool*>(a.owner);
  std::lock_guard g(p->mu);
  for (auto& [size, b] : p->freeBlocks)
    if (b == ptr) return CUDA_ERROR_INVALID_VALUE;  // double free
  p->used -= a.accounted;
  p->freeBlocks.emplace(a.accounted, ptr);
  return CUDA_SUCCESS;
}

Pool* poolOf(CUmemoryPool h) { return handleGet<Pool>(h, HandleType::kMemPool); }
}  // namespace

CUresult poolFreeNow(CUdeviceptr p) { return poolFree(p); }

void poolsOnSync(int device) {
  std::vector<Pool*> pools;
  {
    std::lock_guard g(poolsMutex());
    pools = allPools();
  }
  for (Pool* p : pools) {
    if (p->device != device) continue;
    std::lock_guard g(p->mu);
    trimLocked(p, p->releaseThreshold);
  }
}

}  // namespace simgpu

using namespace simgpu;

CU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream hs) {
  API_ENTER(dptr, bytesize, hs);
  if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return captureAlloc(s, bytesize, dptr);
  return poolAlloc(currentPool(s->ctx->device), bytesize, dptr);
}

CU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool, CUstream hs) {
  API_ENTER(dptr, bytesize, pool, hs);
  if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  Pool* p = poolOf(pool);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return captureAlloc(s, bytesize, dptr);
  return poolAlloc(p, bytesize, dptr);
}

CU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hs) {
  API_ENTER(dptr, hs);
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return captureFree(s, dptr);
  Allocation a;
  if (!registryFind(dptr, &a) || a.base != dptr) return CUDA_ERROR_INVALID_VALUE;
  // Stream-ordered: the block becomes reusable when the stream reaches this point.
  Op op;
  op.type = Op::kMemFree;
  op.run = [dptr] { return poolFree(dptr); };
  return submit(s, std::move(op));
}

CU_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* out, CUdevice dev) {
  API_ENTER(out, dev);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *out = reinterpret_cast<CUmemoryPool>(defaultPool(dev));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool* out, CUdevice dev) {
  API_ENTER(out, dev);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *out = reinterpret_cast<CUmemoryPool>(currentPool(dev));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  API_ENTER(dev, pool);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Pool* p = poolOf(pool);
  if (!p || p->device != dev) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(poolsMutex());
  gCurrent[dev] = p;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolCreate(CUmemoryPool* out, const CUmemPoolProps* props) {
  API_ENTER(out, props);
  if (!out || !props) return CUDA_ERROR_INVALID_VALUE;
  if (props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (!validDevice(props->location.id)) return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<CUmemoryPool>(newPool(props->location.id, false));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  API_ENTER(pool);
  Pool* p = poolOf(pool);
  if (!p || p->isDefault) return CUDA_ERROR_INVALID_VALUE;
  {
    std::lock_guard g(p->mu);
    trimLocked(p, 0);
  }
  handleRemove(p);
  std::lock_guard g(poolsMutex());
  auto& v = allPools();
  v.erase(std::remove(v.begin(), v.end(), p), v.end());
  for (auto& c : gCurrent)
    if (c == p) c = nullptr;
  // Leaked: blocks still in use keep pointing at it; their frees are accepted.
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
  API_ENTER(pool, keep);
  Pool* p = poolOf(pool);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(p->mu);
  trimLocked(p, keep);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  API_ENTER(pool, attr, value);
  Pool* p = poolOf(pool);
  if (!p || !value) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(p->mu);
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: p->reuseFollowEvents = *static_cast<int*>(value); break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: p->reuseOpportunistic = *static_cast<int*>(value); break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: p->reuseInternal = *static_cast<int*>(value); break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: p->releaseThreshold = *static_cast<cuuint64_t*>(value); break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      p->reservedHigh = p->reserved;
      break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      p->usedHigh = p->used;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  API_ENTER(pool, attr, value);
  Pool* p = poolOf(pool);
  if (!p || !value) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(p->mu);
  auto u64 = static_cast<cuuint64_t*>(value);
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: *static_cast<int*>(value) = p->reuseFollowEvents; break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: *static_cast<int*>(value) = p->reuseOpportunistic; break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *static_cast<int*>(value) = p->reuseInternal; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *u64 = p->releaseThreshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *u64 = p->reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *u64 = p->reservedHigh; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *u64 = p->used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *u64 = p->usedHigh; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc* map, size_t count) {
  API_ENTER(pool, map, count);
  if (!poolOf(pool) || (count && !map)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemPoolGetAccess(CUmemAccess_flags* flags, CUmemoryPool pool, CUmemLocation* loc) {
  API_ENTER(flags, pool, loc);
  if (!poolOf(pool) || !flags || !loc) return CUDA_ERROR_INVALID_VALUE;
  *flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return CUDA_SUCCESS;
}
