// Virtual memory management: physical allocations (cuMemCreate) are memfd-backed, address
// reservations are PROT_NONE mappings, cuMemMap maps the memfd into a reservation and
// cuMemSetAccess opens it, so aliasing and unmapping behave as on a real device. Physical memory
// is counted against its device from cuMemCreate until it is both released and unmapped, and,
// when it was made exportable as a POSIX file descriptor, for as long as any handle or exported
// descriptor refers to it in any process, as a real driver keeps it: such memory lives in a
// shared entry of the device state with a backing file instead of a memfd (shared_state.h),
// each handle and each exported descriptor an open file description of it with a read lock.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "driver.h"
#include "mps_client.h"

namespace simgpu {
namespace {

struct VmmHandle {
  int fd = -1;
  size_t size = 0;
  int device = 0;
  uint64_t accounted = 0;  // this process's count; 0 for shareable memory (counted in its entry)
  uint64_t sharedId = 0;   // shareable memory's entry, or 0
  uint64_t mpsCharged = 0;  // shareable memory this process made, against its MPS pinned limit
  int refs = 1;            // cuMemCreate / import / retain; cuMemRelease drops one
  int maps = 0;
  CUmemAllocationProp prop = {};
};

struct Reservation {
  uintptr_t base;
  size_t size;
};

std::mutex& vmmMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::map<uintptr_t, Reservation>& reservations() {
  static auto* r = new std::map<uintptr_t, Reservation>;
  return *r;
}

// Caller holds vmmMutex().
void maybeFree(VmmHandle* h) {
  if (h->refs > 0 || h->maps > 0) return;
  close(h->fd);  // drops this handle's lock on shareable memory
  if (h->accounted) deviceRelease(h->device, h->accounted);
  if (h->sharedId) drv().state->reapShared(h->sharedId);  // gone unless an exported descriptor lives
  if (h->mpsCharged) mpsRelease(h->device, h->mpsCharged);
  handleRemove(h);
  delete h;
}

bool inReservation(uintptr_t p, size_t size) {
  auto& r = reservations();
  auto it = r.upper_bound(p);
  if (it == r.begin()) return false;
  --it;
  return p >= it->second.base && p + size <= it->second.base + it->second.size;
}

VmmHandle* handleOf(CUmemGenericAllocationHandle h) {
  return handleGet<VmmHandle>(reinterpret_cast<void*>(h), HandleType::kVmmHandle);
}

}  // namespace
}  // namespace simgpu

using namespace simgpu;

