// The driver's private export tables: cuGetExportTable hands cudart these arrays of function
// pointers, looked up by 16-byte UUID. cudart 13 refuses to work without six of them (see
// docs "Private export tables" in simgpu-facts.md); their layouts were learned from ZLUDA
// (NOTICE.d/zluda.txt).
//
// Invariants:
// - Every table is built once, on first request, in static storage with a trivial destructor, and
//   is never freed or changed afterwards: cudart keeps the pointers for the life of the process and
//   calls through them during its exit-time teardown, after this library's static destructors ran.
// - No slot is ever NULL. Each table has kSlotCount slots, far more than any index cudart uses;
//   every slot without an implementation holds a stub returning CUDA_ERROR_NOT_SUPPORTED, because
//   cudart 13 calls slots that older reimplementations left NULL.
// - Slot 0 of a sized table holds the table's size in bytes as the real driver reports it (the
//   slot counts in simgpu-facts.md), not kSlotCount: cudart may use the size to decide which slots
//   exist, and the known sizes are what it was observed to work with. Calls past that size still
//   land on stubs.
// - Context-local storage lives in a heap object that is never deleted, for the same exit-time
//   reason; it is guarded by its own mutex and never calls out (cuCtxGetCurrent, destroy
//   callbacks) while holding it.
#include "export_tables.h"

#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

// The driver's first-ABI cuDeviceGetUuid (init_device.cpp defines it under that symbol name).
extern "C" CUresult simgpu_firstAbiUuid(CUuuid* uuid, CUdevice dev) __asm__("cuDeviceGetUuid");

