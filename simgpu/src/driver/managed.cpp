// Managed (unified) memory: where its pages are, and what that costs the device.
//
// Model (docs/simgpu.md, "Managed memory"; the facts are cuda.h's and the UVM driver's):
// - An allocation is split into 2 MiB chunks (UVM's root chunks). A chunk takes device memory only
//   while resident on a device: cuMemAllocManaged charges nothing; a kernel launch whose arguments
//   point into the allocation (the touch), or cuMemPrefetchAsync to a device, populates its chunks
//   there; a prefetch to the host sends them back and frees the device memory.
// - A chunk that finds the device full evicts other resident managed chunks to the host (any
//   process sharing the memory, least recently migrated in first); an ordinary allocation does too
//   (shared_state.cpp). Nothing evicts device memory from cuMemAlloc, pools, VMM or arrays. A chunk
//   that finds no room even then stays on the host (accessed remotely, as the driver maps it).
// - The data never moves: the simulated device memory is host memory of the process, so a
//   migration only changes where the bytes are counted, and a tenant's data is intact whatever was
//   evicted.
// - Advice is kept per chunk. A preferred location on the host keeps touches from populating
//   (the driver maps such pages remotely); read-mostly and accessed-by are recorded and reported.
// - A launch's touch costs device time: the kernel starts SIMGPU_FAULT_US (default 200 us, a guess)
//   per chunk it populated later than it would have (the faults' migrations), so tenants whose
//   working sets evict each other's slow down as on a GPU that thrashes.
// - Not modelled: host touches (a CPU access does not send chunks back), the timing of prefetches
//   and evictions (a prefetch completes at the call), the driver's thrashing heuristics, and chunks
//   shared by small allocations (each allocation has its own, charged by its size rounded to 256
//   bytes).
#include <algorithm>
#include <cstring>

#include "driver.h"

