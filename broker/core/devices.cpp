// See devices.h.
#include "core/devices.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

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
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlProcessUtilizationSample_t*, unsigned*, unsigned long long) = nullptr;
  const char* (*errorString)(nvmlReturn_t) = nullptr;
  // MIG (optional: an NVML without them has no MIG devices).
  nvmlReturn_t (*migMode)(nvmlDevice_t, unsigned*, unsigned*) = nullptr;
  nvmlReturn_t (*maxMig)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*migHandle)(nvmlDevice_t, unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*giId)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*ciId)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*minor)(nvmlDevice_t, unsigned*) = nullptr;  // optional: device nodes only

  void bindMig() {
    migMode = reinterpret_cast<decltype(migMode)>(::dlsym(lib, "nvmlDeviceGetMigMode"));
    maxMig = reinterpret_cast<decltype(maxMig)>(::dlsym(lib, "nvmlDeviceGetMaxMigDeviceCount"));
    migHandle = reinterpret_cast<decltype(migHandle)>(::dlsym(lib, "nvmlDeviceGetMigDeviceHandleByIndex"));
    giId = reinterpret_cast<decltype(giId)>(::dlsym(lib, "nvmlDeviceGetGpuInstanceId"));
    ciId = reinterpret_cast<decltype(ciId)>(::dlsym(lib, "nvmlDeviceGetComputeInstanceId"));
    name = reinterpret_cast<decltype(name)>(::dlsym(lib, "nvmlDeviceGetName"));
    minor = reinterpret_cast<decltype(minor)>(::dlsym(lib, "nvmlDeviceGetMinorNumber"));
  }
  bool hasMig() const { return migMode && maxMig && migHandle && giId && ciId && name; }

  // The NVML handle of one of listDevices' devices: the GPU's, or its MIG device's.
  nvmlReturn_t handleOf(const DeviceInfo& d, nvmlDevice_t* out) const {
    nvmlDevice_t gpu;
    nvmlReturn_t r = handle(static_cast<unsigned>(d.ordinal), &gpu);
    if (r != NVML_SUCCESS || !d.mig()) {
      *out = gpu;
      return r;
    }
    if (!migHandle || !uuid) return NVML_ERROR_NOT_SUPPORTED;
    if ((r = migHandle(gpu, static_cast<unsigned>(d.migIndex), out)) != NVML_SUCCESS) return r;
    // A MIG index names another compute instance after the layout changed: never read it as this
    // one (the broker lists devices at start; docs/mig.md says to restart it after a change).
    char now[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
    uint8_t a[16], b[16];
    if ((r = uuid(*out, now, sizeof now)) != NVML_SUCCESS) return r;
    if (!parseGpuUuid(now, a) || !parseGpuUuid(d.uuid, b) || std::memcmp(a, b, 16) != 0) return NVML_ERROR_NOT_FOUND;
    return NVML_SUCCESS;
  }

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

constexpr unsigned kNoInstanceId = 0xFFFFFFFFu;  // nvmlProcessInfo_t's IDs outside MIG, or not filled in

// One NVML process list (the buffer protocol: grow and ask again while it is too small), added
// to out. With mig: only the entries of that MIG device's GPU and compute instance (a list NVML
// gave per GPU instance would otherwise count a sibling's processes twice).
nvmlReturn_t addProcesses(nvmlReturn_t (*list)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*), nvmlDevice_t h,
                          std::map<int, uint64_t>* out, const DeviceInfo* mig = nullptr) {
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
      if (infos[i].usedGpuMemory != static_cast<unsigned long long>(NVML_VALUE_NOT_AVAILABLE) &&
          (mig == nullptr || infos[i].gpuInstanceId == kNoInstanceId ||  // IDs not given: the handle's own
           (infos[i].gpuInstanceId == mig->gpuInstance && infos[i].computeInstanceId == mig->computeInstance)))
        (*out)[static_cast<int>(infos[i].pid)] += infos[i].usedGpuMemory;
    return NVML_SUCCESS;
  }
}

