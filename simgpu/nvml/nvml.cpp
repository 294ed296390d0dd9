// simgpu's libnvidia-ml.so.1: initialisation, shutdown, error strings and system-wide queries.
//
// The devices NVML reports are the simulated driver's: the same SIMGPU_* configuration
// (simgpu::loadConfig) and the same host-wide state file (simgpu::SharedState), so memory and
// process queries see every process's allocations.
//
// Invariants (see nvml_internal.h): the state is built once under the init mutex, before the
// reference count first becomes positive, and is never freed; nvmlInit/nvmlShutdown only move the
// count. A failed first init builds nothing and prints its reason to stderr once.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <new>
#include <string>

#include "config.h"
#include "nvml_internal.h"

namespace simgpu::nvml {
namespace {

struct Globals {
  std::mutex mu;                // serialises init and shutdown
  int refs = 0;                 // guarded by mu
  std::atomic<int> live{0};     // mirror of refs for lock-free "initialized?" checks
  bool built = false;           // guarded by mu; true once devs/st are set, forever after
  int count = 0;
  nvmlDevice_st* devs = nullptr;
  nvmlDevice_st* migDevs = nullptr;  // count x kMaxMigDevices MIG device handles
  const mig::Model* model = nullptr;
  std::string stateDir;
  SharedState* st = nullptr;
  std::string lastError;        // guarded by mu; the last error printed, so each prints once
};

Globals& g() {
  static Globals* p = new Globals;  // leaked on purpose: callers may reach us during exit
  return *p;
}

void reportOnce(Globals& s, std::string msg) {
  if (msg.rfind("simgpu", 0) != 0) msg = "simgpu: " + msg;
  if (msg == s.lastError) return;
  std::fprintf(stderr, "%s\n", msg.c_str());
  s.lastError = std::move(msg);
}

// Builds the device records. Called with mu held, only until it first succeeds.
nvmlReturn_t build(Globals& s) {
  Config cfg;
  std::string err;
  if (!loadConfig(&cfg, &err)) {
    reportOnce(s, err);
    return NVML_ERROR_UNKNOWN;
  }
  SharedState* st = SharedState::open(cfg.stateDir, cfg.deviceCount, cfg.memory, cfg.smCount, &err);
  if (!st) {
    reportOnce(s, err);
    return NVML_ERROR_UNKNOWN;
  }
  // The container's devices (all the host's outside one), numbered from 0; CUDA_VISIBLE_DEVICES
  // does not apply to NVML. Leaked: handles point into it forever.
  auto* devs = new nvmlDevice_st[cfg.containerCount > 0 ? cfg.containerCount : 1]();
  for (int i = 0; i < cfg.containerCount; ++i) {
    const int d = cfg.container[i];
    nvmlDevice_st& r = devs[i];
    r.ordinal = i;
    r.host = d;
    r.pciBus = devicePciBus(d);
    std::snprintf(r.name, sizeof r.name, "%s", cfg.name.c_str());
    std::snprintf(r.uuid, sizeof r.uuid, "%s", deviceUuidString(d).c_str());
    std::snprintf(r.serial, sizeof r.serial, "165202200%04d", d);
    std::snprintf(r.busId, sizeof r.busId, NVML_DEVICE_PCI_BUS_ID_FMT, 0u, r.pciBus, 0u);
    std::snprintf(r.busIdLegacy, sizeof r.busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, 0u, r.pciBus, 0u);
    std::string boardErr;
    r.board = openBoard(cfg.stateDir, d, &boardErr);  // null: utilisation reads 0
    r.timeScale = cfg.timeScale;
  }
  auto* migDevs = new nvmlDevice_st[static_cast<size_t>(cfg.containerCount > 0 ? cfg.containerCount : 1) *
                                    mig::kMaxMigDevices]();
  for (int i = 0; i < cfg.containerCount; ++i)
    for (int j = 0; j < mig::kMaxMigDevices; ++j) {
      nvmlDevice_st& m = migDevs[i * mig::kMaxMigDevices + j];
      m = devs[i];
      m.migParent = i;
      m.migIndex = static_cast<unsigned>(j);
    }
  s.devs = devs;
  s.migDevs = migDevs;
  s.model = cfg.model;
  s.stateDir = cfg.stateDir;
  s.st = st;
  s.count = cfg.containerCount;
  s.built = true;
  return NVML_SUCCESS;
}

nvmlReturn_t initImpl() {
  Globals& s = g();
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.built) {
      const nvmlReturn_t r = build(s);
      if (r != NVML_SUCCESS) return r;
    }
    ++s.refs;
    s.live.store(s.refs, std::memory_order_release);
    return NVML_SUCCESS;
  } catch (const std::bad_alloc&) {
    return NVML_ERROR_MEMORY;
  } catch (...) {
    return NVML_ERROR_UNKNOWN;
  }
}

// The element of table[0..n) that handle points at exactly, or nullptr. Integer arithmetic, not
// pointer comparison: the handle may point anywhere.
nvmlDevice_st* inTable(nvmlDevice_t handle, nvmlDevice_st* table, size_t n) {
  if (!handle || !table) return nullptr;
  const auto p = reinterpret_cast<uintptr_t>(handle);
  const auto base = reinterpret_cast<uintptr_t>(table);
  if (p < base) return nullptr;
  const uintptr_t off = p - base;
  if (off % sizeof(nvmlDevice_st) != 0 || off / sizeof(nvmlDevice_st) >= n) return nullptr;
  return &table[off / sizeof(nvmlDevice_st)];
}

}  // namespace

