// Driver initialisation, devices and their attributes, handle registry, tracing, error strings,
// and the entry points for unimplemented functions.
#include <dlfcn.h>
#include <unistd.h>

#include <strings.h>

#include <cstring>
#include <mutex>
#include <string_view>

#include "driver.h"
#include "mig.h"
#include "mps_client.h"

namespace simgpu {

Driver& drv() {
  static Driver* d = new Driver;  // leaked: cudart's exit-time teardown still calls into the driver
  return *d;
}

bool traceOn() { return drv().cfg.trace; }

void traceWrite(const char* fn, const std::string& args) {
  std::fprintf(stderr, "[simgpu %d] %s(%s)\n", static_cast<int>(getpid()), fn, args.c_str());
}

CUresult initStatus() {
  switch (drv().initState.load(std::memory_order_acquire)) {
    case 1:
      return CUDA_SUCCESS;
    case 2:
      return drv().initResult;
    default:
      return CUDA_ERROR_NOT_INITIALIZED;
  }
}

// ---- handles ----
namespace {
struct HandleTable {
  std::shared_mutex mu;
  std::unordered_map<const void*, HandleType> map;
};
HandleTable& handles() {
  static HandleTable* t = new HandleTable;
  return *t;
}
std::atomic<unsigned long long> gNextId{1};
}  // namespace

unsigned long long nextId() { return gNextId.fetch_add(1, std::memory_order_relaxed); }

void handleAdd(const void* h, HandleType t) {
  std::unique_lock g(handles().mu);
  handles().map[h] = t;
}
void handleRemove(const void* h) {
  std::unique_lock g(handles().mu);
  handles().map.erase(h);
}
bool handleIs(const void* h, HandleType t) {
  if (!h) return false;
  std::shared_lock g(handles().mu);
  auto it = handles().map.find(h);
  return it != handles().map.end() && it->second == t;
}

int deviceCount() { return drv().visibleCount; }
bool validDevice(CUdevice d) { return d >= 0 && d < deviceCount(); }

namespace {
// Host implementations of kernels from SIMGPU_KERNELS libraries are looked up through these.
void loadKernelLibraries() {
  const char* v = std::getenv("SIMGPU_KERNELS");
  if (!v || !*v) return;
  std::string s(v);
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t c = s.find(':', pos);
    if (c == std::string::npos) c = s.size();
    std::string path = s.substr(pos, c - pos);
    if (!path.empty() && !dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL))
      std::fprintf(stderr, "simgpu: SIMGPU_KERNELS: cannot load %s: %s\n", path.c_str(), dlerror());
    pos = c + 1;
  }
}

// MIG (docs/simgpu.md, "MIG"), on a board of a known model: a process enters the MIG device that
// the first MIG-... entry of CUDA_VISIBLE_DEVICES names, and then sees only it (one MIG device per
// process, the rule before driver R570), with the instance's name, SMs and memory; an entry that
// names no MIG device leaves no device. Without such an entry the GPUs in MIG mode are hidden: CUDA
// runs on a MIG-enabled GPU only inside one of its MIG devices. False on a broken MIG state file.
bool chooseMigDevice(Driver& d) {
  mig::State st;
  std::string err;
  if (!mig::load(d.cfg.stateDir, &st, &err)) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return false;
  }
  const std::string first = mig::firstMigEntry(std::getenv("CUDA_VISIBLE_DEVICES"));
  if (!first.empty()) {
    int host = 0;
    mig::MigDevice m;
    d.visibleCount = 0;
    if (!mig::findMigDevice(*d.cfg.model, st, d.cfg.container, d.cfg.containerCount, first, &host, &m)) return true;
    // In use from here on (a destroy is refused), then checked again: an instance destroyed
    // between the first look and now is left at once (NVML's destroy checks the users under the
    // state's lock, so one of the two sees the other).
    if (!d.state->enterMig(host, m.gi, m.ci, m.giProfile->memoryMiB << 20)) return true;
    mig::MigDevice again;
    int hostAgain = 0;
    if (!mig::load(d.cfg.stateDir, &st, &err) ||
        !mig::findMigDevice(*d.cfg.model, st, d.cfg.container, d.cfg.containerCount, first, &hostAgain, &again) ||
        hostAgain != host || again.gi != m.gi || again.ci != m.ci) {
      d.state->leaveMig();
      return true;
    }
    d.visible[0] = host;
    d.visibleCount = 1;
    d.mig = {true, host, m.gi, m.ci};
    d.cfg.name = mig::migDeviceName(*d.cfg.model, m);
    d.cfg.smCount = m.ciProfile.sms;
    d.cfg.memory[host] = m.giProfile->memoryMiB << 20;
    return true;
  }
  int kept = 0;
  for (int i = 0; i < d.visibleCount; ++i)
    if (st.dev[d.visible[i]].current != 1) d.visible[kept++] = d.visible[i];
  d.visibleCount = kept;
  return true;
}