// NVML for the broker's ticks: loaded and started once, never shut down (the broker asks every
// tick). Null with *err when it cannot be loaded or started.
const Nvml* tickNvml(std::string* err) {
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
    bind(n.lib, "nvmlDeviceGetUUID", &n.uuid, &e);  // MIG devices: checked to be the listed ones
    bind(n.lib, "nvmlDeviceGetProcessUtilization", &n.utilization, &e);   // optional: busy cross-check
    bind(n.lib, "nvmlErrorString", &n.errorString, &e);
    n.bindMig();
    if (nvmlReturn_t r = n.init(); r != NVML_SUCCESS) return "NVML failed to start: " + n.describe(r);
    return std::string();
  }();
  if (!loadError.empty()) {
    *err = loadError;
    return nullptr;
  }
  return &n;
}

// Why a device's processes cannot be read; a MIG device that is gone (or whose index another
// compute instance now has) says the layout changed.
std::string cannotList(const Nvml& n, const DeviceInfo& d, nvmlReturn_t r) {
  if (d.mig() && (r == NVML_ERROR_NOT_FOUND || r == NVML_ERROR_INVALID_ARGUMENT))
    return "MIG device " + d.name() + " (" + d.uuid + ") is gone or another compute instance has its index: the "
           "MIG layout changed since the broker started, restart it (docs/mig.md)";
  return "NVML cannot list the processes of device " + d.name() + ": " + n.describe(r);
}

}  // namespace