namespace simgpu {
namespace {

constexpr uint64_t kChunk = 2ull << 20;
constexpr int kHost = -1;  // CU_DEVICE_CPU

struct Place {  // a location as advice and prefetch name it; type 0: none
  int type = 0;
  int id = 0;
  bool operator==(const Place& o) const { return type == o.type && id == o.id; }  // hosts: id 0
};

struct Chunk {
  int residentOn = kHost;  // host device index, or kHost
  uint64_t seq = 0;        // migration sequence while resident
  Place preferred, lastPrefetch;
  bool readMostly = false;
  uint32_t accessedBy = 0;  // bit d: device ordinal d; bit 31: the host
};

struct Range {
  uintptr_t base = 0;
  uint64_t size = 0;
  std::vector<Chunk> chunks;
  uint64_t chunkBytes(size_t i) const {
    const uint64_t len = std::min(kChunk, size - i * kChunk);
    return (len + kAllocAlign - 1) / kAllocAlign * kAllocAlign;
  }
};

struct Table {
  std::mutex mu;  // one managed operation of the process at a time (the shared state's owner)
  std::map<uintptr_t, Range> ranges;
  int pid = 0;  // a forked child inherits the table, not the residency: it starts afresh
};
Table& table() {
  static Table* t = new Table;  // leaked: frees can come during exit
  return *t;
}
std::atomic<int> gRanges{0};

// The callbacks the shared state calls for host device dev, under its lock (the table's held).
SharedState::ManagedOwner ownerFor(Table& t, int dev) {
  SharedState::ManagedOwner o;
  o.dropOldest = [&t, dev](uint64_t bytes) {
    std::vector<std::pair<uint64_t, std::pair<Range*, size_t>>> resident;
    for (auto& [b, r] : t.ranges)
      for (size_t i = 0; i < r.chunks.size(); ++i)
        if (r.chunks[i].residentOn == dev) resident.push_back({r.chunks[i].seq, {&r, i}});
    std::sort(resident.begin(), resident.end(), [](auto& a, auto& b) { return a.first < b.first; });
    uint64_t gone = 0;
    for (auto& [seq, where] : resident) {
      if (gone >= bytes) break;
      where.first->chunks[where.second].residentOn = kHost;
      gone += where.first->chunkBytes(where.second);
    }
    return gone;
  };
  o.oldest = [&t, dev] {
    uint64_t m = UINT64_MAX;
    for (auto& [b, r] : t.ranges)
      for (const Chunk& c : r.chunks)
        if (c.residentOn == dev) m = std::min(m, c.seq);
    return m;
  };
  return o;
}

void checkFork(Table& t) {
  if (t.pid == getpid()) return;
  t.pid = getpid();
  for (auto& [b, r] : t.ranges)
    for (Chunk& c : r.chunks) c.residentOn = kHost;
}

// The range holding [p, p + count); null if none holds all of it.
Range* findRange(Table& t, uintptr_t p, size_t count) {
  auto it = t.ranges.upper_bound(p);
  if (it == t.ranges.begin()) return nullptr;
  --it;
  Range& r = it->second;
  if (p < r.base || p - r.base >= r.size || count > r.size - (p - r.base)) return nullptr;
  return &r;
}

// Chunks [first, last] of r that [p, p + count) covers.
void chunkSpan(const Range& r, uintptr_t p, size_t count, size_t* first, size_t* last) {
  const uint64_t off = p - r.base;
  *first = off / kChunk;
  *last = (off + (count ? count : 1) - 1) / kChunk;
}

// Populates chunk i of r on host device dev (table locked); false if it found no room.
bool populate(Table& t, Range& r, size_t i, int dev) {
  Chunk& c = r.chunks[i];
  if (c.residentOn == dev) return true;
  SharedState* s = drv().state;
  const SharedState::ManagedOwner owner = ownerFor(t, dev);
  if (c.residentOn != kHost) {  // resident on another device: it leaves that one first
    const int from = c.residentOn;
    s->dropResident(from, ownerFor(t, from), [&] {
      if (c.residentOn != from) return uint64_t{0};  // the settle already sent it away
      c.residentOn = kHost;
      return r.chunkBytes(i);
    });
  }
  uint64_t seq = 0;
  if (!s->makeResident(dev, r.chunkBytes(i), owner, &seq)) return false;
  c.residentOn = dev;
  c.seq = seq;
  return true;
}

void sendToHost(Table& t, Range& r, size_t first, size_t last) {
  for (int dev = 0; dev < kMaxDevices; ++dev) {
    bool any = false;
    for (size_t i = first; i <= last && !any; ++i) any = r.chunks[i].residentOn == dev;
    if (!any) continue;
    drv().state->dropResident(dev, ownerFor(t, dev), [&] {
      uint64_t gone = 0;
      for (size_t i = first; i <= last; ++i)
        if (r.chunks[i].residentOn == dev) {  // after the settle: what is still resident
          r.chunks[i].residentOn = kHost;
          gone += r.chunkBytes(i);
        }
      return gone;
    });
  }
}

// Applies what the driver evicted from this process on dev since the last managed operation: the
// table must show the truth before anything is decided from it (a chunk evicted by another
// process still looks resident until then).
void settle(Table& t, int dev) { drv().state->settleManaged(dev, ownerFor(t, dev)); }
void settleAll(Table& t) {
  for (int dev = 0; dev < drv().state->deviceCount(); ++dev) settle(t, dev);
}

bool parsePlace(const CUmemLocation& loc, bool hostOrDeviceOnly, Place* out) {
  switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
      if (!validDevice(loc.id)) return false;
      *out = {CU_MEM_LOCATION_TYPE_DEVICE, loc.id};
      return true;
    case CU_MEM_LOCATION_TYPE_HOST:
      *out = {CU_MEM_LOCATION_TYPE_HOST, 0};
      return true;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
      if (hostOrDeviceOnly || loc.id != 0) return false;  // one NUMA node, 0
      *out = {CU_MEM_LOCATION_TYPE_HOST_NUMA, 0};
      return true;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
      if (hostOrDeviceOnly) return false;
      *out = {CU_MEM_LOCATION_TYPE_HOST_NUMA, 0};
      return true;
    default:
      return false;
  }
}

bool onHost(const Place& p) { return p.type == CU_MEM_LOCATION_TYPE_HOST || p.type == CU_MEM_LOCATION_TYPE_HOST_NUMA; }

// The legacy int form of a place shared by every chunk (-1 host, -2 none or mixed).
int legacyOf(const Place& p, bool same) {
  if (!same || p.type == 0) return CU_DEVICE_INVALID;
  if (p.type == CU_MEM_LOCATION_TYPE_DEVICE) return p.id;
  return CU_DEVICE_CPU;
}

}  // namespace

void managedCreate(uintptr_t base, uint64_t size) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  checkFork(t);
  Range r;
  r.base = base;
  r.size = size;
  r.chunks.resize((size + kChunk - 1) / kChunk);
  t.ranges[base] = std::move(r);
  gRanges.fetch_add(1, std::memory_order_relaxed);
}