bool initialized() { return g().live.load(std::memory_order_acquire) > 0; }
int deviceCount() { return g().count; }
nvmlDevice_st* device(int ordinal) { return &g().devs[ordinal]; }
SharedState* state() { return g().st; }
const mig::Model* model() { return g().model; }
const std::string& stateDir() { return g().stateDir; }
nvmlDevice_st* migHandle(int parent, unsigned index) {
  return &g().migDevs[static_cast<size_t>(parent) * mig::kMaxMigDevices + index];
}

// A MIG device handle of ours, or nullptr.
nvmlDevice_st* fromMigHandle(nvmlDevice_t handle) {
  Globals& s = g();
  return inTable(handle, s.migDevs, static_cast<size_t>(s.count) * mig::kMaxMigDevices);
}

nvmlDevice_st* fromHandle(nvmlDevice_t handle) {
  Globals& s = g();
  return inTable(handle, s.devs, static_cast<size_t>(s.count));
}

nvmlReturn_t checkDevice(nvmlDevice_t handle, nvmlDevice_st** out) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  nvmlDevice_st* d = fromHandle(handle);
  if (!d) return NVML_ERROR_INVALID_ARGUMENT;
  *out = d;
  return NVML_SUCCESS;
}

nvmlReturn_t copyString(const char* src, char* dst, unsigned int length) {
  if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
  const size_t n = std::strlen(src);
  if (n + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  std::memcpy(dst, src, n + 1);
  return NVML_SUCCESS;
}

}  // namespace simgpu::nvml

using namespace simgpu::nvml;

SIMGPU_NVML_API nvmlReturn_t nvmlInit_v2(void) { return initImpl(); }
SIMGPU_NVML_API nvmlReturn_t nvmlInit(void) { return initImpl(); }
// Flags only relax what real NVML requires of the GPUs (NO_GPUS, NO_ATTACH); simgpu's devices are
// always present and attached, so every flag is accepted and changes nothing.
SIMGPU_NVML_API nvmlReturn_t nvmlInitWithFlags(unsigned int) { return initImpl(); }

SIMGPU_NVML_API nvmlReturn_t nvmlShutdown(void) {
  Globals& s = g();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.refs == 0) return NVML_ERROR_UNINITIALIZED;
  --s.refs;
  s.live.store(s.refs, std::memory_order_release);
  return NVML_SUCCESS;
}

SIMGPU_NVML_API const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
      return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Ran out of critical resources, other than memory";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "The requested frequency is not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "The requested functionality has been deprecated";
    case NVML_ERROR_NOT_READY: return "The system is not ready for the request";
    case NVML_ERROR_GPU_NOT_FOUND: return "No GPUs were found";
    case NVML_ERROR_INVALID_STATE: return "Resource not in correct state to perform requested operation";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset not supported for given device/parameters";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
  }
  return "Unknown Error";
}

SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  return copyString(kDriverVersion, version, length);
}

SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char* version, unsigned int length) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  return copyString(kNvmlVersion, version, length);
}

SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int* cudaDriverVersion) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
  *cudaDriverVersion = kCudaDriverVersion;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int* cudaDriverVersion) {
  return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

// The process's command (argv[0] from /proc, else its comm), truncated to fit, as NVML does.
SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char* name, unsigned int length) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!name || length == 0) return NVML_ERROR_INVALID_ARGUMENT;
  char buf[4096];
  size_t n = 0;
  for (const char* file : {"cmdline", "comm"}) {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%u/%s", pid, file);
    FILE* f = std::fopen(path, "re");
    if (!f) {
      if (access(path, F_OK) == 0) return NVML_ERROR_NO_PERMISSION;
      return NVML_ERROR_NOT_FOUND;
    }
    n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    n = std::strlen(buf);                                  // argv[0] ends at the first NUL
    while (n > 0 && buf[n - 1] == '\n') buf[--n] = '\0';  // comm ends with a newline
    if (n > 0) break;                                      // kernel threads have no cmdline
  }
  if (n >= length) n = length - 1;
  std::memcpy(name, buf, n);
  name[n] = '\0';
  return NVML_SUCCESS;
}

// Confidential computing is off, as on an H100 outside a CC environment. NCCL reads this to decide
// whether it may use its host-visible work FIFO.
SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetConfComputeState(nvmlConfComputeSystemState_t* st) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!st) return NVML_ERROR_INVALID_ARGUMENT;
  st->environment = NVML_CC_SYSTEM_ENVIRONMENT_UNAVAILABLE;
  st->ccFeature = NVML_CC_SYSTEM_FEATURE_DISABLED;
  st->devToolsMode = NVML_CC_SYSTEM_DEVTOOLS_MODE_OFF;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlSystemGetConfComputeSettings(nvmlSystemConfComputeSettings_t* st) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!st) return NVML_ERROR_INVALID_ARGUMENT;
  if (st->version != nvmlSystemConfComputeSettings_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  st->environment = NVML_CC_SYSTEM_ENVIRONMENT_UNAVAILABLE;
  st->ccFeature = NVML_CC_SYSTEM_FEATURE_DISABLED;
  st->devToolsMode = NVML_CC_SYSTEM_DEVTOOLS_MODE_OFF;
  st->multiGpuMode = NVML_CC_SYSTEM_MULTIGPU_NONE;
  return NVML_SUCCESS;
}