bool processMemory(const std::vector<DeviceInfo>& list, std::vector<std::map<int, uint64_t>>* out, std::string* err,
                   std::vector<uint64_t>* deviceUsed, std::vector<uint64_t>* deviceUsedHigh,
                   std::vector<std::string>* unread) {
  const Nvml* nv = tickNvml(err);
  if (nv == nullptr) return false;
  const Nvml& n = *nv;
  const size_t devices = list.size();
  std::vector<std::map<int, uint64_t>> result(devices);
  std::vector<uint64_t> used(devices, 0), usedHigh(devices, 0);
  std::vector<std::string> failed(devices);
  const auto readUsed = [&](nvmlDevice_t h, size_t i, uint64_t* out, std::string* why) {
    nvmlMemory_t m{};
    const nvmlReturn_t r = n.memory(h, &m);
    if (r != NVML_SUCCESS) *why = "NVML cannot read the memory of device " + list[i].name() + ": " + n.describe(r);
    *out = m.used;
    return r == NVML_SUCCESS;
  };
  // The device's total is read before and after its process lists: the lists and the total
  // cannot be read at one instant, and a process allocating between the list and a later total
  // would show as memory no process holds. The smaller of the two under-states "the total minus
  // the processes" against a process that allocates (or frees) between the reads, but not
  // against one that frees before the list and allocates again before the second total (a
  // churner: the list misses its block, both totals count one): then it over-states it. So
  // where a reading leaves memory no process holds, it is taken up to twice more and the
  // reading that leaves the least is kept, with its list (a churner would have to race all
  // three). left_behind.cpp charges rises of that smaller figure and returns charges on falls
  // of the larger total of all the readings, so allocations racing the reads neither charge
  // an exiting tenant nor clear a real charge.
  const auto readOne = [&](size_t i, std::string* why) {
    nvmlDevice_t h;
    nvmlReturn_t r = n.handleOf(list[i], &h);
    if (r != NVML_SUCCESS) {
      *why = cannotList(n, list[i], r);
      return false;
    }
    // Compute instances of one GPU instance share its memory: NVML's used memory of a MIG device
    // is its GPU instance's, its process list the compute instance's own. Memory the processes of
    // the sibling compute instances (devices of the same memory group) hold is taken off, and
    // what no process holds is shown on the group's first device only (left_behind.cpp judges
    // no device of a shared group: one figure cannot say which compute instance left it).
    std::vector<std::pair<nvmlDevice_t, const DeviceInfo*>> siblings;
    for (size_t j = 0; j < devices; ++j) {
      nvmlDevice_t s;
      if (j != i && list[i].mig() && list[j].group(j) == list[i].group(i)) {
        if ((r = n.handleOf(list[j], &s)) != NVML_SUCCESS) {
          *why = cannotList(n, list[j], r);
          return false;
        }
        siblings.emplace_back(s, &list[j]);
      }
    }
    const bool firstOfGroup = list[i].group(i) == i;
    const DeviceInfo* own = list[i].mig() ? &list[i] : nullptr;
    uint64_t bestUnheld = UINT64_MAX;
    for (int attempt = 0; attempt < 3 && bestUnheld != 0; ++attempt) {
      std::map<int, uint64_t> listed;
      uint64_t before = 0, after = 0;
      if (deviceUsed != nullptr && !readUsed(h, i, &before, why)) return false;
      r = addProcesses(n.compute, h, &listed, own);
      if (r == NVML_SUCCESS && n.mps != nullptr) r = addProcesses(n.mps, h, &listed, own);
      std::map<int, uint64_t> inSiblings;
      for (const auto& [s, info] : siblings)
        if (r == NVML_SUCCESS) r = addProcesses(n.compute, s, &inSiblings, info);
      if (r != NVML_SUCCESS) {
        *why = "NVML cannot list the processes of device " + list[i].name() + ": " + n.describe(r);
        return false;
      }
      if (deviceUsed == nullptr) {
        result[i] = std::move(listed);
        break;
      }
      if (!readUsed(h, i, &after, why)) return false;
      uint64_t held = 0, siblingsHeld = 0;
      for (const auto& [pid, bytes] : listed) held += bytes;
      for (const auto& [pid, bytes] : inSiblings) siblingsHeld += bytes;
      before = before > siblingsHeld ? before - siblingsHeld : 0;
      after = after > siblingsHeld ? after - siblingsHeld : 0;
      if (!firstOfGroup) before = after = held;  // the group's unheld memory is shown on its first device
      const uint64_t low = std::min(before, after);
      const uint64_t unheld = low > held ? low - held : 0;
      usedHigh[i] = std::max({usedHigh[i], before, after});
      if (unheld < bestUnheld) {
        bestUnheld = unheld;
        used[i] = low;
        result[i] = std::move(listed);
      }
    }
    return true;
  };
  for (size_t i = 0; i < devices; ++i) {
    std::string why;
    if (readOne(i, &why)) continue;
    // A MIG device that cannot be read (gone after a layout change) leaves the others read.
    if (unread == nullptr || !list[i].mig()) {
      *err = why;
      return false;
    }
    failed[i] = why;
    result[i].clear();
    used[i] = usedHigh[i] = 0;
  }
  *out = std::move(result);
  if (deviceUsed != nullptr) *deviceUsed = std::move(used);
  if (deviceUsedHigh != nullptr) *deviceUsedHigh = std::move(usedHigh);
  if (unread != nullptr) *unread = std::move(failed);
  return true;
}