void managedDestroy(uintptr_t base) {
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  checkFork(t);
  auto it = t.ranges.find(base);
  if (it == t.ranges.end()) return;
  settleAll(t);
  if (!it->second.chunks.empty()) sendToHost(t, it->second, 0, it->second.chunks.size() - 1);
  t.ranges.erase(it);
  gRanges.fetch_sub(1, std::memory_order_relaxed);
}

bool managedInUse() { return gRanges.load(std::memory_order_relaxed) != 0; }

uint64_t managedTouch(int ordinal, const std::vector<std::vector<char>>& args) {
  if (gRanges.load(std::memory_order_relaxed) == 0) return 0;
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  checkFork(t);
  const int dev = hostDevice(ordinal);
  bool settled = false;
  uint64_t migrated = 0;
  for (const auto& a : args)
    for (size_t off = 0; off + sizeof(uintptr_t) <= a.size(); off += sizeof(uintptr_t)) {
      uintptr_t p;
      std::memcpy(&p, a.data() + off, sizeof p);
      Range* r = findRange(t, p, 1);
      if (!r) continue;
      if (!settled) settleAll(t);
      settled = true;
      // The kernel may reach the whole allocation: every chunk not kept on the host by advice.
      for (size_t i = 0; i < r->chunks.size(); ++i)
        if (!onHost(r->chunks[i].preferred) && r->chunks[i].residentOn != dev && populate(t, *r, i, dev)) ++migrated;
    }
  // The kernel waits for its faults: each chunk migrated costs the configured device time.
  return migrated * drv().cfg.faultChunkNs;
}

}  // namespace simgpu

using namespace simgpu;

