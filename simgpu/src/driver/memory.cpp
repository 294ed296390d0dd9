// Device, managed and page-locked host memory; the registry of every simulated memory range
// (what cuPointerGetAttribute, cuMemGetAddressRange and memcpy's default kind consult); and the
// host-wide accounting of device memory.
//
// Device memory is host memory of the allocating process (mmap'd, zero-filled, committed lazily),
// so kernels' host bodies and copies dereference device pointers directly. Each allocation is
// counted against its device in the shared state before the host memory is mapped, and returned
// when freed (or by whoever notices that the process died).
#include <sys/mman.h>

#include <cstring>

#include "driver.h"

namespace simgpu {
namespace {
struct Registry {
  std::shared_mutex mu;
  std::map<uintptr_t, Allocation> byBase;
};
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}
size_t roundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

void registryAdd(const Allocation& a) {
  std::unique_lock g(registry().mu);
  registry().byBase[a.base] = a;
}

bool registryRemove(uintptr_t base, Allocation* out) {
  std::unique_lock g(registry().mu);
  auto it = registry().byBase.find(base);
  if (it == registry().byBase.end()) return false;
  if (out) *out = it->second;
  registry().byBase.erase(it);
  return true;
}

bool registryFind(uintptr_t p, Allocation* out) {
  std::shared_lock g(registry().mu);
  auto& m = registry().byBase;
  auto it = m.upper_bound(p);
  if (it == m.begin()) return false;
  --it;
  const Allocation& a = it->second;
  // A zero-size range still owns its base address.
  if (p < a.base || (p >= a.base + a.size && !(a.size == 0 && p == a.base))) return false;
  if (out) *out = a;
  return true;
}

void registryForEach(const std::function<void(const Allocation&)>& f) {
  std::vector<Allocation> copy;
  {
    std::shared_lock g(registry().mu);
    for (auto& [b, a] : registry().byBase) copy.push_back(a);
  }
  for (auto& a : copy) f(a);
}

void* hostMap(size_t bytes, size_t* mapped, bool low32) {
  const size_t len = roundUp(bytes == 0 ? 1 : bytes, 4096);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (low32 ? MAP_32BIT : 0), -1, 0);
  if (p == MAP_FAILED) return nullptr;
  *mapped = len;
  return p;
}

void hostUnmap(void* p, size_t mapped) {
  if (p) munmap(p, mapped);
}

CUresult allocDevice(size_t bytes, MemKind kind, unsigned flags, CUdeviceptr* out, bool low32) {
  Context* c;
  CU_TRY(requireContext(&c));
  const uint64_t charged = kind == MemKind::kManaged ? 0 : roundUp(bytes, kAllocAlign);
  if (charged && !deviceReserve(c->device, charged)) return CUDA_ERROR_OUT_OF_MEMORY;
  size_t mapped = 0;
  void* p = hostMap(bytes, &mapped, low32);
  if (!p) {
    if (charged) deviceRelease(c->device, charged);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  Allocation a;
  a.base = reinterpret_cast<uintptr_t>(p);
  a.size = bytes;
  a.device = c->device;
  a.kind = kind;
  a.ctx = c;
  a.flags = flags;
  a.accounted = charged;
  a.mapping = p;
  a.mappingSize = mapped;
  a.id = nextId();
  if (kind == MemKind::kManaged) managedCreate(a.base, bytes);
  registryAdd(a);
  *out = a.base;
  return CUDA_SUCCESS;
}

CUresult freeDevice(CUdeviceptr p) {
  Allocation a;
  if (!registryFind(p, &a) || a.base != p || (a.kind != MemKind::kDevice && a.kind != MemKind::kManaged))
    return CUDA_ERROR_INVALID_VALUE;
  if (!registryRemove(p, &a)) return CUDA_ERROR_INVALID_VALUE;
  if (a.kind == MemKind::kManaged) managedDestroy(a.base);
  hostUnmap(a.mapping, a.mappingSize);
  if (a.accounted) deviceRelease(a.device, a.accounted);
  return CUDA_SUCCESS;
}

}  // namespace simgpu

using namespace simgpu;

CU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  API_ENTER(dptr, bytesize);
  if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  return allocDevice(bytesize, MemKind::kDevice, 0, dptr);
}