namespace simgpu {
namespace {

constexpr size_t kSlotCount = 128;  // above every reported size (CONTEXT_IDS: 93)

enum TableId : int {
  kCudartInterface,
  kToolsRuntimeCallbackHooks,
  kToolsTls,
  kContextLocalStorage,
  kContextChecks,
  kIntegrityCheck,
  kContextIds,       // used by cuBLAS, cuBLASLt and cuFFT
  kModuleCallbacks,  // used by cuFFT
  kTableCount,
};

struct TableSpec {
  TableId id;
  unsigned char uuid[16];  // in the byte order cudart passes
  int reportedSlots;       // what slot 0 reports, in slots; 0: the table has no size slot
  const char* name;        // ZLUDA's name, for traces
};

constexpr TableSpec kTableSpecs[kTableCount] = {
    {kCudartInterface,
     {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     13, "CUDART_INTERFACE"},
    {kToolsRuntimeCallbackHooks,
     {0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66},
     7, "TOOLS_RUNTIME_CALLBACK_HOOKS"},
    {kToolsTls,
     {0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc},
     4, "TOOLS_TLS"},
    {kContextLocalStorage,
     {0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8, 0x95, 0x93},
     0, "CONTEXT_LOCAL_STORAGE_INTERFACE_V0301"},
    {kContextChecks,
     {0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     4, "CONTEXT_CHECKS"},
    {kIntegrityCheck,
     {0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     3, "INTEGRITY_CHECK"},
    {kContextIds,
     {0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2},
     93, "CONTEXT_IDS"},  // 93: the size public reimplementations record for the real driver
    {kModuleCallbacks,
     {0x6e, 0x16, 0x3f, 0xbe, 0xb9, 0x58, 0x44, 0x4d, 0x83, 0x5c, 0xe1, 0x82, 0xaf, 0xf1, 0x99, 0x1e},
     16, "MODULE_CALLBACKS"},
};

// cudart asks for f8cff951-... before cuInit. Refusing it is what works: cudart carries on, while
// a successful answer is reported to make it skip part of its initialisation. Its layout is unknown.
constexpr unsigned char kRefusedTableUuid[16] = {0xf8, 0xcf, 0xf9, 0x51, 0x21, 0x46, 0x8b, 0x4e,
                                                 0xb9, 0xe2, 0xfb, 0x46, 0x9e, 0x7c, 0x0d, 0xd9};

struct ExportTable {
  const void* slots[kSlotCount];
};

struct Tables {
  ExportTable table[kTableCount];
};

template <typename Fn>
const void* slotAddress(Fn* fn) noexcept {
  return reinterpret_cast<const void*>(fn);  // POSIX: function pointers round-trip through void*
}

bool traceEnabled() noexcept {
  const char* v = std::getenv("SIMGPU_TRACE");  // same switch as the driver's Config::trace
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// One stub per (table, slot), so a backtrace or trace line names the slot cudart reached.
// Declared without parameters: callers pass whatever the real slot takes, which the C calling
// convention lets the callee ignore.
template <int kTable, size_t kSlot>
CUresult notSupportedStub() noexcept {
  if (traceEnabled()) {
    std::fprintf(stderr, "simgpu: export table %s slot %zu is not implemented (CUDA_ERROR_NOT_SUPPORTED)\n",
                 kTableSpecs[kTable].name, kSlot);
  }
  return CUDA_ERROR_NOT_SUPPORTED;
}

template <int kTable, size_t... kSlots>
void fillWithStubs(ExportTable* t, std::index_sequence<kSlots...>) noexcept {
  ((t->slots[kSlots] = slotAddress(&notSupportedStub<kTable, kSlots>)), ...);
}

// ---- CUDART_INTERFACE -----------------------------------------------------------------------

// Slot 2: (CUcontext* out, CUdevice): return the device's primary context, retaining it as ZLUDA
// does. Observed with cudart 13.0: it calls this once per device during initialisation and never
// releases those references; when it actually uses a device it retains and releases it again
// through the public API. So each primary context keeps one reference for the process's life.
CUresult cudartRetainPrimaryContext(CUcontext* out, CUdevice dev) noexcept {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return cuDevicePrimaryCtxRetain(out, dev);
}

// Slot 12: CUresult(void), called by cudart 13.1 and later (not 13.0) once during initialisation,
// right after cuInit and its cuGetExportTable requests, with no arguments (the argument registers
// hold leftovers of the code before). cudart tests only the result: non-zero ends initialisation
// and every runtime call returns it (NOT_SUPPORTED becomes 801, cudaErrorNotSupported, which is how
// PyTorch's own libcudart 13.2 failed on simgpu). cudart skips the call when the environment holds
// CUDA_8b3537d1=dc6ffd77, so it is a check the driver performs on the runtime's behalf, with
// nothing to hand back: simgpu accepts every runtime. Learned by disassembling the call site in
// libcudart.so.13 13.1.80, 13.2.86 and 13.5.37 (docs/simgpu.md, "Private export tables").
CUresult cudartRuntimeAccepted() noexcept { return CUDA_SUCCESS; }

// ---- TOOLS_RUNTIME_CALLBACK_HOOKS -----------------------------------------------------------

// Slots 2 and 6: (void** buffer, size_t* size): hand out a zeroed buffer that cudart owns from then
// on, the same one at every call (one per slot, as ZLUDA does). The sizes reported are 1024 and 14;
// the storage is 4x that because ZLUDA backs them with 32-bit words and cudart worked with that.
// Static arrays: zero-initialised, trivially destructible, never freed.
void toolsHooksBuffer1(void** buffer, size_t* size) noexcept {
  alignas(64) static uint32_t storage[1024];
  if (buffer != nullptr) *buffer = storage;
  if (size != nullptr) *size = 1024;
}

void toolsHooksBuffer2(void** buffer, size_t* size) noexcept {
  alignas(64) static uint32_t storage[14];
  if (buffer != nullptr) *buffer = storage;
  if (size != nullptr) *size = 14;
}

// ---- CONTEXT_LOCAL_STORAGE --------------------------------------------------------------------

// The destroy callback cudart registers with each value; the real driver calls it when the
// context goes away (see destroyContextLocalStorage).
using ClsDestroyCallback = void (*)(CUcontext ctx, void* key, void* value);

struct ClsEntry {
  void* value;
  ClsDestroyCallback onDestroy;
};

struct ClsStore {
  std::mutex mutex;
  std::map<std::pair<uintptr_t, uintptr_t>, ClsEntry> entries;  // (ctx, key) -> entry
};

// Heap-allocated once and never deleted: cudart deletes its entries at exit, after static
// destructors ran. nullptr only if the very first allocation failed.
ClsStore* clsStore() noexcept {
  static ClsStore* const store = new (std::nothrow) ClsStore();
  return store;
}

// cudart passes a null context to mean the calling thread's current one (as ZLUDA resolves it).
CUcontext clsResolveContext(CUcontext ctx) noexcept {
  if (ctx != nullptr) return ctx;
  CUcontext current = nullptr;
  if (cuCtxGetCurrent(&current) != CUDA_SUCCESS) return nullptr;  // key on null: still consistent
  return current;
}

std::pair<uintptr_t, uintptr_t> clsKey(CUcontext ctx, void* key) noexcept {
  return {reinterpret_cast<uintptr_t>(ctx), reinterpret_cast<uintptr_t>(key)};
}

// Slot 0: put(ctx, key, value, onDestroy). A second put for the same (ctx, key) replaces the value.
CUresult clsPut(CUcontext ctx, void* key, void* value, ClsDestroyCallback onDestroy) noexcept {
  ClsStore* store = clsStore();
  if (store == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  ctx = clsResolveContext(ctx);
  try {
    std::lock_guard<std::mutex> lock(store->mutex);
    store->entries[clsKey(ctx, key)] = ClsEntry{value, onDestroy};
  } catch (...) {  // bad_alloc from the map, system_error from the mutex
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

// Slot 1: delete(ctx, key). cudart's own cleanup, so no destroy callback. Deleting a missing key
// succeeds (idempotent, as in ZLUDA): cudart calls this during exit and has nothing to do on error.
CUresult clsDelete(CUcontext ctx, void* key) noexcept {
  ClsStore* store = clsStore();
  if (store == nullptr) return CUDA_SUCCESS;
  ctx = clsResolveContext(ctx);
  try {
    std::lock_guard<std::mutex> lock(store->mutex);
    store->entries.erase(clsKey(ctx, key));
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;
  }
  return CUDA_SUCCESS;
}

// Slot 2: get(value*, ctx, key). A missing key must be CUDA_ERROR_INVALID_HANDLE: that is how
// cudart learns it has not set up this context yet.
CUresult clsGet(void** value, CUcontext ctx, void* key) noexcept {
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  ClsStore* store = clsStore();
  if (store == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  ctx = clsResolveContext(ctx);
  try {
    std::lock_guard<std::mutex> lock(store->mutex);
    const auto it = store->entries.find(clsKey(ctx, key));
    if (it == store->entries.end()) return CUDA_ERROR_INVALID_HANDLE;
    *value = it->second.value;
  } catch (...) {
    return CUDA_ERROR_UNKNOWN;
  }
  return CUDA_SUCCESS;
}

// ---- CONTEXT_CHECKS ---------------------------------------------------------------------------

// Slot 2: (ctx, uint32_t* out, void**): *out = 0 means "an ordinary context"; the last argument is
// left alone (ZLUDA never writes it either).
CUresult contextCheck(CUcontext /*ctx*/, uint32_t* out, void** /*unused*/) noexcept {
  if (out != nullptr) *out = 0;
  return CUDA_SUCCESS;
}

// Slot 3: uint32_t(): 0, the value the real driver was always seen to return.
uint32_t contextCheckFlags() noexcept { return 0; }

// ---- INTEGRITY_CHECK --------------------------------------------------------------------------

const Tables* tables() noexcept;

// Slot 1: (uint32_t version, uint64_t unix_seconds, uint64_t out[2]). The device identities are
// read through the public API, so they are by construction what cudart reads for its own hash.
CUresult integrityCheck(uint32_t version, uint64_t unixSeconds, uint64_t* out) noexcept {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const Tables* t = tables();
  const void* cudartTable = t->table[kCudartInterface].slots;
  const void* integrityTable = t->table[kIntegrityCheck].slots;
  const void* integrityFn = t->table[kIntegrityCheck].slots[1];  // the very address cudart called
  const uint64_t pid = static_cast<uint64_t>(getpid());
  // The thread is identified by pthread_self(), as ZLUDA does (the hash keeps its low 32 bits).
  const uint64_t tid = static_cast<uint64_t>(pthread_self());

  if (version % 10 < 2) {  // fixed answers: no driver state needed
    integrityHash(version, unixSeconds, 0, pid, tid, cudartTable, integrityTable, integrityFn, nullptr, 0, out);
    return CUDA_SUCCESS;
  }

  int driverVersion = 0;
  CUresult r = cuDriverGetVersion(&driverVersion);
  if (r != CUDA_SUCCESS) return r;
  int count = 0;
  r = cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) return r;
  if (count < 0) return CUDA_ERROR_UNKNOWN;
  std::vector<IntegrityDevice> devices;
  try {
    devices.resize(static_cast<size_t>(count));
  } catch (...) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    if ((r = cuDeviceGet(&dev, i)) != CUDA_SUCCESS) return r;
    // The first ABI's UUID: cudart hashes what it got from cuDeviceGetUuid, which differs from
    // _v2's inside a MIG device (the GPU's, not the MIG device's).
    CUuuid uuid{};
    if ((r = simgpu_firstAbiUuid(&uuid, dev)) != CUDA_SUCCESS) return r;
    static_assert(sizeof(uuid.bytes) == sizeof(devices[i].uuid));
    std::memcpy(devices[i].uuid, uuid.bytes, sizeof(devices[i].uuid));
    int domain = 0, bus = 0, device = 0;
    if ((r = cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev)) != CUDA_SUCCESS) return r;
    if ((r = cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev)) != CUDA_SUCCESS) return r;
    if ((r = cuDeviceGetAttribute(&device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev)) != CUDA_SUCCESS) return r;
    devices[i].pci_domain = static_cast<unsigned>(domain);
    devices[i].pci_bus = static_cast<unsigned>(bus);
    devices[i].pci_device = static_cast<unsigned>(device);
  }
  integrityHash(version, unixSeconds, driverVersion, pid, tid, cudartTable, integrityTable, integrityFn,
                devices.data(), count, out);
  return CUDA_SUCCESS;
}

// ---- TOOLS_TLS, CONTEXT_IDS, MODULE_CALLBACKS (cuBLASLt and cuFFT; layouts measured on simgpu) ---

// TOOLS_TLS slot 2: (CUcontext* out): the calling thread's current context. cuBLASLt keys its
// per-context kernel tables on it; a failure leaves them empty and every heuristics query fails.
CUresult toolsCurrentContext(CUcontext* out) noexcept {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return cuCtxGetCurrent(out);
}

// CONTEXT_IDS slot 4: (CUcontext ctx, uint64_t* id): a stable id per context, as cuCtxGetId.
CUresult contextId(CUcontext ctx, uint64_t* id) noexcept {
  if (id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  unsigned long long v = 0;
  const CUresult r = cuCtxGetId(ctx, &v);
  *id = v;
  return r;
}

// Runs fn with ctx current (nullptr: the calling thread's current context), so that the special
// stream handles (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) resolve to ctx's streams.
template <typename Fn>
CUresult withContext(CUcontext ctx, Fn fn) noexcept {
  CUcontext current = nullptr;
  CUresult r = cuCtxGetCurrent(&current);
  if (r != CUDA_SUCCESS) return r;
  if (ctx == nullptr || ctx == current) return fn();
  if ((r = cuCtxPushCurrent(ctx)) != CUDA_SUCCESS) return r;
  const CUresult result = fn();
  CUcontext popped = nullptr;
  const CUresult popResult = cuCtxPopCurrent(&popped);
  return result != CUDA_SUCCESS ? result : popResult;
}

// CONTEXT_IDS slot 51: (CUcontext ctx, CUstream stream, CUstream* out, int perThread): the
// driver's own handle of a public stream handle. cuBLAS calls it in cublasSgemm's kernel path
// (before every xmma launch) with the handle's stream, perThread = (stream ==
// CU_STREAM_PER_THREAD), and passes the answer only to slot 39 to get the stream's id, which it
// matches against the streams it has cached state for; a failure is CUBLAS_STATUS_INTERNAL_ERROR.
// simgpu's handles are their own private handles: a created stream is answered as itself, and the
// NULL stream as the default stream it stands for (legacy, or per-thread when perThread is set),
// so slot 39 resolves it against the same context. An unknown stream is CUDA_ERROR_INVALID_HANDLE.
CUresult contextPrivateStream(CUcontext ctx, CUstream stream, CUstream* out, int perThread) noexcept {
  if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (stream == nullptr) stream = perThread != 0 ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY;
  const CUresult r = withContext(ctx, [stream]() noexcept {
    unsigned long long id = 0;
    return cuStreamGetId(stream, &id);  // validates the handle and creates a per-thread stream
  });
  if (r != CUDA_SUCCESS) return r;
  *out = stream;
  return CUDA_SUCCESS;
}

// CONTEXT_IDS slot 39: (CUcontext ctx, CUstream privateStream, uint64_t* id): the stream's unique
// id, as cuStreamGetId, for a stream slot 51 answered.
CUresult contextStreamId(CUcontext ctx, CUstream stream, uint64_t* id) noexcept {
  if (id == nullptr || stream == nullptr) return CUDA_ERROR_INVALID_VALUE;
  unsigned long long v = 0;
  const CUresult r = withContext(ctx, [stream, &v]() noexcept { return cuStreamGetId(stream, &v); });
  if (r != CUDA_SUCCESS) return r;
  *id = v;
  return CUDA_SUCCESS;
}

// MODULE_CALLBACKS slot 7: (ctx, module, cb(user, CUfunction), user) -> int, called by cuFFT right
// after it loads a kernel image: it must hand the module's kernel to cb and return 1, else cuFFT
// unloads the module. simgpu cannot name kernels in compressed images, so it hands an unnamed
// function of the module (launching it does nothing, as every kernel without a host body).
int moduleForEachFunction(CUcontext /*ctx*/, CUmodule mod, void (*cb)(void*, CUfunction), void* user) noexcept {
  if (mod == nullptr || cb == nullptr) return 0;
  CUfunction f = nullptr;
  if (cuModuleGetFunction(&f, mod, "simgpu_module_function") != CUDA_SUCCESS) return 0;
  cb(user, f);
  return 1;
}

// ---- Table assembly ---------------------------------------------------------------------------

void buildTables(Tables* t) noexcept {
  fillWithStubs<kCudartInterface>(&t->table[kCudartInterface], std::make_index_sequence<kSlotCount>());
  fillWithStubs<kToolsRuntimeCallbackHooks>(&t->table[kToolsRuntimeCallbackHooks],
                                            std::make_index_sequence<kSlotCount>());
  fillWithStubs<kToolsTls>(&t->table[kToolsTls], std::make_index_sequence<kSlotCount>());
  fillWithStubs<kContextLocalStorage>(&t->table[kContextLocalStorage], std::make_index_sequence<kSlotCount>());
  fillWithStubs<kContextChecks>(&t->table[kContextChecks], std::make_index_sequence<kSlotCount>());
  fillWithStubs<kIntegrityCheck>(&t->table[kIntegrityCheck], std::make_index_sequence<kSlotCount>());
  fillWithStubs<kContextIds>(&t->table[kContextIds], std::make_index_sequence<kSlotCount>());
  fillWithStubs<kModuleCallbacks>(&t->table[kModuleCallbacks], std::make_index_sequence<kSlotCount>());

  for (const TableSpec& spec : kTableSpecs) {
    if (spec.reportedSlots > 0) {
      t->table[spec.id].slots[0] =
          reinterpret_cast<const void*>(static_cast<uintptr_t>(spec.reportedSlots) * sizeof(void*));
    }
  }

  t->table[kCudartInterface].slots[2] = slotAddress(&cudartRetainPrimaryContext);
  t->table[kCudartInterface].slots[12] = slotAddress(&cudartRuntimeAccepted);

  t->table[kToolsRuntimeCallbackHooks].slots[2] = slotAddress(&toolsHooksBuffer1);
  t->table[kToolsRuntimeCallbackHooks].slots[6] = slotAddress(&toolsHooksBuffer2);

  t->table[kContextLocalStorage].slots[0] = slotAddress(&clsPut);
  t->table[kContextLocalStorage].slots[1] = slotAddress(&clsDelete);
  t->table[kContextLocalStorage].slots[2] = slotAddress(&clsGet);

  t->table[kContextChecks].slots[2] = slotAddress(&contextCheck);
  t->table[kContextChecks].slots[3] = slotAddress(&contextCheckFlags);

  t->table[kIntegrityCheck].slots[1] = slotAddress(&integrityCheck);

  t->table[kToolsTls].slots[2] = slotAddress(&toolsCurrentContext);
  t->table[kContextIds].slots[4] = slotAddress(&contextId);
  t->table[kContextIds].slots[39] = slotAddress(&contextStreamId);
  t->table[kContextIds].slots[51] = slotAddress(&contextPrivateStream);
  t->table[kModuleCallbacks].slots[7] = slotAddress(&moduleForEachFunction);
}

// Built on first use (function addresses cannot be placed in a constant initialiser), in static
// storage whose destructor is trivial, so nothing ever tears it down.
const Tables* tables() noexcept {
  static Tables storage;
  [[maybe_unused]] static const bool built = (buildTables(&storage), true);
  return &storage;
}

}  // namespace

CUresult getExportTable(const void** table, const CUuuid* id) noexcept {
  if (table == nullptr || id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (std::memcmp(id->bytes, kRefusedTableUuid, sizeof(kRefusedTableUuid)) != 0) {
    for (const TableSpec& spec : kTableSpecs) {
      if (std::memcmp(id->bytes, spec.uuid, sizeof(spec.uuid)) != 0) continue;
      *table = tables()->table[spec.id].slots;
      return CUDA_SUCCESS;
    }
  }
  if (traceEnabled()) {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(id->bytes);
    std::fprintf(stderr,
                 "simgpu: cuGetExportTable: no table %02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
                 "%02x%02x%02x%02x%02x%02x (CUDA_ERROR_NOT_SUPPORTED)\n",
                 b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                 b[15]);
  }
  *table = nullptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}

void destroyContextLocalStorage(CUcontext ctx) noexcept {
  ClsStore* store = clsStore();
  if (store == nullptr) return;
  struct Doomed {
    void* key;
    ClsEntry entry;
  };
  std::vector<Doomed> doomed;
  try {
    std::lock_guard<std::mutex> lock(store->mutex);
    const uintptr_t c = reinterpret_cast<uintptr_t>(ctx);
    auto it = store->entries.lower_bound({c, 0});
    while (it != store->entries.end() && it->first.first == c) {
      doomed.push_back({reinterpret_cast<void*>(it->first.second), it->second});
      it = store->entries.erase(it);
    }
  } catch (...) {
    // Out of memory mid-way: the entries not yet collected stay stored (each is erased only after
    // it was collected); the collected ones are still destroyed below.
  }
  // Outside the lock: a callback may well call back into clsDelete/clsGet.
  for (const Doomed& d : doomed) {
    if (d.entry.onDestroy != nullptr) d.entry.onDestroy(ctx, d.key, d.entry.value);
  }
}

}  // namespace simgpu