void doInit() {
  Driver& d = drv();
  std::string err;
  if (!loadConfig(&d.cfg, &err)) {
    std::fprintf(stderr, "%s\n", err.c_str());
    d.initResult = CUDA_ERROR_NOT_INITIALIZED;
    d.initState.store(2, std::memory_order_release);
    return;
  }
  d.state = SharedState::open(d.cfg.stateDir, d.cfg.deviceCount, d.cfg.memory, d.cfg.smCount, &err);
  if (!d.state) {
    std::fprintf(stderr, "simgpu: %s\n", err.c_str());
    d.initResult = CUDA_ERROR_NOT_INITIALIZED;
    d.initState.store(2, std::memory_order_release);
    return;
  }
  d.visibleCount = visibleDevices(d.cfg, std::getenv("CUDA_VISIBLE_DEVICES"), d.visible);
  if (d.cfg.model && !chooseMigDevice(d)) {
    d.initResult = CUDA_ERROR_NOT_INITIALIZED;
    d.initState.store(2, std::memory_order_release);
    return;
  }
  if (d.visibleCount == 0) {  // as the real driver: nothing to initialise
    d.initResult = CUDA_ERROR_NO_DEVICE;
    d.initState.store(2, std::memory_order_release);
    return;
  }
  loadKernelLibraries();
  // A client of the simulated MPS if a control daemon answers (inside a MIG device: that MIG
  // device's server only).
  mpsAttach(d.cfg, d.mig.on ? mig::migTag(d.mig.host, d.mig.gi, d.mig.ci) : 0);
  // Not over a sticky MPS error (terminated or faulted) the client may already have received.
  int notYet = 0;
  d.initState.compare_exchange_strong(notYet, 1, std::memory_order_release);
}
}  // namespace

// An MPS client's pinned memory limit is checked first: beyond it, out of memory.
bool deviceReserve(int dev, uint64_t bytes) {
  if (!mpsReserve(dev, bytes)) return false;
  if (drv().state->reserve(hostDevice(dev), bytes)) return true;
  mpsRelease(dev, bytes);
  return false;
}
void deviceRelease(int dev, uint64_t bytes) {
  drv().state->release(hostDevice(dev), bytes);
  mpsRelease(dev, bytes);
}

}  // namespace simgpu

using namespace simgpu;

// Every entry point simgpu does not model (simgpu/driver_api_cuda13.txt gives its answer): not
// initialised before cuInit, as the real driver, then the listed answer.
extern "C" SIMGPU_EXPORT int simgpu_unimplemented(const char* name, int answer) {
  if (const CUresult r = initStatus(); r != CUDA_SUCCESS) return r;
  if (traceOn())
    std::fprintf(stderr, "[simgpu %d] %s: not modelled by simgpu; answers %d\n", static_cast<int>(getpid()), name, answer);
  return answer;
}

CU_EXPORT CUresult cuInit(unsigned int flags) {
  // Trace is known only after the configuration is read; read it first.
  static std::once_flag once;
  std::call_once(once, doInit);
  SIMGPU_TRACE(flags);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  return initStatus();
}