CU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pitch, size_t width, size_t height, unsigned int elem) {
  API_ENTER(dptr, pitch, width, height, elem);
  if (!dptr || !pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
    return CUDA_ERROR_INVALID_VALUE;
  const size_t p = roundUp(width, 512);  // texture pitch alignment of the device
  CU_TRY(allocDevice(p * height, MemKind::kDevice, 0, dptr));
  *pitch = p;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
  API_ENTER(dptr);
  if (dptr == 0) return CUDA_SUCCESS;
  Allocation a;
  // Like the real driver, freeing waits for work that may still use the memory.
  if (registryFind(dptr, &a) && a.ctx) contextSync(a.ctx);
  if (registryFind(dptr, &a) && a.kind == MemKind::kPool && a.base == dptr) {
    CU_TRY(poolFreeNow(dptr));
    poolsOnSync(a.device);
    return CUDA_SUCCESS;
  }
  if (a.kind == MemKind::kGraph && a.base == dptr) return graphMemFree(dptr) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  return freeDevice(dptr);
}

// The first ABIs (CUDA 2.x), which real drivers still export: 32-bit sizes and device pointers,
// so the memory is placed in the low 2 GiB of the address space. Counted like the current ones.
extern "C" SIMGPU_EXPORT CUresult simgpu_cuMemAlloc_v1(unsigned int* dptr, unsigned int bytesize) __asm__("cuMemAlloc");
CUresult simgpu_cuMemAlloc_v1(unsigned int* dptr, unsigned int bytesize) {
  API_ENTER(dptr, bytesize);
  if (!dptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr p;
  CU_TRY(allocDevice(bytesize, MemKind::kDevice, 0, &p, true));
  *dptr = static_cast<unsigned int>(p);
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuMemAllocPitch_v1(unsigned int* dptr, unsigned int* pitch, unsigned int width,
                                                          unsigned int height, unsigned int elem) __asm__("cuMemAllocPitch");
CUresult simgpu_cuMemAllocPitch_v1(unsigned int* dptr, unsigned int* pitch, unsigned int width, unsigned int height,
                                   unsigned int elem) {
  API_ENTER(dptr, pitch, width, height, elem);
  if (!dptr || !pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
    return CUDA_ERROR_INVALID_VALUE;
  const size_t p = roundUp(width, 512);
  CUdeviceptr d;
  CU_TRY(allocDevice(p * height, MemKind::kDevice, 0, &d, true));
  *dptr = static_cast<unsigned int>(d);
  *pitch = static_cast<unsigned int>(p);
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuMemFree_v1(unsigned int dptr) __asm__("cuMemFree");
CUresult simgpu_cuMemFree_v1(unsigned int dptr) { return cuMemFree_v2(dptr); }

CU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) {
  API_ENTER(dptr, bytesize, flags);
  if (!dptr || bytesize == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
    return CUDA_ERROR_INVALID_VALUE;
  // Not permitted while a stream captures in global mode (the allocation is not stream ordered).
  if (anyGlobalCaptureActive()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  // Takes device memory only once populated there (managed.cpp): nothing is charged now.
  return allocDevice(bytesize, MemKind::kManaged, flags, dptr);
}

CU_EXPORT CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
  API_ENTER(free, total);
  if (!free || !total) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  SharedState* s = drv().state;
  s->reap();
  const int host = hostDevice(c->device);
  const Driver::Mig& m = drv().mig;
  // Inside a MIG device: its GPU instance's memory and what that instance's processes hold.
  const uint64_t cap = m.on ? drv().cfg.memory[host] : s->capacity(host);
  const uint64_t used = m.on ? s->instanceUsed(host, m.gi) : s->used(host);
  *total = cap;
  *free = used >= cap ? 0 : cap - used;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr dptr) {
  API_ENTER(base, size, dptr);
  Allocation a;
  if (!registryFind(dptr, &a) || a.kind == MemKind::kHostRegistered || a.kind == MemKind::kHostPinned)
    return CUDA_ERROR_NOT_FOUND;
  if (base) *base = a.base;
  if (size) *size = a.size;
  return CUDA_SUCCESS;
}

// ---- page-locked host memory ----
namespace {
CUresult allocHost(void** pp, size_t bytes, unsigned flags) {
  if (!pp) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  size_t mapped = 0;
  void* p = hostMap(bytes, &mapped);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation a;
  a.base = reinterpret_cast<uintptr_t>(p);
  a.size = bytes;
  a.device = c->device;
  a.kind = MemKind::kHostPinned;
  a.ctx = c;
  a.flags = flags;
  a.mapping = p;
  a.mappingSize = mapped;
  a.id = nextId();
  registryAdd(a);
  *pp = p;
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuMemAllocHost_v2(void** pp, size_t bytesize) {
  API_ENTER(pp, bytesize);
  return allocHost(pp, bytesize, CU_MEMHOSTALLOC_DEVICEMAP);
}

CU_EXPORT CUresult cuMemHostAlloc(void** pp, size_t bytesize, unsigned int flags) {
  API_ENTER(pp, bytesize, flags);
  if (flags & ~0x7u) return CUDA_ERROR_INVALID_VALUE;
  return allocHost(pp, bytesize, flags | CU_MEMHOSTALLOC_DEVICEMAP);  // unified addressing maps all
}

CU_EXPORT CUresult cuMemFreeHost(void* p) {
  API_ENTER(p);
  Allocation a;
  if (!registryFind(reinterpret_cast<uintptr_t>(p), &a) || a.kind != MemKind::kHostPinned ||
      a.base != reinterpret_cast<uintptr_t>(p))
    return CUDA_ERROR_INVALID_VALUE;
  if (a.ctx) contextSync(a.ctx);  // queued copies may still use it, as cudaFreeHost assumes
  registryRemove(a.base, &a);
  hostUnmap(a.mapping, a.mappingSize);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemHostRegister_v2(void* p, size_t bytesize, unsigned int flags) {
  API_ENTER(p, bytesize, flags);
  if (!p || bytesize == 0 || (flags & ~0xfu)) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  const uintptr_t b = reinterpret_cast<uintptr_t>(p);
  Allocation existing;
  if (registryFind(b, &existing) || registryFind(b + bytesize - 1, &existing))
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  Allocation a;
  a.base = b;
  a.size = bytesize;
  a.device = c->device;
  a.kind = MemKind::kHostRegistered;
  a.ctx = c;
  a.flags = flags;
  a.id = nextId();
  registryAdd(a);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemHostUnregister(void* p) {
  API_ENTER(p);
  Allocation a;
  if (!registryFind(reinterpret_cast<uintptr_t>(p), &a) || a.kind != MemKind::kHostRegistered ||
      a.base != reinterpret_cast<uintptr_t>(p))
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  registryRemove(a.base, nullptr);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* pdptr, void* p, unsigned int flags) {
  API_ENTER(pdptr, p, flags);
  if (!pdptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Allocation a;
  if (!registryFind(reinterpret_cast<uintptr_t>(p), &a) ||
      (a.kind != MemKind::kHostPinned && a.kind != MemKind::kHostRegistered))
    return CUDA_ERROR_INVALID_VALUE;
  *pdptr = reinterpret_cast<CUdeviceptr>(p);  // unified addressing: the same address
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMemHostGetFlags(unsigned int* flags, void* p) {
  API_ENTER(flags, p);
  if (!flags) return CUDA_ERROR_INVALID_VALUE;
  Allocation a;
  if (!registryFind(reinterpret_cast<uintptr_t>(p), &a) ||
      (a.kind != MemKind::kHostPinned && a.kind != MemKind::kHostRegistered))
    return CUDA_ERROR_INVALID_VALUE;
  *flags = a.flags;
  return CUDA_SUCCESS;
}

// ---- pointer attributes ----
namespace {
CUresult pointerAttribute(void* data, CUpointer_attribute attr, CUdeviceptr ptr, bool* known) {
  Allocation a;
  *known = registryFind(ptr, &a);
  const bool isHost = *known && (a.kind == MemKind::kHostPinned || a.kind == MemKind::kHostRegistered);
  switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<CUcontext*>(data) = reinterpret_cast<CUcontext>(a.ctx);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<CUmemorytype*>(data) = isHost ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<CUdeviceptr*>(data) = ptr;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (!*known || (!isHost && a.kind != MemKind::kManaged)) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<void**>(data) = reinterpret_cast<void*>(ptr);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
      *static_cast<int*>(data) = 1;
      return *known ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<unsigned long long*>(data) = a.id;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = a.kind == MemKind::kManaged;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = a.device;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = a.kind == MemKind::kDevice;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<CUdeviceptr*>(data) = a.base;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<size_t*>(data) = a.size;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = 1;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<unsigned long long*>(data) =
          a.kind == MemKind::kVmm ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = 0;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<CUmemoryPool*>(data) = a.kind == MemKind::kPool ? static_cast<CUmemoryPool>(a.owner) : nullptr;
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
      if (!*known) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<int*>(data) = 0;
      return CUDA_SUCCESS;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}
}  // namespace

CU_EXPORT CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  API_ENTER(data, attribute, ptr);
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  bool known;
  return pointerAttribute(data, attribute, ptr, &known);
}

CU_EXPORT CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute* attrs, void** data, CUdeviceptr ptr) {
  API_ENTER(n, attrs, data, ptr);
  if (!attrs || !data) return CUDA_ERROR_INVALID_VALUE;
  // Unlike the single-attribute call, this one succeeds for memory the driver does not know:
  // memory type 0 (unregistered), null context, ordinal -2, as the real driver reports.
  for (unsigned i = 0; i < n; ++i) {
    if (!data[i]) continue;
    bool known;
    if (pointerAttribute(data[i], attrs[i], ptr, &known) == CUDA_SUCCESS) continue;
    // Not applicable to this pointer (e.g. the host pointer of device memory): default value.
    switch (attrs[i]) {
      case CU_POINTER_ATTRIBUTE_CONTEXT: *static_cast<CUcontext*>(data[i]) = nullptr; break;
      case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *static_cast<unsigned*>(data[i]) = 0; break;
      case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *static_cast<CUdeviceptr*>(data[i]) = 0; break;
      case CU_POINTER_ATTRIBUTE_HOST_POINTER: *static_cast<void**>(data[i]) = nullptr; break;
      case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data[i]) = known ? 0 : -2; break;
      case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: *static_cast<unsigned long long*>(data[i]) = 0; break;
      case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *static_cast<size_t*>(data[i]) = 0; break;
      case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: *static_cast<void**>(data[i]) = nullptr; break;
      default: *static_cast<int*>(data[i]) = 0; break;
    }
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuPointerSetAttribute(const void* value, CUpointer_attribute attribute, CUdeviceptr ptr) {
  API_ENTER(value, attribute, ptr);
  if (!registryFind(ptr, nullptr)) return CUDA_ERROR_INVALID_VALUE;
  return attribute == CU_POINTER_ATTRIBUTE_SYNC_MEMOPS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