bool ProcessBusyReader::read(const std::vector<DeviceInfo>& list, std::vector<std::map<int, uint64_t>>* out,
                             std::string* err) {
  const size_t devices = list.size();
  const Nvml* nv = tickNvml(err);
  if (nv == nullptr) return false;
  if (nv->utilization == nullptr) {
    *err = "NVML has no nvmlDeviceGetProcessUtilization";
    return false;
  }
  lastSeenUs_.resize(devices, 0);
  lastSampleUs_.resize(devices);
  std::vector<std::map<int, uint64_t>> result(devices);
  std::vector<nvmlProcessUtilizationSample_t> samples(64);
  for (size_t i = 0; i < devices; ++i) {
    // NVML has no per-process utilization on MIG (NOT_SUPPORTED, as its notes say): a MIG device's
    // busy time is the tenants' metering alone (docs/mig.md), not an error to report every tick.
    if (list[i].mig()) continue;
    nvmlDevice_t h;
    nvmlReturn_t r = nv->handleOf(list[i], &h);
    unsigned n = 0;
    while (r == NVML_SUCCESS) {
      n = static_cast<unsigned>(samples.size());
      r = nv->utilization(h, samples.data(), &n, lastSeenUs_[i]);
      if (r != NVML_ERROR_INSUFFICIENT_SIZE || n <= samples.size()) break;
      samples.resize(n + 16);
      r = NVML_SUCCESS;
    }
    if (r == NVML_ERROR_NOT_FOUND) {
      n = 0;  // no sample newer than the last one seen
    } else if (r != NVML_SUCCESS) {
      // This device only (one that cannot answer, e.g. with MIG on): the others are still read.
      *err = "NVML cannot read the per-process utilization of device " + list[i].name() + ": " + nv->describe(r);
      continue;
    }
    n = std::min<unsigned>(n, static_cast<unsigned>(samples.size()));
    std::sort(samples.begin(), samples.begin() + n, [](const auto& a, const auto& b) {
      return a.pid != b.pid ? a.pid < b.pid : a.timeStamp < b.timeStamp;
    });
    // A sample's smUtil is the percent of its sampling period, which ends at its timestamp and
    // began at the process's previous sample (several in one read follow each other): a process's
    // first sample only starts its count. The driver sends samples only for periods in which the
    // process ran, so the time since its previous sample may span idle periods: a period counts
    // as at most kMaxSamplePeriodUs (under-counting, never over-billing, where the driver's
    // period is longer; perf/gpu_check.sh step 6 measures it).
    std::map<int, uint64_t>& last = lastSampleUs_[i];
    for (unsigned k = 0; k < n; ++k) {
      const nvmlProcessUtilizationSample_t& x = samples[k];
      const int pid = static_cast<int>(x.pid);
      const auto prev = last.find(pid);
      if (prev != last.end() && x.timeStamp <= prev->second) continue;  // seen already
      if (prev != last.end() && x.smUtil <= 100) {
        const uint64_t periodUs = std::min<uint64_t>(x.timeStamp - prev->second, kMaxSamplePeriodUs);
        result[i][pid] += periodUs * 1000 * x.smUtil / 100;
      }
      last[pid] = x.timeStamp;
      lastSeenUs_[i] = std::max<uint64_t>(lastSeenUs_[i], x.timeStamp);
    }
    // Processes without a sample this time keep theirs; gone ones are dropped once NVML has sent
    // nothing of them for a while.
    for (auto it = last.begin(); it != last.end();)
      it = lastSeenUs_[i] > it->second + kForgetAfterUs ? last.erase(it) : std::next(it);
  }
  *out = std::move(result);
  return true;
}