CU_EXPORT CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop,
                                                 CUmemAllocationGranularity_flags option) {
  API_ENTER(g, prop, option);
  if (!g || !prop) return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && !validDevice(prop->location.id))
    return CUDA_ERROR_INVALID_DEVICE;
  *g = kVmmGranularity;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
                               unsigned long long flags) {
  API_ENTER(out, size, prop, flags);
  if (!out || !prop || size == 0 || size % kVmmGranularity || flags) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (!validDevice(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
  auto* h = new VmmHandle;
  if (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    // Counted in a shared entry rather than through deviceReserve: the MPS limit is checked here.
    if (!mpsReserve(prop->location.id, size)) {
      delete h;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->fd = drv().state->reserveShared(hostDevice(prop->location.id), size, &h->sharedId);
    if (h->fd < 0) {
      mpsRelease(prop->location.id, size);
      delete h;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->mpsCharged = size;
  } else {
    if (!deviceReserve(prop->location.id, size)) {
      delete h;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->fd = memfd_create("simgpu-vmm", MFD_CLOEXEC);
    if (h->fd < 0 || ftruncate(h->fd, static_cast<off_t>(size)) != 0) {
      if (h->fd >= 0) close(h->fd);
      deviceRelease(prop->location.id, size);
      delete h;
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->accounted = size;
  }
  h->size = size;
  h->device = prop->location.id;
  h->prop = *prop;
  handleAdd(h, HandleType::kVmmHandle);
  *out = reinterpret_cast<CUmemGenericAllocationHandle>(h);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  API_ENTER(handle);
  std::lock_guard g(vmmMutex());
  VmmHandle* h = handleOf(handle);
  if (!h || h->refs <= 0) return CUDA_ERROR_INVALID_VALUE;
  --h->refs;
  maybeFree(h);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                       unsigned long long flags) {
  API_ENTER(ptr, size, alignment, addr, flags);
  if (!ptr || size == 0 || size % kVmmGranularity || (alignment & (alignment - 1))) return CUDA_ERROR_INVALID_VALUE;
  const size_t align = std::max<size_t>(alignment, kVmmGranularity);
  // Over-reserve to align, then trim the ends. `addr` is a hint, as in the real driver.
  const size_t len = size + align;
  void* hint = reinterpret_cast<void*>(addr);
  char* raw = static_cast<char*>(mmap(hint, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const uintptr_t base = (reinterpret_cast<uintptr_t>(raw) + align - 1) / align * align;
  if (base > reinterpret_cast<uintptr_t>(raw)) munmap(raw, base - reinterpret_cast<uintptr_t>(raw));
  const uintptr_t end = reinterpret_cast<uintptr_t>(raw) + len;
  if (end > base + size) munmap(reinterpret_cast<void*>(base + size), end - (base + size));
  std::lock_guard g(vmmMutex());
  reservations()[base] = Reservation{base, size};
  *ptr = base;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  API_ENTER(ptr, size);
  std::lock_guard g(vmmMutex());
  auto it = reservations().find(ptr);
  if (it == reservations().end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  // Mapped ranges inside must be unmapped first.
  Allocation a;
  for (uintptr_t p = ptr; p < ptr + size; p += kVmmGranularity)
    if (registryFind(p, &a) && a.kind == MemKind::kVmm) return CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(ptr), size);
  reservations().erase(it);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags) {
  API_ENTER(ptr, size, offset, handle, flags);
  std::lock_guard g(vmmMutex());
  VmmHandle* h = handleOf(handle);
  if (!h || flags || size == 0 || size % kVmmGranularity || offset % kVmmGranularity || offset + size > h->size)
    return CUDA_ERROR_INVALID_VALUE;
  if (!inReservation(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  Allocation existing;
  if (registryFind(ptr, &existing) || registryFind(ptr + size - 1, &existing)) return CUDA_ERROR_ALREADY_MAPPED;
  void* m = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, static_cast<off_t>(offset));
  if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation a;
  a.base = ptr;
  a.size = size;
  a.device = h->device;
  a.kind = MemKind::kVmm;
  a.ctx = currentContext();
  a.owner = h;
  a.id = nextId();
  registryAdd(a);
  ++h->maps;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  API_ENTER(ptr, size);
  std::lock_guard g(vmmMutex());
  if (!inReservation(ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  std::vector<Allocation> maps;
  registryForEach([&](const Allocation& a) {
    if (a.kind == MemKind::kVmm && a.base >= ptr && a.base < ptr + size) maps.push_back(a);
  });
  for (const Allocation& a : maps) {
    if (a.base + a.size > ptr + size) return CUDA_ERROR_INVALID_VALUE;  // would split a mapping
  }
  for (const Allocation& a : maps) {
    registryRemove(a.base, nullptr);
    mmap(reinterpret_cast<void*>(a.base), a.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    auto* h = static_cast<VmmHandle*>(a.owner);
    --h->maps;
    maybeFree(h);
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  API_ENTER(ptr, size, desc, count);
  if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || !validDevice(desc[i].location.id))
      return CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE) prot = PROT_READ;
  }
  std::lock_guard g(vmmMutex());
  // Every byte of the range must be mapped.
  for (uintptr_t p = ptr; p < ptr + size;) {
    Allocation a;
    if (!registryFind(p, &a) || a.kind != MemKind::kVmm) return CUDA_ERROR_INVALID_VALUE;
    p = a.base + a.size;
  }
  if (mprotect(reinterpret_cast<void*>(ptr), size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemGetAccess(unsigned long long* flags, const CUmemLocation* loc, CUdeviceptr ptr) {
  API_ENTER(flags, loc, ptr);
  if (!flags || !loc) return CUDA_ERROR_INVALID_VALUE;
  Allocation a;
  if (!registryFind(ptr, &a) || a.kind != MemKind::kVmm) return CUDA_ERROR_INVALID_VALUE;
  *flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* out, void* addr) {
  API_ENTER(out, addr);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(vmmMutex());
  Allocation a;
  if (!registryFind(reinterpret_cast<uintptr_t>(addr), &a) || a.kind != MemKind::kVmm) return CUDA_ERROR_INVALID_VALUE;
  auto* h = static_cast<VmmHandle*>(a.owner);
  ++h->refs;
  *out = reinterpret_cast<CUmemGenericAllocationHandle>(h);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop, CUmemGenericAllocationHandle handle) {
  API_ENTER(prop, handle);
  std::lock_guard g(vmmMutex());
  VmmHandle* h = handleOf(handle);
  if (!h || !prop) return CUDA_ERROR_INVALID_VALUE;
  *prop = h->prop;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle handle,
                                                CUmemAllocationHandleType type, unsigned long long flags) {
  API_ENTER(out, handle, type, flags);
  std::lock_guard g(vmmMutex());
  VmmHandle* h = handleOf(handle);
  if (!h || !out || flags) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      !(h->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return CUDA_ERROR_NOT_SUPPORTED;
  // A descriptor of its own (a new open file description with its own read lock): the memory
  // lives while it or any duplicate of it is open, wherever it was sent.
  uint64_t id;
  int dev;
  const int fd = drv().state->openShared(h->fd, &id, &dev);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* out, void* osHandle,
                                                  CUmemAllocationHandleType type) {
  API_ENTER(out, osHandle, type);
  if (!out || type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  const int src = static_cast<int>(reinterpret_cast<intptr_t>(osHandle));
  uint64_t id;
  int dev;
  const int fd = drv().state->openShared(src, &id, &dev);  // its own lock keeps the memory alive
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  int ordinal = -1;  // the host device's ordinal in this process, which may not see it
  for (int i = 0; i < deviceCount() && ordinal < 0; ++i)
    if (hostDevice(i) == dev) ordinal = i;
  if (ordinal < 0) {
    close(fd);
    return CUDA_ERROR_INVALID_DEVICE;
  }
  dev = ordinal;
  const off_t size = lseek(fd, 0, SEEK_END);
  if (size <= 0) {
    close(fd);
    return CUDA_ERROR_INVALID_VALUE;
  }
  auto* h = new VmmHandle;
  h->fd = fd;
  h->size = static_cast<size_t>(size);
  h->device = dev;
  h->sharedId = id;
  h->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  h->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  h->prop.location.id = dev;
  h->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  handleAdd(h, HandleType::kVmmHandle);
  *out = reinterpret_cast<CUmemGenericAllocationHandle>(h);
  return CUDA_SUCCESS;
}
