// simgpu driver internals shared by the API files (init, context, memory, stream, module, graph, vmm).
//
// Execution model: every stream has a worker thread that executes its operations in order; all
// work reaches it through submit() (or, while the stream captures, is recorded into a graph).
// Arguments are validated and copied at submission, so the caller's storage may change at once,
// as CUDA allows. Cross-stream order (events, the legacy stream's implicit synchronisation) is a
// wait operation queued on the waiting stream, never a host-side block. A later timing model can
// decide in the worker when an operation *completes* without changing what it does.
//
// Lifetime: everything cudart can reach at exit (contexts, streams, registries, the context
// stack) is allocated once and never destroyed; thread-locals are trivially destructible.
#pragma once

#include <cuda.h>

#include <array>
#include <atomic>
#include <memory>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "config.h"
#include "cushare/probe_abi.h"
#include "shared_state.h"
#include "mig.h"

#define SIMGPU_EXPORT __attribute__((visibility("default")))
#define CU_EXPORT extern "C" SIMGPU_EXPORT

namespace simgpu {

inline constexpr int kDriverVersion = 13000;
inline constexpr size_t kAllocAlign = 256;           // cudaMalloc's documented minimum alignment
inline constexpr size_t kVmmGranularity = 2u << 20;  // cuMemGetAllocationGranularity

// ---------------------------------------------------------------------------------------------
// Global driver state
struct Context;
struct Stream;

struct Driver {
  Config cfg;
  SharedState* state = nullptr;
  std::atomic<int> initState{0};  // 0 not yet, 1 ok, 2 failed
  CUresult initResult = CUDA_SUCCESS;
  Context* primary[kMaxDevices] = {};
  // The devices this process sees (visibleDevices: container, CUDA_DEVICE_ORDER,
  // CUDA_VISIBLE_DEVICES), fixed by cuInit: a CUdevice is an index into `visible`, which holds
  // host indices. Everything host-wide (the shared state, sizes, UUIDs, PCI ids) is by host index.
  int visibleCount = 0;
  int visible[kMaxDevices] = {};
  // The MIG device this process runs in (CUDA_VISIBLE_DEVICES=MIG-...; docs/simgpu.md, "MIG"):
  // then it is the only device, and cfg's name, SM count and memory of `host` are the instance's.
  struct Mig {
    bool on = false;
    int host = 0;
    unsigned gi = 0, ci = 0;
  } mig;
};
Driver& drv();
bool traceOn();
// CUDA_SUCCESS once cuInit succeeded; CUDA_ERROR_NOT_INITIALIZED before, or cuInit's failure.
CUresult initStatus();

// ---------------------------------------------------------------------------------------------
// Tracing (SIMGPU_TRACE=1): one line per driver call with its arguments, on stderr.
void traceWrite(const char* fn, const std::string& args);
inline void traceArg(std::string& s, const char* v) {
  s += v ? std::string("\"") + v + "\"" : "null";
}
inline void traceArg(std::string& s, const void* v) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", v);
  s += b;
}
template <typename T>
void traceArg(std::string& s, const T& v) {
  if constexpr (std::is_pointer_v<T>) {
    traceArg(s, reinterpret_cast<const void*>(v));
  } else if constexpr (std::is_enum_v<T>) {
    s += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_integral_v<T>) {
    if constexpr (sizeof(T) == 8 && std::is_unsigned_v<T>) {
      char b[32];
      std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
      s += b;
    } else {
      s += std::to_string(v);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    s += std::to_string(v);
  } else {
    s += "{...}";
  }
}
template <typename... A>
void traceCall(const char* fn, const A&... a) {
  std::string s;
  bool first = true;
  ((s += first ? "" : ", ", first = false, traceArg(s, a)), ...);
  traceWrite(fn, s);
}
#define SIMGPU_TRACE(...)                                          \
  do {                                                             \
    if (::simgpu::traceOn()) ::simgpu::traceCall(__func__ __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
// Entry of an API that needs cuInit first.
#define API_ENTER(...)                                 \
  SIMGPU_TRACE(__VA_ARGS__);                           \
  if (CUresult st_ = ::simgpu::initStatus(); st_ != CUDA_SUCCESS) return st_
#define CU_TRY(x)                                   \
  do {                                              \
    if (CUresult r_ = (x); r_ != CUDA_SUCCESS) return r_; \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Handles: every object handed out is registered, so a stale or foreign handle is refused with
// CUDA_ERROR_INVALID_HANDLE instead of being dereferenced.
enum class HandleType : uint8_t {
  kContext, kStream, kEvent, kModule, kFunction, kLibrary, kGraph, kGraphNode, kGraphExec,
  kMemPool, kArray, kMipmappedArray, kVmmHandle, kLinkState, kTexObject, kSurfObject, kConditional,
};
void handleAdd(const void* h, HandleType t);
void handleRemove(const void* h);
bool handleIs(const void* h, HandleType t);
template <typename T>
T* handleGet(const void* h, HandleType t) {
  return handleIs(h, t) ? static_cast<T*>(const_cast<void*>(h)) : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Contexts
struct Context {
  int device = 0;
  bool primary = false;
  unsigned flags = 0;
  int refs = 0;            // primary: retain count; created: 1 until destroyed
  // primary: retained at least once since the last reset. Written under ctxMutex, read without it
  // by every call that needs a current context (another thread may retain or release meanwhile).
  std::atomic<bool> active{false};
  Stream* legacy = nullptr;  // the NULL stream
  size_t limits[16] = {};  // CUlimit values
  CUfunc_cache cacheConfig = CU_FUNC_CACHE_PREFER_NONE;
  unsigned long long id = 0;
  std::mutex streamsMu;
  std::vector<Stream*> streams;  // every stream of this context, the legacy one included
};
Context* currentContext();  // may be null
// The current context, or CUDA_ERROR_INVALID_CONTEXT.
CUresult requireContext(Context** out);
Context* primaryContext(int dev);  // created on first use, inactive until retained
CUresult retainPrimary(int dev, Context** out);
void setCurrent(Context* c);
int deviceCount();
bool validDevice(CUdevice d);
// The host index behind a valid device of this process.
inline int hostDevice(CUdevice d) { return drv().visible[d]; }
// The time-slice board a device's work takes turns on: the GPU's, or a MIG device's own (compute
// instances run side by side, each on its SMs).
inline int boardDevice(CUdevice d) {
  const Driver::Mig& m = drv().mig;
  return m.on ? mig::migBoard(m.host, m.gi, m.ci) : hostDevice(d);
}

// ---------------------------------------------------------------------------------------------
// Memory registry: every range of simulated device memory (and registered/pinned host memory).
enum class MemKind : uint8_t { kDevice, kManaged, kHostPinned, kHostRegistered, kPool, kVmm, kGlobal, kGraph };
struct Allocation {
  uintptr_t base = 0;
  size_t size = 0;
  int device = 0;
  MemKind kind = MemKind::kDevice;
  Context* ctx = nullptr;
  unsigned flags = 0;
  uint64_t accounted = 0;   // bytes counted against the device in the shared state
  void* mapping = nullptr;  // what to give back to the OS
  size_t mappingSize = 0;
  unsigned long long id = 0;
  void* owner = nullptr;    // pool / vmm handle owning it, if any
};
void registryAdd(const Allocation& a);
bool registryRemove(uintptr_t base, Allocation* out);
// The allocation containing p, if any.
bool registryFind(uintptr_t p, Allocation* out);
void registryForEach(const std::function<void(const Allocation&)>& f);

// Host memory for a simulated device allocation: zero-filled, aligned, lazily committed.
// low32: in the low 2 GiB of the address space, for the first ABI's 32-bit device pointers.
void* hostMap(size_t bytes, size_t* mapped, bool low32 = false);
void hostUnmap(void* p, size_t mapped);
// Accounting against the simulated device (host-wide).
bool deviceReserve(int dev, uint64_t bytes);
void deviceRelease(int dev, uint64_t bytes);
// Allocates plain device memory on the current context's device (cuMemAlloc semantics).
CUresult allocDevice(size_t bytes, MemKind kind, unsigned flags, CUdeviceptr* out, bool low32 = false);
CUresult freeDevice(CUdeviceptr p);
unsigned long long nextId();
// Managed memory's residency (managed.cpp): a new allocation (on the host until populated), one
// freed (its resident chunks leave the device), and a launch on device ordinal whose arguments
// may point into managed allocations (the touch that populates them).
void managedCreate(uintptr_t base, uint64_t size);
void managedDestroy(uintptr_t base);
uint64_t managedTouch(int ordinal, const std::vector<std::vector<char>>& args);
bool managedInUse();  // the process has managed allocations (a launch's arguments may reach them)

// ---------------------------------------------------------------------------------------------
// Streams, events and the engine
struct Graph;
struct GraphNode;
struct Event {
  Context* ctx = nullptr;
  unsigned flags = 0;
  bool recorded = false;
  Stream* stream = nullptr;  // where it was last recorded
  uint64_t seq = 0;          // the record operation's sequence number on that stream
  // Device time (ms) at which the record operation executed. Shared with the queued record
  // operation, which may run after cuEventDestroy (legal: PyTorch records an event, makes another
  // stream wait on it and destroys it at once); the operation must never touch the Event itself.
  std::shared_ptr<std::atomic<double>> timeMs = std::make_shared<std::atomic<double>>(0.0);
  // Capture: the nodes that the record point depends on, when recorded in a capturing stream.
  Graph* captureGraph = nullptr;
  Stream* captureOrigin = nullptr;
  std::vector<GraphNode*> captureDeps;
};
struct Stream {
  Context* ctx = nullptr;
  unsigned flags = 0;
  int priority = 0;
  unsigned long long id = 0;
  // Capture state
  CUstreamCaptureStatus captureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
  CUstreamCaptureMode captureMode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  Graph* captureGraph = nullptr;
  Stream* captureOrigin = nullptr;
  unsigned long long captureId = 0;
  std::vector<GraphNode*> captureDeps;  // the frontier new nodes depend on
  // Work queue (stream.cpp)
  std::mutex qmu;
  std::condition_variable qcv;
  std::deque<std::function<void()>> queue;
  uint64_t submitted = 0;               // under qmu
  std::atomic<uint64_t> completed{0};   // written under the progress mutex
  int workerGen = -1;                   // fork generation the worker was started in
  CUresult error = CUDA_SUCCESS;        // first asynchronous failure, reported at synchronisation
  std::atomic<uint64_t> lastDoneNs{0};  // device time its last completed operation ended (worker)
  // Where operation n ended, at doneAt[n % kDoneRing] (written before `completed` counts it): a
  // stream that waits for operation n continues there, not where this stream got to since.
  static constexpr size_t kDoneRing = 256;
  std::array<std::atomic<uint64_t>, kDoneRing> doneAt{};
  bool blocking() const { return (flags & CU_STREAM_NON_BLOCKING) == 0; }
};
// Stream bookkeeping
void streamRegister(Stream* s);
// Waits until s has completed operation number seq.
void waitStream(Stream* s, uint64_t seq);
// Resolves a stream handle (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a stream).
CUresult resolveStream(CUstream h, Stream** out);
// RAII set by the generated _ptds/_ptsz entry points.
struct PerThreadStreamScope {
  PerThreadStreamScope();
  ~PerThreadStreamScope();
  bool prev;
};

// Device time (device_time.cpp, engine.h). deviceNowNs: CLOCK_MONOTONIC / SIMGPU_TIME_SCALE.
uint64_t deviceNowNs();
// In a stream worker: the device time the executing operation has reached. streamExecBegin marks
// the start of an operation of s at ns; a wait moves the position forward with AtLeast.
void streamExecBegin(const struct Stream* s, uint64_t ns);
uint64_t streamPositionNs();
void streamPositionAtLeast(uint64_t ns);
// How a context appears to the engine: its time-slice group, SM cap (0: all) and client priority.
struct EngineContextParams {
  uint64_t group = 0;
  uint32_t smCap = 0;
  int clientPriority = 0;
};
EngineContextParams engineContextParams(const struct Context* c);
inline constexpr uint32_t kReservedSharedPerBlock = 1024;  // shared memory the system keeps per block (cc 8.0+)

// An operation on a stream. `run` performs it; returns the CUDA status of doing so.
struct Op {
  enum Type { kKernel, kMemcpy, kMemset, kHost, kEventRecord, kWait, kMemAlloc, kMemFree, kEmpty } type = kEmpty;
  std::function<CUresult()> run;
  // Recorded form for graph capture (see graph.cpp).
  struct KernelParams* kernel = nullptr;
  CUDA_MEMCPY3D copy = {};
  CUDA_MEMSET_NODE_PARAMS memset = {};
  CUDA_HOST_NODE_PARAMS host = {};
};
// Queues (or, while capturing, records) op on stream s. *seq receives its sequence number.
CUresult submit(Stream* s, Op&& op, uint64_t* seq = nullptr);
// Queues op and waits for it: the synchronous API forms. Returns the op's own status.
CUresult submitAndWait(Stream* s, Op&& op);
// Waits for all work on s (instant in the synchronous model) and applies pool release thresholds.
CUresult streamSync(Stream* s);
CUresult contextSync(Context* c);
void poolsOnSync(int device);

// ---------------------------------------------------------------------------------------------
// Kernels
struct ParamInfo {
  uint32_t offset;
  uint32_t size;
};
struct Module;
struct Function {
  Module* module = nullptr;
  std::string name;
  void* hostFn = nullptr;  // simgpu_host_<name>, if the program supplies one
  bool paramsKnown = false;
  std::vector<ParamInfo> params;  // by ordinal
  int maxThreads = 1024;
  int sharedSizeBytes = 0;
  int maxDynamicShared = 48 * 1024;
  bool nonPortableClusters = false;
  // Device time: registers per thread and static shared memory from the cubin (0: unknown), and
  // the cost rule that matched (SIMGPU_KERNEL_COSTS): a fixed block time or a parameter's value.
  uint32_t registers = 0;
  uint32_t staticShared = 0;
  uint64_t blockNs = 0;
  int costParam = -1;
  uint32_t probeKind = 0;  // a cushare probe kernel (cushare/probe_abi.h): run by its native twin
  CUfunction asFunction() { return reinterpret_cast<CUfunction>(this); }
};
struct KernelParams {
  Function* fn = nullptr;
  unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1};
  unsigned sharedMem = 0;
  int device = 0;
  std::vector<std::vector<char>> args;  // copies of each argument (capture)
  std::vector<void*> argPtrs;
  bool extraBuffer = false;  // args[0] is a packed CU_LAUNCH_PARAM_BUFFER
  bool forGraph = false;     // a graph node: arguments must be copied, there is no fallback
  uint64_t blockNs = 0;      // each block's modelled time, fixed at launch (the cost rule)
  uint64_t faultNs = 0;      // device time its launch's managed-memory migrations take before it starts
  bool queued = false;       // counted by deviceKernelQueued (a stream launch, not a graph node)
};
// A kernel was queued on a stream of device dev: its process wants the device (time slicing).
void deviceKernelQueued(int dev);
// Whether one block of f with this shape fits an empty SM (else the launch is out of resources).
bool blockFitsSm(const Function* f, const unsigned block[3], unsigned sharedMem);
// Runs k's blocks on the device engine (an MPS client: its server's) and waits, in the calling
// stream worker, until they end. Fails only for an MPS client whose server is gone or that was
// terminated (the MPS error).
CUresult deviceExecute(const KernelParams& k);
// The probe kernels' twins (probe_launch.cpp, model in probe_twin.h). probeKindOf: the ProbeKind
// of a kernel name, 0 for any other kernel. probeBegin: reads and checks a probe launch's
// arguments (writes the kProbeBadArgs record; an address outside device memory is the process's
// sticky CUDA_ERROR_ILLEGAL_ADDRESS); probeShape: its engine shape (time-boxed, traced);
// probeEnd: writes the records the engine's traces give.
struct BlockTrace;
struct KernelShape;
struct ProbeLaunch {
  uint32_t kind = 0;   // 0: not a probe
  bool valid = false;  // its arguments pass the kernel's checks
  cushare::probe::ProbeArgs args{};
};
uint32_t probeKindOf(const std::string& name);
CUresult probeBegin(const KernelParams& k, ProbeLaunch* p);
void probeShape(const ProbeLaunch& p, KernelShape* s);
CUresult probeEnd(const KernelParams& k, const ProbeLaunch& p, const std::vector<BlockTrace>& traces);
// Copies a launch's arguments into k (for graphs); runs a kernel from such a copy.
CUresult copyKernelArgs(KernelParams* k, void** params, void** extra);
CUresult runKernelCopy(KernelParams& k);
CUresult launchKernel(Stream* s, Function* f, const unsigned grid[3], const unsigned block[3],
                      unsigned sharedMem, void** params, void** extra);
CUresult runKernel(const KernelParams& k, void** params, void** extra);

// ---------------------------------------------------------------------------------------------
// Graph capture hooks (graph.cpp)
CUresult captureRecord(Stream* s, Op&& op);
void captureJoin(Graph* g, Stream* s);  // s joined g's capture through an event
bool anyGlobalCaptureActive();

// Copies (memcpy.cpp)
// With execute = false only validate (what a submission does before queueing).
CUresult copy3D(const CUDA_MEMCPY3D& c, bool execute = true);
CUresult setMemory(const CUDA_MEMSET_NODE_PARAMS& m, bool execute = true, bool checkRange = true);

}  // namespace simgpu

namespace simgpu {
// Arrays (array.cpp): where an array's texels live, for copies.
struct ArrayLayout {
  char* data;
  size_t rowPitch;    // bytes per row
  size_t height;      // rows per slice
  size_t depth;
  size_t widthBytes;  // bytes per row that hold texels
};
bool arrayLayout(CUarray a, ArrayLayout* out);
}  // namespace simgpu

namespace simgpu {
// Graph memory (graph.cpp): stream-ordered allocations made while capturing, and their frees.
CUresult captureAlloc(Stream* s, size_t size, CUdeviceptr* out);
CUresult captureFree(Stream* s, CUdeviceptr p);
bool graphMemFree(CUdeviceptr p);
// Returns a pool block at once (cuMemFree of stream-ordered memory).
CUresult poolFreeNow(CUdeviceptr p);
}  // namespace simgpu