CU_EXPORT CUresult cuMemAdvise_v2(CUdeviceptr p, size_t count, CUmem_advise advice, CUmemLocation loc) {
  API_ENTER(p, count, advice);
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  checkFork(t);
  Range* r = findRange(t, p, count);
  if (!r || count == 0) return CUDA_ERROR_INVALID_VALUE;
  Place place;
  switch (advice) {
    case CU_MEM_ADVISE_SET_READ_MOSTLY:
    case CU_MEM_ADVISE_UNSET_READ_MOSTLY:
      break;  // the location is ignored
    case CU_MEM_ADVISE_SET_PREFERRED_LOCATION:
      if (!parsePlace(loc, false, &place)) return CUDA_ERROR_INVALID_DEVICE;
      break;
    case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION:
      break;
    case CU_MEM_ADVISE_SET_ACCESSED_BY:
    case CU_MEM_ADVISE_UNSET_ACCESSED_BY:
      if (!parsePlace(loc, true, &place)) return CUDA_ERROR_INVALID_DEVICE;
      break;
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  const uint32_t bit = place.type == CU_MEM_LOCATION_TYPE_DEVICE ? 1u << place.id : 1u << 31;
  size_t first, last;
  chunkSpan(*r, p, count, &first, &last);
  for (size_t i = first; i <= last; ++i) {
    Chunk& c = r->chunks[i];
    switch (advice) {
      case CU_MEM_ADVISE_SET_READ_MOSTLY: c.readMostly = true; break;
      case CU_MEM_ADVISE_UNSET_READ_MOSTLY: c.readMostly = false; break;
      case CU_MEM_ADVISE_SET_PREFERRED_LOCATION: c.preferred = place; break;  // nothing migrates now
      case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION: c.preferred = Place{}; break;
      case CU_MEM_ADVISE_SET_ACCESSED_BY: c.accessedBy |= bit; break;
      case CU_MEM_ADVISE_UNSET_ACCESSED_BY: c.accessedBy &= ~bit; break;
      default: break;
    }
  }
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuMemAdvise(CUdeviceptr p, size_t count, CUmem_advise advice, CUdevice dev) __asm__("cuMemAdvise");
CUresult simgpu_cuMemAdvise(CUdeviceptr p, size_t count, CUmem_advise advice, CUdevice dev) {
  CUmemLocation loc{dev == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE, dev == CU_DEVICE_CPU ? 0 : dev};
  return cuMemAdvise_v2(p, count, advice, loc);
}

CU_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t count, CUmemLocation loc, unsigned int flags, CUstream s) {
  API_ENTER(p, count, flags, s);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Stream* st;
  CU_TRY(resolveStream(s, &st));
  Place place;
  if (!parsePlace(loc, false, &place)) return CUDA_ERROR_INVALID_DEVICE;
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  checkFork(t);
  Range* r = findRange(t, p, count);
  if (!r || count == 0) return CUDA_ERROR_INVALID_VALUE;
  size_t first, last;
  chunkSpan(*r, p, count, &first, &last);
  for (size_t i = first; i <= last; ++i) r->chunks[i].lastPrefetch = place;
  settleAll(t);
  // Done at the call (the real driver migrates in stream order; LAST_PREFETCH_LOCATION is the
  // request either way). A device without room for every chunk keeps the rest on the host.
  if (place.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    const int dev = hostDevice(place.id);
    for (size_t i = first; i <= last; ++i) populate(t, *r, i, dev);
  } else {
    sendToHost(t, *r, first, last);
  }
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuMemPrefetchAsync(CUdeviceptr p, size_t count, CUdevice dev, CUstream s) __asm__("cuMemPrefetchAsync");
CUresult simgpu_cuMemPrefetchAsync(CUdeviceptr p, size_t count, CUdevice dev, CUstream s) {
  CUmemLocation loc{dev == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE, dev == CU_DEVICE_CPU ? 0 : dev};
  return cuMemPrefetchAsync_v2(p, count, loc, 0, s);
}

CU_EXPORT CUresult cuMemRangeGetAttribute(void* data, size_t dataSize, CUmem_range_attribute attr, CUdeviceptr p, size_t count) {
  API_ENTER(data, dataSize, attr, p, count);
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  Table& t = table();
  std::lock_guard<std::mutex> g(t.mu);
  Range* r = findRange(t, p, count);
  if (!r || count == 0) return CUDA_ERROR_INVALID_VALUE;
  size_t first, last;
  chunkSpan(*r, p, count, &first, &last);
  auto shared = [&](auto get) {  // (value, whether every chunk has it)
    const Place v = get(r->chunks[first]);
    bool same = true;
    for (size_t i = first + 1; i <= last && same; ++i) same = get(r->chunks[i]) == v;
    return std::make_pair(v, same);
  };
  auto preferred = [](const Chunk& c) { return c.preferred; };
  auto prefetched = [](const Chunk& c) { return c.lastPrefetch; };
  int* out = static_cast<int*>(data);
  switch (attr) {
    case CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY: {
      if (dataSize != 4) return CUDA_ERROR_INVALID_VALUE;
      bool all = true;
      for (size_t i = first; i <= last; ++i) all &= r->chunks[i].readMostly;
      *out = all;
      return CUDA_SUCCESS;
    }
    case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION:
    case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION: {
      if (dataSize != 4) return CUDA_ERROR_INVALID_VALUE;
      const auto [v, same] = attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION ? shared(preferred) : shared(prefetched);
      *out = legacyOf(v, same);
      return CUDA_SUCCESS;
    }
    case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE:
    case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE:
    case CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID:
    case CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID: {
      if (dataSize != 4) return CUDA_ERROR_INVALID_VALUE;
      const bool pref = attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE || attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID;
      const auto [v, same] = pref ? shared(preferred) : shared(prefetched);
      const bool type = attr == CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE || attr == CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE;
      *out = type ? (same ? v.type : CU_MEM_LOCATION_TYPE_INVALID) : (same && v.type == CU_MEM_LOCATION_TYPE_DEVICE ? v.id : 0);
      return CUDA_SUCCESS;
    }
    case CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY: {
      if (dataSize == 0 || dataSize % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
      uint32_t all = ~0u;
      for (size_t i = first; i <= last; ++i) all &= r->chunks[i].accessedBy;
      const size_t n = dataSize / 4;
      size_t k = 0;
      for (int d = 0; d < 31 && k < n; ++d)
        if (all & (1u << d)) out[k++] = d;
      if ((all & (1u << 31)) && k < n) out[k++] = CU_DEVICE_CPU;
      for (; k < n; ++k) out[k] = CU_DEVICE_INVALID;
      return CUDA_SUCCESS;
    }
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
}

CU_EXPORT CUresult cuMemRangeGetAttributes(void** data, size_t* dataSizes, CUmem_range_attribute* attrs, size_t n,
                                           CUdeviceptr p, size_t count) {
  API_ENTER(data, dataSizes, attrs, n, p, count);
  if (!data || !dataSizes || !attrs || n == 0) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < n; ++i) CU_TRY(cuMemRangeGetAttribute(data[i], dataSizes[i], attrs[i], p, count));
  return CUDA_SUCCESS;
}