bool parseGpuUuid(const std::string& text, uint8_t out[16]) {
  if (text.rfind("GPU-", 0) != 0 && text.rfind("MIG-", 0) != 0) return false;
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

bool listDevices(std::vector<DeviceInfo>* out, std::string* err, std::vector<std::string>* migWithoutDevices) {
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
  n.bindMig();
  if (nvmlReturn_t r = n.init(); r != NVML_SUCCESS) {
    *err = "NVML failed to start: " + n.describe(r);
    return false;
  }
  const auto failWith = [&](const std::string& why) {
    *err = why;
    n.shutdown();
    return false;
  };
  // UUID and total memory of a handle, into d (its spelling checked: "GPU-" for a GPU, "MIG-" for
  // a MIG device).
  const auto describe = [&](nvmlDevice_t h, const std::string& what, bool mig, DeviceInfo* d, std::string* why) {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
    nvmlMemory_t mem{};
    nvmlReturn_t r;
    if ((r = n.uuid(h, uuid, sizeof uuid)) != NVML_SUCCESS || (r = n.memory(h, &mem)) != NVML_SUCCESS) {
      *why = "NVML cannot describe " + what + ": " + n.describe(r);
      return false;
    }
    uint8_t bytes[16];
    if (std::string(uuid).rfind(mig ? "MIG-" : "GPU-", 0) != 0 || !parseGpuUuid(uuid, bytes)) {
      *why = "NVML reports " + what + " with an unreadable UUID '" + uuid + "'";
      return false;
    }
    d->uuid = formatDeviceUuid(bytes, mig);  // the one spelling the configuration and the shim use
    d->totalBytes = mem.total;
    return true;
  };
  unsigned count = 0;
  std::vector<DeviceInfo> devices;
  std::vector<std::string> idle;
  nvmlReturn_t r = n.count(&count);
  if (r != NVML_SUCCESS) return failWith("NVML cannot count devices: " + n.describe(r));
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t h;
    DeviceInfo gpu;
    gpu.ordinal = static_cast<int>(i);
    std::string why;
    if ((r = n.handle(i, &h)) != NVML_SUCCESS)
      return failWith("NVML cannot describe device " + std::to_string(i) + ": " + n.describe(r));
    if (!describe(h, "device " + std::to_string(i), false, &gpu, &why)) return failWith(why);
    unsigned current = NVML_DEVICE_MIG_DISABLE, pending = NVML_DEVICE_MIG_DISABLE;
    // A GPU without MIG answers NOT_SUPPORTED: a whole GPU. Any other error is not taken for "no
    // MIG" (a MIG-enabled GPU listed whole would name a device CUDA cannot run on).
    r = n.hasMig() ? n.migMode(h, &current, &pending) : NVML_ERROR_NOT_SUPPORTED;
    if (r != NVML_SUCCESS && r != NVML_ERROR_NOT_SUPPORTED)
      return failWith("NVML cannot read the MIG mode of GPU " + std::to_string(i) + ": " + n.describe(r));
    if (r == NVML_ERROR_NOT_SUPPORTED || current != NVML_DEVICE_MIG_ENABLE) {
      gpu.memoryGroup = devices.size();
      devices.push_back(std::move(gpu));
      continue;
    }
    unsigned max = 0;
    if ((r = n.maxMig(h, &max)) != NVML_SUCCESS)
      return failWith("NVML cannot count the MIG devices of GPU " + std::to_string(i) + ": " + n.describe(r));
    const size_t first = devices.size();
    // Its /dev/nvidiaN, for the nodes a container of its MIG devices needs (container/mig_nodes.h).
    unsigned gpuMinor = 0;
    const bool minorKnown = n.minor != nullptr && n.minor(h, &gpuMinor) == NVML_SUCCESS;
    for (unsigned j = 0; j < max; ++j) {
      nvmlDevice_t m;
      r = n.migHandle(h, j, &m);
      if (r == NVML_ERROR_NOT_FOUND || r == NVML_ERROR_INVALID_ARGUMENT) continue;  // no MIG device there
      const std::string what = "MIG device " + std::to_string(i) + ":" + std::to_string(j);
      DeviceInfo d;
      d.ordinal = static_cast<int>(i);
      d.migIndex = static_cast<int>(j);
      d.parentUuid = gpu.uuid;
      d.gpuMinor = minorKnown ? static_cast<int>(gpuMinor) : -1;
      char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
      if (r != NVML_SUCCESS || (r = n.giId(m, &d.gpuInstance)) != NVML_SUCCESS ||
          (r = n.ciId(m, &d.computeInstance)) != NVML_SUCCESS || (r = n.name(m, name, sizeof name)) != NVML_SUCCESS)
        return failWith("NVML cannot describe " + what + ": " + n.describe(r));
      if (!describe(m, what, true, &d, &why)) return failWith(why);
      // "<board> MIG <profile>", as NVML and CUDA name a MIG device.
      const std::string full = name;
      const size_t at = full.rfind(" MIG ");
      d.profile = at == std::string::npos ? full : full.substr(at + 5);
      d.memoryGroup = devices.size();
      for (size_t k = first; k < devices.size(); ++k)
        if (devices[k].gpuInstance == d.gpuInstance) {
          d.memoryGroup = devices[k].memoryGroup;
          break;
        }
      devices.push_back(std::move(d));
    }
    if (devices.size() == first) idle.push_back(std::to_string(i) + " (" + gpu.uuid + ")");
  }
  n.shutdown();
  *out = std::move(devices);
  if (migWithoutDevices != nullptr) *migWithoutDevices = std::move(idle);
  return true;
}

}  // namespace cushare::broker
