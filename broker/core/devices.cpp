// See devices.h.
#include "core/devices.h"

#include <dlfcn.h>

#include "cushare/nvml_api.h"

namespace cushare::broker {
namespace {

int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

struct Nvml {
  void* lib = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  nvmlReturn_t (*count)(unsigned*) = nullptr;
  nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*compute)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  nvmlReturn_t (*mps)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  const char* (*errorString)(nvmlReturn_t) = nullptr;

  std::string describe(nvmlReturn_t r) const {
    return errorString ? errorString(r) : "NVML error " + std::to_string(static_cast<int>(r));
  }
};

template <class F>
bool bind(void* lib, const char* name, F* out, std::string* err) {
  *out = reinterpret_cast<F>(::dlsym(lib, name));
  if (*out == nullptr) *err = std::string("NVML has no ") + name;
  return *out != nullptr;
}

// One NVML process list (the buffer protocol: grow and ask again while it is too small), added
// to out.
nvmlReturn_t addProcesses(nvmlReturn_t (*list)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*), nvmlDevice_t h,
                          std::map<int, uint64_t>* out) {
  std::vector<nvmlProcessInfo_t> infos(64);
  for (;;) {
    unsigned n = static_cast<unsigned>(infos.size());
    const nvmlReturn_t r = list(h, &n, infos.data());
    if (r == NVML_ERROR_INSUFFICIENT_SIZE && n > infos.size()) {
      infos.resize(n + 16);
      continue;
    }
    if (r != NVML_SUCCESS) return r;
    for (unsigned i = 0; i < n && i < infos.size(); ++i)
      if (infos[i].usedGpuMemory != static_cast<unsigned long long>(NVML_VALUE_NOT_AVAILABLE))
        (*out)[static_cast<int>(infos[i].pid)] += infos[i].usedGpuMemory;
    return NVML_SUCCESS;
  }
}

}  // namespace

bool processMemory(size_t devices, std::vector<std::map<int, uint64_t>>* out, std::string* err,
                   std::vector<uint64_t>* deviceUsed) {
  // Loaded and started once, never shut down: the broker asks every tick.
  static Nvml n;
  static std::string loadError = [] {
    std::string e;
    n.lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (n.lib == nullptr) return std::string("cannot load NVML (libnvidia-ml.so.1): ") + ::dlerror();
    if (!bind(n.lib, "nvmlInit_v2", &n.init, &e) || !bind(n.lib, "nvmlDeviceGetHandleByIndex_v2", &n.handle, &e) ||
        !bind(n.lib, "nvmlDeviceGetComputeRunningProcesses_v3", &n.compute, &e) ||
        !bind(n.lib, "nvmlDeviceGetMemoryInfo", &n.memory, &e))
      return e;
    bind(n.lib, "nvmlDeviceGetMPSComputeRunningProcesses_v3", &n.mps, &e);  // optional: MPS clients
    bind(n.lib, "nvmlErrorString", &n.errorString, &e);
    if (nvmlReturn_t r = n.init(); r != NVML_SUCCESS) return "NVML failed to start: " + n.describe(r);
    return std::string();
  }();
  if (!loadError.empty()) {
    *err = loadError;
    return false;
  }
  std::vector<std::map<int, uint64_t>> result(devices);
  std::vector<uint64_t> used(devices, 0);
  for (size_t i = 0; i < devices; ++i) {
    nvmlDevice_t h;
    nvmlReturn_t r = n.handle(static_cast<unsigned>(i), &h);
    if (r == NVML_SUCCESS) r = addProcesses(n.compute, h, &result[i]);
    if (r == NVML_SUCCESS && n.mps != nullptr) r = addProcesses(n.mps, h, &result[i]);
    if (r != NVML_SUCCESS) {
      *err = "NVML cannot list the processes of device " + std::to_string(i) + ": " + n.describe(r);
      return false;
    }
    if (deviceUsed != nullptr) {
      nvmlMemory_t m{};
      r = n.memory(h, &m);
      if (r != NVML_SUCCESS) {
        *err = "NVML cannot read the memory of device " + std::to_string(i) + ": " + n.describe(r);
        return false;
      }
      used[i] = m.used;
    }
  }
  *out = std::move(result);
  if (deviceUsed != nullptr) *deviceUsed = std::move(used);
  return true;
}

bool parseGpuUuid(const std::string& text, uint8_t out[16]) {
  if (text.rfind("GPU-", 0) != 0) return false;
  int n = 0;
  for (size_t i = 4; i < text.size(); ++i) {
    if (text[i] == '-') continue;
    const int hi = hexValue(text[i]);
    if (hi < 0 || i + 1 >= text.size() || n >= 16) return false;
    const int lo = hexValue(text[++i]);
    if (lo < 0) return false;
    out[n++] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return n == 16;
}

bool listDevices(std::vector<DeviceInfo>* out, std::string* err) {
  Nvml n;
  n.lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (n.lib == nullptr) {
    *err = std::string("cannot load NVML (libnvidia-ml.so.1): ") + ::dlerror();
    return false;
  }
  bool ok = bind(n.lib, "nvmlInit_v2", &n.init, err) && bind(n.lib, "nvmlShutdown", &n.shutdown, err) &&
            bind(n.lib, "nvmlDeviceGetCount_v2", &n.count, err) &&
            bind(n.lib, "nvmlDeviceGetHandleByIndex_v2", &n.handle, err) &&
            bind(n.lib, "nvmlDeviceGetUUID", &n.uuid, err) &&
            bind(n.lib, "nvmlDeviceGetMemoryInfo", &n.memory, err);
  bind(n.lib, "nvmlErrorString", &n.errorString, err);  // optional: messages only
  if (!ok) return false;  // the library stays loaded: NVML does not like being unloaded
  if (nvmlReturn_t r = n.init(); r != NVML_SUCCESS) {
    *err = "NVML failed to start: " + n.describe(r);
    return false;
  }
  unsigned count = 0;
  std::vector<DeviceInfo> devices;
  nvmlReturn_t r = n.count(&count);
  for (unsigned i = 0; r == NVML_SUCCESS && i < count; ++i) {
    nvmlDevice_t h;
    char uuid[96] = {};
    nvmlMemory_t mem{};
    if ((r = n.handle(i, &h)) != NVML_SUCCESS || (r = n.uuid(h, uuid, sizeof uuid)) != NVML_SUCCESS ||
        (r = n.memory(h, &mem)) != NVML_SUCCESS) {
      *err = "NVML cannot describe device " + std::to_string(i) + ": " + n.describe(r);
      n.shutdown();
      return false;
    }
    DeviceInfo d;
    d.ordinal = static_cast<int>(i);
    uint8_t bytes[16];
    if (!parseGpuUuid(uuid, bytes)) {
      *err = "NVML reports device " + std::to_string(i) + " with an unreadable UUID '" + uuid + "'";
      n.shutdown();
      return false;
    }
    d.uuid = formatGpuUuid(bytes);  // the one spelling the configuration and the shim use
    d.totalBytes = mem.total;
    devices.push_back(std::move(d));
  }
  if (r != NVML_SUCCESS) {
    *err = "NVML cannot count devices: " + n.describe(r);
    n.shutdown();
    return false;
  }
  n.shutdown();
  *out = std::move(devices);
  return true;
}

}  // namespace cushare::broker