CU_EXPORT CUresult cuDriverGetVersion(int* v) {
  SIMGPU_TRACE(v);
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  *v = kDriverVersion;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetCount(int* count) {
  API_ENTER(count);
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = deviceCount();
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
  API_ENTER(dev, ordinal);
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *dev = ordinal;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  API_ENTER(name, len, dev);
  if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, static_cast<size_t>(len), "%s", drv().cfg.name.c_str());
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  API_ENTER(bytes, dev);
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = drv().cfg.memory[hostDevice(dev)];
  return CUDA_SUCCESS;
}

// Inside a MIG device, its MIG UUID ("uniquely identifies the subscribed MIG compute instance",
// cuda-python's documentation of cuDeviceGetUuid_v2).
CU_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
  API_ENTER(uuid, dev);
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  const Driver::Mig& m = drv().mig;
  if (m.on) mig::migUuidBytes(m.host, m.gi, m.ci, reinterpret_cast<unsigned char*>(uuid->bytes));
  else deviceUuid(hostDevice(dev), reinterpret_cast<unsigned char*>(uuid->bytes));
  return CUDA_SUCCESS;
}
// The first ABI: the GPU's UUID, in a MIG device too ([unverified], docs/simgpu.md).
extern "C" SIMGPU_EXPORT CUresult simgpu_cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) __asm__("cuDeviceGetUuid");
CUresult simgpu_cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  API_ENTER(uuid, dev);
  if (!uuid) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  deviceUuid(hostDevice(dev), reinterpret_cast<unsigned char*>(uuid->bytes));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetLuid(char* luid, unsigned int* mask, CUdevice dev) {
  API_ENTER(luid, mask, dev);
  return CUDA_ERROR_NOT_SUPPORTED;  // Windows only
}

CU_EXPORT CUresult cuDeviceGetPCIBusId(char* busId, int len, CUdevice dev) {
  API_ENTER(busId, len, dev);
  if (!busId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  // The driver's form has a 4-digit domain ("0000:18:00.0"); NVML's has 8 digits.
  std::snprintf(busId, static_cast<size_t>(len), "0000:%02x:00.0", devicePciBus(hostDevice(dev)));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice* dev, const char* busId) {
  API_ENTER(dev, busId);
  if (!dev || !busId) return CUDA_ERROR_INVALID_VALUE;
  unsigned domain = 0, bus = 0, device = 0, fn = 0;
  if (std::sscanf(busId, "%x:%x:%x.%x", &domain, &bus, &device, &fn) != 4 &&
      std::sscanf(busId, "%x:%x.%x", &bus, &device, &fn) != 3)
    return CUDA_ERROR_INVALID_VALUE;
  for (int d = 0; d < deviceCount(); ++d)
    if (devicePciBus(hostDevice(d)) == bus && domain == 0 && device == 0) {
      *dev = d;
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_INVALID_DEVICE;
}

namespace {
bool deviceAttribute(CUdevice_attribute a, int dev, int* out) {
  const Config& c = drv().cfg;
  int v = 0;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = mpsVisibleSms(static_cast<int>(c.smCount)); break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: v = CU_COMPUTEMODE_DEFAULT; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_WIDTH: v = 131072; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_WIDTH: v = 131072; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_HEIGHT: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_WIDTH: v = 16384; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_HEIGHT: v = 16384; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE3D_DEPTH: v = 16384; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_WIDTH: v = 32768; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_HEIGHT: v = 32768; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LAYERED_LAYERS: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = static_cast<int>(devicePciBus(hostDevice(dev))); break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 50331648; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 3; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LAYERED_WIDTH: v = 32768; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_LAYERED_LAYERS: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_WIDTH: v = 131072; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_HEIGHT: v = 65000; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_LINEAR_PITCH: v = 2097120; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH: v = 32768; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE2D_MIPMAPPED_HEIGHT: v = 32768; break;
    case CU_DEVICE_ATTRIBUTE_MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH: v = 32768; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID: v = hostDevice(dev); break;
    case CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO: v = 2; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: v = 232448; break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE: v = 32505856; break;
    case CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE: v = 134213632; break;
    case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: v = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; break;
    case CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEM_SYNC_DOMAIN_COUNT: v = 4; break;
    case CU_DEVICE_ATTRIBUTE_TENSOR_MAP_ACCESS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_FUNCTION_POINTERS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_NUMA_ID: v = -1; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: v = -1; break;
    case CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID: v = 0x233010de; break;
    case CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID: v = 0x16c110de; break;
    default:
      if (static_cast<int>(a) <= 0 || a >= CU_DEVICE_ATTRIBUTE_MAX) return false;
      v = 0;  // a feature simgpu does not have (graphics interop, RDMA, multicast, ...)
  }
  *out = v;
  return true;
}
}  // namespace

CU_EXPORT CUresult cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  API_ENTER(pi, attrib, dev);
  if (!pi) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  return deviceAttribute(attrib, dev, pi) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CU_EXPORT CUresult cuDeviceComputeCapability(int* major, int* minor, CUdevice dev) {
  API_ENTER(major, minor, dev);
  if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *major = 9;
  *minor = 0;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetProperties(CUdevprop* p, CUdevice dev) {
  API_ENTER(p, dev);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *p = {};
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->sharedMemPerBlock = 49152;
  p->totalConstantMemory = 65536;
  p->SIMDWidth = 32;
  p->memPitch = 2147483647;
  p->regsPerBlock = 65536;
  p->clockRate = 1980000;
  p->textureAlign = 512;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetP2PAttribute(int* value, CUdevice_P2PAttribute attrib, CUdevice src, CUdevice dst) {
  API_ENTER(value, attrib, src, dst);
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(src) || !validDevice(dst) || src == dst) return CUDA_ERROR_INVALID_DEVICE;
  switch (attrib) {
    case CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK: *value = 0; break;
    case CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED: *value = 1; break;
    case CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED: *value = 0; break;
    case CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED: *value = 1; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceCanAccessPeer(int* can, CUdevice dev, CUdevice peer) {
  API_ENTER(can, dev, peer);
  if (!can) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev) || !validDevice(peer)) return CUDA_ERROR_INVALID_DEVICE;
  *can = dev != peer ? 1 : 0;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetTexture1DLinearMaxWidth(size_t* w, CUarray_format fmt, unsigned nch, CUdevice dev) {
  API_ENTER(w, fmt, nch, dev);
  if (!w) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *w = 1ull << 27;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuFlushGPUDirectRDMAWrites(CUflushGPUDirectRDMAWritesTarget t, CUflushGPUDirectRDMAWritesScope s) {
  API_ENTER(t, s);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDeviceGetExecAffinitySupport(int* pi, CUexecAffinityType type, CUdevice dev) {
  API_ENTER(pi, type, dev);
  if (!pi) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *pi = 0;
  return CUDA_SUCCESS;
}

// ---- errors ----
namespace {
struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_PROFILER_DISABLED, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled while using an external profiling tool"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_DEVICE_NOT_LICENSED, "CUDA_ERROR_DEVICE_NOT_LICENSED", "device doesn't have valid Grid license"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_UNMAP_FAILED, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {CUDA_ERROR_ALREADY_ACQUIRED, "CUDA_ERROR_ALREADY_ACQUIRED", "resource already acquired"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "cannot set while device is active in this process"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {CUDA_ERROR_INVALID_SOURCE, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_MERGE, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences"},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began"},
    {CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
    {CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_SYSTEM_NOT_READY, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
}  // namespace

CU_EXPORT CUresult cuGetErrorName(CUresult error, const char** str) {
  SIMGPU_TRACE(error, str);
  if (!str) return CUDA_ERROR_INVALID_VALUE;
  for (const ErrorText& e : kErrors)
    if (e.code == error) {
      *str = e.name;
      return CUDA_SUCCESS;
    }
  *str = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}

CU_EXPORT CUresult cuGetErrorString(CUresult error, const char** str) {
  SIMGPU_TRACE(error, str);
  if (!str) return CUDA_ERROR_INVALID_VALUE;
  for (const ErrorText& e : kErrors)
    if (e.code == error) {
      *str = e.text;
      return CUDA_SUCCESS;
    }
  *str = nullptr;
  return CUDA_ERROR_INVALID_VALUE;
}
