// See mig_layout.h.
#include "mig/mig_layout.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <set>
#include <type_traits>

#include "cushare/ledger_abi.h"
#include "cushare/nvml_api.h"

namespace cushare::broker::mig {
namespace {

struct Api {
  void* lib = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*count)(unsigned*) = nullptr;
  nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*migMode)(nvmlDevice_t, unsigned*, unsigned*) = nullptr;
  nvmlReturn_t (*setMigMode)(nvmlDevice_t, unsigned, nvmlReturn_t*) = nullptr;
  nvmlReturn_t (*giProfile)(nvmlDevice_t, unsigned, nvmlGpuInstanceProfileInfo_v2_t*) = nullptr;
  nvmlReturn_t (*placements)(nvmlDevice_t, unsigned, nvmlGpuInstancePlacement_t*, unsigned*) = nullptr;
  nvmlReturn_t (*instances)(nvmlDevice_t, unsigned, nvmlGpuInstance_t*, unsigned*) = nullptr;
  nvmlReturn_t (*giInfo)(nvmlGpuInstance_t, nvmlGpuInstanceInfo_t*) = nullptr;
  nvmlReturn_t (*ciProfile)(nvmlGpuInstance_t, unsigned, unsigned, nvmlComputeInstanceProfileInfo_t*) = nullptr;
  nvmlReturn_t (*computeInstances)(nvmlGpuInstance_t, unsigned, nvmlComputeInstance_t*, unsigned*) = nullptr;
  nvmlReturn_t (*createGi)(nvmlDevice_t, unsigned, const nvmlGpuInstancePlacement_t*, nvmlGpuInstance_t*) = nullptr;
  nvmlReturn_t (*createCi)(nvmlGpuInstance_t, unsigned, nvmlComputeInstance_t*) = nullptr;
  nvmlReturn_t (*destroyGi)(nvmlGpuInstance_t) = nullptr;
  nvmlReturn_t (*destroyCi)(nvmlComputeInstance_t) = nullptr;
  nvmlReturn_t (*maxMig)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*migHandle)(nvmlDevice_t, unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*processes)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  const char* (*errorString)(nvmlReturn_t) = nullptr;

  std::string describe(nvmlReturn_t r) const {
    return errorString ? errorString(r) : "NVML error " + std::to_string(static_cast<int>(r));
  }
};

// NVML, loaded and started once (this runs in the CLI and at the broker's start).
const Api* api(std::string* err) {
  static Api a;
  static const std::string loadError = [] {
    a.lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (a.lib == nullptr) return std::string("cannot load NVML (libnvidia-ml.so.1): ") + ::dlerror();
    const auto bind = [](const char* name, auto* out) {
      *out = reinterpret_cast<std::remove_pointer_t<decltype(out)>>(::dlsym(a.lib, name));
      return *out != nullptr;
    };
    a.errorString = reinterpret_cast<decltype(a.errorString)>(::dlsym(a.lib, "nvmlErrorString"));
    const char* missing = nullptr;
    const auto need = [&](const char* name, auto* out) {
      if (!bind(name, out) && missing == nullptr) missing = name;
    };
    need("nvmlInit_v2", &a.init);
    need("nvmlDeviceGetCount_v2", &a.count);
    need("nvmlDeviceGetHandleByIndex_v2", &a.handle);
    need("nvmlDeviceGetUUID", &a.uuid);
    need("nvmlDeviceGetMigMode", &a.migMode);
    need("nvmlDeviceSetMigMode", &a.setMigMode);
    need("nvmlDeviceGetGpuInstanceProfileInfoV", &a.giProfile);
    need("nvmlDeviceGetGpuInstancePossiblePlacements_v2", &a.placements);
    need("nvmlDeviceGetGpuInstances", &a.instances);
    need("nvmlGpuInstanceGetInfo", &a.giInfo);
    need("nvmlGpuInstanceGetComputeInstanceProfileInfo", &a.ciProfile);
    need("nvmlGpuInstanceGetComputeInstances", &a.computeInstances);
    need("nvmlDeviceCreateGpuInstanceWithPlacement", &a.createGi);
    need("nvmlGpuInstanceCreateComputeInstance", &a.createCi);
    need("nvmlGpuInstanceDestroy", &a.destroyGi);
    need("nvmlComputeInstanceDestroy", &a.destroyCi);
    need("nvmlDeviceGetMaxMigDeviceCount", &a.maxMig);
    need("nvmlDeviceGetMigDeviceHandleByIndex", &a.migHandle);
    need("nvmlDeviceGetComputeRunningProcesses_v3", &a.processes);
    if (missing != nullptr) return std::string("NVML has no ") + missing + " (a driver without MIG)";
    if (const nvmlReturn_t r = a.init(); r != NVML_SUCCESS) return "NVML failed to start: " + a.describe(r);
    return std::string();
  }();
  if (!loadError.empty()) {
    *err = loadError;
    return nullptr;
  }
  return &a;
}

bool nvmlFail(const Api& a, nvmlReturn_t r, const std::string& what, std::string* err) {
  *err = "NVML cannot " + what + ": " + a.describe(r);
  return false;
}

// The processes NVML lists on a device (buffer protocol), added to pids.
nvmlReturn_t addPids(const Api& a, nvmlDevice_t h, std::set<int>* pids) {
  std::vector<nvmlProcessInfo_t> infos(64);
  for (;;) {
    unsigned n = static_cast<unsigned>(infos.size());
    const nvmlReturn_t r = a.processes(h, &n, infos.data());
    if (r == NVML_ERROR_INSUFFICIENT_SIZE && n > infos.size()) {
      infos.resize(n + 16);
      continue;
    }
    if (r != NVML_SUCCESS) return r;
    for (unsigned i = 0; i < n && i < infos.size(); ++i) pids->insert(static_cast<int>(infos[i].pid));
    return NVML_SUCCESS;
  }
}

// Every GPU instance of the GPU (all profiles).
nvmlReturn_t gpuInstances(const Api& a, nvmlDevice_t h, const std::vector<GiProfile>& profiles,
                          std::vector<nvmlGpuInstance_t>* out) {
  for (const GiProfile& p : profiles) {
    std::vector<nvmlGpuInstance_t> gis(std::max(p.maxInstances, 1u) + 8);  // the caller sizes it (instanceCount)
    unsigned n = static_cast<unsigned>(gis.size());
    const nvmlReturn_t r = a.instances(h, p.id, gis.data(), &n);
    if (r != NVML_SUCCESS) return r;
    out->insert(out->end(), gis.begin(), gis.begin() + std::min<size_t>(n, gis.size()));
  }
  return NVML_SUCCESS;
}

// Compute instances of one profile in a GPU instance: at most its compute slices (8 on any board).
constexpr unsigned kMaxComputeInstances = 16;

std::string stripMig(const std::string& name) { return name.rfind("MIG ", 0) == 0 ? name.substr(4) : name; }

std::string wantedText(const Wanted& w) {
  if (!w.enabled) return "MIG off";
  std::string s;
  for (const auto& [p, n] : w.counts) s += (s.empty() ? "" : ", ") + std::to_string(n) + " x " + p;
  return "MIG on, " + (s.empty() ? std::string("no instances") : s);
}

std::string haveText(const Gpu& g) {
  if (!g.enabled) return std::string("MIG off") + (g.pendingEnabled ? " (on pending a reset)" : "");
  std::map<std::string, unsigned> counts;
  bool partial = false;
  for (const Instance& i : g.instances) {
    ++counts[i.profile];
    partial = partial || !i.fullCompute;
  }
  std::string s;
  for (const auto& [p, n] : counts) s += (s.empty() ? "" : ", ") + std::to_string(n) + " x " + p;
  return std::string("MIG on") + (!g.pendingEnabled ? " (off pending a reset)" : "") + ", " +
         (s.empty() ? std::string("no instances") : s) +
         (partial ? " (some not as one compute instance spanning the GPU instance)" : "");
}

}  // namespace

bool Host::read(std::vector<Gpu>* out, std::string* err) {
  const Api* ap = api(err);
  if (ap == nullptr) return false;
  const Api& a = *ap;
  unsigned count = 0;
  nvmlReturn_t r = a.count(&count);
  if (r != NVML_SUCCESS) return nvmlFail(a, r, "count the GPUs", err);
  std::vector<Gpu> gpus;
  for (unsigned i = 0; i < count; ++i) {
    Gpu g;
    g.index = static_cast<int>(i);
    const std::string what = "read GPU " + std::to_string(i);
    nvmlDevice_t h;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
    if ((r = a.handle(i, &h)) != NVML_SUCCESS || (r = a.uuid(h, uuid, sizeof uuid)) != NVML_SUCCESS)
      return nvmlFail(a, r, what, err);
    g.uuid = uuid;
    std::set<int> pids;
    if ((r = addPids(a, h, &pids)) != NVML_SUCCESS) return nvmlFail(a, r, "list the processes of GPU " + std::to_string(i), err);
    unsigned current = 0, pending = 0;
    r = a.migMode(h, &current, &pending);
    if (r == NVML_ERROR_NOT_SUPPORTED) {
      g.pids.assign(pids.begin(), pids.end());
      gpus.push_back(std::move(g));
      continue;
    }
    if (r != NVML_SUCCESS) return nvmlFail(a, r, "read the MIG mode of GPU " + std::to_string(i), err);
    g.capable = true;
    g.enabled = current == NVML_DEVICE_MIG_ENABLE;
    g.pendingEnabled = pending == NVML_DEVICE_MIG_ENABLE;
    // Profiles and placements answer with MIG off too, so a layout is judged before any change.
    for (unsigned p = 0; p < NVML_GPU_INSTANCE_PROFILE_COUNT; ++p) {
      nvmlGpuInstanceProfileInfo_v2_t info{};
      info.version = nvmlGpuInstanceProfileInfo_v2;
      r = a.giProfile(h, p, &info);
      if (r == NVML_ERROR_NOT_SUPPORTED || r == NVML_ERROR_INVALID_ARGUMENT) continue;  // not on this board
      if (r != NVML_SUCCESS) return nvmlFail(a, r, "read the MIG profiles of GPU " + std::to_string(i), err);
      GiProfile gp;
      gp.id = info.id;
      gp.name = stripMig(info.name);
      gp.slices = info.sliceCount;
      gp.maxInstances = info.instanceCount;
      gp.memoryBytes = info.memorySizeMB << 20;
      unsigned n = 0;
      if ((r = a.placements(h, info.id, nullptr, &n)) != NVML_SUCCESS)
        return nvmlFail(a, r, "count the placements of profile " + gp.name + " on GPU " + std::to_string(i), err);
      std::vector<nvmlGpuInstancePlacement_t> pl(n);
      if (n > 0 && (r = a.placements(h, info.id, pl.data(), &n)) != NVML_SUCCESS)
        return nvmlFail(a, r, "read the placements of profile " + gp.name + " on GPU " + std::to_string(i), err);
      for (unsigned k = 0; k < n && k < pl.size(); ++k) gp.placements.emplace_back(pl[k].start, pl[k].size);
      g.profiles.push_back(std::move(gp));
    }
    if (g.enabled) {
      std::vector<nvmlGpuInstance_t> gis;
      if ((r = gpuInstances(a, h, g.profiles, &gis)) != NVML_SUCCESS)
        return nvmlFail(a, r, "list the GPU instances of GPU " + std::to_string(i), err);
      for (nvmlGpuInstance_t gi : gis) {
        nvmlGpuInstanceInfo_t info{};
        if ((r = a.giInfo(gi, &info)) != NVML_SUCCESS) return nvmlFail(a, r, "read a GPU instance of GPU " + std::to_string(i), err);
        Instance in;
        in.gi = info.id;
        in.profileId = info.profileId;
        in.start = info.placement.start;
        in.size = info.placement.size;
        unsigned slices = 0;
        for (const GiProfile& p : g.profiles)
          if (p.id == info.profileId) in.profile = p.name, slices = p.slices;
        for (unsigned c = 0; c < NVML_COMPUTE_INSTANCE_PROFILE_COUNT; ++c) {
          nvmlComputeInstanceProfileInfo_t ci{};
          if (a.ciProfile(gi, c, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &ci) != NVML_SUCCESS) continue;
          nvmlComputeInstance_t cis[kMaxComputeInstances];
          unsigned n = kMaxComputeInstances;
          if ((r = a.computeInstances(gi, ci.id, cis, &n)) != NVML_SUCCESS)
            return nvmlFail(a, r, "list the compute instances of GPU " + std::to_string(i), err);
          n = std::min(n, kMaxComputeInstances);
          in.computeInstances += n;
          if (n == 1 && ci.sliceCount == slices) in.fullCompute = true;
        }
        in.fullCompute = in.fullCompute && in.computeInstances == 1;
        g.instances.push_back(std::move(in));
      }
      std::sort(g.instances.begin(), g.instances.end(), [](const Instance& x, const Instance& y) { return x.gi < y.gi; });
      unsigned max = 0;
      if ((r = a.maxMig(h, &max)) != NVML_SUCCESS) return nvmlFail(a, r, "count the MIG devices of GPU " + std::to_string(i), err);
      for (unsigned j = 0; j < max; ++j) {
        nvmlDevice_t m;
        if (a.migHandle(h, j, &m) != NVML_SUCCESS) continue;
        char u[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
        if ((r = a.uuid(m, u, sizeof u)) != NVML_SUCCESS) return nvmlFail(a, r, "read a MIG device of GPU " + std::to_string(i), err);
        g.migUuids.push_back(u);
        if ((r = addPids(a, m, &pids)) != NVML_SUCCESS)
          return nvmlFail(a, r, "list the processes of MIG device " + std::to_string(i) + ":" + std::to_string(j), err);
      }
    }
    g.pids.assign(pids.begin(), pids.end());
    gpus.push_back(std::move(g));
  }
  *out = std::move(gpus);
  return true;
}

bool Host::setMode(int gpu, bool enabled, bool* pending, std::string* err) {
  const Api* a = api(err);
  if (a == nullptr) return false;
  nvmlDevice_t h;
  nvmlReturn_t r = a->handle(static_cast<unsigned>(gpu), &h), activation = NVML_SUCCESS;
  if (r == NVML_SUCCESS) r = a->setMigMode(h, enabled ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE, &activation);
  if (r != NVML_SUCCESS) return nvmlFail(*a, r, "set the MIG mode of GPU " + std::to_string(gpu), err);
  if (activation == NVML_ERROR_IN_USE)
    return nvmlFail(*a, activation, "apply the MIG mode of GPU " + std::to_string(gpu) + " (a process or service holds it)", err);
  unsigned current = 0, pend = 0;
  if ((r = a->migMode(h, &current, &pend)) != NVML_SUCCESS)
    return nvmlFail(*a, r, "read the MIG mode of GPU " + std::to_string(gpu), err);
  *pending = (current == NVML_DEVICE_MIG_ENABLE) != enabled;
  return true;
}

bool Host::destroyAll(int gpu, std::string* err) {
  const Api* a = api(err);
  if (a == nullptr) return false;
  std::vector<Gpu> gpus;
  if (!read(&gpus, err)) return false;
  if (gpu < 0 || static_cast<size_t>(gpu) >= gpus.size()) {
    *err = "GPU " + std::to_string(gpu) + " is not on this host";
    return false;
  }
  // Processes are looked for again just before: one started since the first look stops it here,
  // with nothing destroyed (the driver would refuse an instance in use, after others were gone).
  if (const std::vector<int>& pids = gpus[static_cast<size_t>(gpu)].pids; !pids.empty()) {
    *err = "GPU " + std::to_string(gpu) + " is in use by process " + std::to_string(pids.front()) +
           (pids.size() > 1 ? " and " + std::to_string(pids.size() - 1) + " more" : "") + ": nothing destroyed";
    return false;
  }
  nvmlDevice_t h;
  nvmlReturn_t r = a->handle(static_cast<unsigned>(gpu), &h);
  if (r != NVML_SUCCESS) return nvmlFail(*a, r, "reach GPU " + std::to_string(gpu), err);
  std::vector<nvmlGpuInstance_t> gis;
  if ((r = gpuInstances(*a, h, gpus[static_cast<size_t>(gpu)].profiles, &gis)) != NVML_SUCCESS)
    return nvmlFail(*a, r, "list the GPU instances of GPU " + std::to_string(gpu), err);
  for (nvmlGpuInstance_t gi : gis) {  // compute instances first, then their GPU instance
    for (unsigned c = 0; c < NVML_COMPUTE_INSTANCE_PROFILE_COUNT; ++c) {
      nvmlComputeInstanceProfileInfo_t ci{};
      r = a->ciProfile(gi, c, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &ci);
      if (r == NVML_ERROR_NOT_SUPPORTED || r == NVML_ERROR_INVALID_ARGUMENT) continue;  // no such profile here
      if (r != NVML_SUCCESS) return nvmlFail(*a, r, "read compute instance profiles on GPU " + std::to_string(gpu), err);
      nvmlComputeInstance_t cis[kMaxComputeInstances];
      unsigned n = kMaxComputeInstances;
      if ((r = a->computeInstances(gi, ci.id, cis, &n)) != NVML_SUCCESS)
        return nvmlFail(*a, r, "list compute instances on GPU " + std::to_string(gpu), err);
      for (unsigned k = 0; k < n && k < kMaxComputeInstances; ++k)
        if ((r = a->destroyCi(cis[k])) != NVML_SUCCESS)
          return nvmlFail(*a, r, "destroy a compute instance on GPU " + std::to_string(gpu), err);
    }
    nvmlGpuInstanceInfo_t info{};
    a->giInfo(gi, &info);
    if ((r = a->destroyGi(gi)) != NVML_SUCCESS)
      return nvmlFail(*a, r, "destroy GPU instance " + std::to_string(info.id) + " on GPU " + std::to_string(gpu), err);
  }
  return true;
}

bool Host::create(int gpu, const GiProfile& p, std::pair<unsigned, unsigned> placement, std::string* err) {
  const Api* a = api(err);
  if (a == nullptr) return false;
  nvmlDevice_t h;
  nvmlGpuInstance_t gi;
  const nvmlGpuInstancePlacement_t pl{placement.first, placement.second};
  const std::string what = p.name + " at " + std::to_string(placement.first) + ":" + std::to_string(placement.second) +
                           " on GPU " + std::to_string(gpu);
  nvmlReturn_t r = a->handle(static_cast<unsigned>(gpu), &h);
  if (r == NVML_SUCCESS) r = a->createGi(h, p.id, &pl, &gi);
  if (r != NVML_SUCCESS) return nvmlFail(*a, r, "create " + what, err);
  for (unsigned c = 0; c < NVML_COMPUTE_INSTANCE_PROFILE_COUNT; ++c) {
    nvmlComputeInstanceProfileInfo_t ci{};
    if (a->ciProfile(gi, c, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &ci) != NVML_SUCCESS || ci.sliceCount != p.slices)
      continue;
    nvmlComputeInstance_t out;
    if ((r = a->createCi(gi, ci.id, &out)) != NVML_SUCCESS) return nvmlFail(*a, r, "create the compute instance of " + what, err);
    return true;
  }
  *err = "no compute instance profile spans " + what;
  return false;
}

bool wantedOf(const std::vector<MigLayoutEntry>& layout, const std::vector<Gpu>& gpus,
              std::vector<std::optional<Wanted>>* out, std::string* err) {
  std::vector<std::optional<Wanted>> w(gpus.size());
  for (const MigLayoutEntry& e : layout) {
    Wanted x;
    x.enabled = e.enabled;
    for (const auto& [p, n] : e.profiles) x.counts[p] += n;
    if (e.allDevices) {
      for (auto& g : w) g = x;
      continue;
    }
    for (int d : e.devices) {
      if (d < 0 || static_cast<size_t>(d) >= gpus.size()) {
        *err = e.path + ": GPU " + std::to_string(d) + " is not on this host (it has " + std::to_string(gpus.size()) +
               " GPU" + (gpus.size() == 1 ? "" : "s") + ")";
        return false;
      }
      w[static_cast<size_t>(d)] = x;
    }
  }
  *out = std::move(w);
  return true;
}

std::string difference(const Gpu& g, const Wanted& w) {
  if (w.enabled && !g.capable) return "GPU " + std::to_string(g.index) + " has no MIG";
  if (!w.enabled && !g.capable) return "";
  bool same = g.enabled == w.enabled && g.pendingEnabled == w.enabled;
  if (same && w.enabled) {
    std::map<std::string, unsigned> have;
    for (const Instance& i : g.instances) {
      ++have[i.profile];
      same = same && i.fullCompute;
    }
    same = same && have == w.counts;
  }
  if (same) return "";
  return "GPU " + std::to_string(g.index) + ": has " + haveText(g) + ", wanted " + wantedText(w);
}

bool place(const Gpu& g, const Wanted& w, std::vector<std::pair<GiProfile, std::pair<unsigned, unsigned>>>* out,
           std::string* why) {
  std::vector<const GiProfile*> todo;
  for (const auto& [name, n] : w.counts) {
    const GiProfile* p = nullptr;
    for (const GiProfile& x : g.profiles)
      if (x.name == name) p = &x;
    if (p == nullptr) {
      std::string names;
      for (const GiProfile& x : g.profiles) names += (names.empty() ? "" : ", ") + x.name;
      *why = "GPU " + std::to_string(g.index) + " has no MIG profile " + name + " (it has " + names + ")";
      return false;
    }
    if (n > p->maxInstances) {
      *why = "GPU " + std::to_string(g.index) + " holds at most " + std::to_string(p->maxInstances) + " x " + name +
             ", not " + std::to_string(n);
      return false;
    }
    for (unsigned k = 0; k < n; ++k) todo.push_back(p);
  }
  // The largest first, then a search over each one's placements (at most 7 instances of a few
  // placements each): the first assignment in which none overlap.
  std::stable_sort(todo.begin(), todo.end(), [](const GiProfile* a, const GiProfile* b) { return a->slices > b->slices; });
  std::vector<std::pair<unsigned, unsigned>> chosen(todo.size());
  std::vector<bool> used(64, false);
  const auto fits = [&](std::pair<unsigned, unsigned> pl, bool take) {
    for (unsigned s = pl.first; s < pl.first + pl.second; ++s) {
      if (s >= used.size()) return false;
      if (!take && used[s]) return false;
      if (take) used[s] = !used[s];
    }
    return true;
  };
  const std::function<bool(size_t)> search = [&](size_t i) {
    if (i == todo.size()) return true;
    for (const auto& pl : todo[i]->placements) {
      if (!fits(pl, false)) continue;
      fits(pl, true);
      chosen[i] = pl;
      if (search(i + 1)) return true;
      fits(pl, true);  // take back
    }
    return false;
  };
  if (!search(0)) {
    *why = "GPU " + std::to_string(g.index) + " cannot hold " + wantedText(w).substr(8) + " at once (no placements fit)";
    return false;
  }
  out->clear();
  for (size_t i = 0; i < todo.size(); ++i) out->emplace_back(*todo[i], chosen[i]);
  return true;
}

std::vector<std::string> keyProblems(const Config& c, const std::vector<Gpu>& gpus,
                                     const std::vector<std::optional<Wanted>>& wanted) {
  std::vector<std::string> out;
  const auto changes = [&](size_t g) { return g < gpus.size() && wanted[g] && !difference(gpus[g], *wanted[g]).empty(); };
  const auto check = [&](const std::string& who, const MemorySpec& m) {
    if (m.kind != MemorySpec::kPerDevice) return;
    for (const MemorySpec::Entry& e : m.entries) {
      const std::string at = who + " (" + m.path + "." + e.key + ")";
      if (!e.uuid.empty()) {
        for (size_t g = 0; g < gpus.size(); ++g) {
          if (!changes(g)) continue;
          const bool mig = std::find_if(gpus[g].migUuids.begin(), gpus[g].migUuids.end(), [&](const std::string& u) {
                             return sameDeviceUuid(u, e.uuid);
                           }) != gpus[g].migUuids.end();
          if (mig)
            out.push_back(at + " names " + e.uuid + ", a MIG device of GPU " + std::to_string(g) +
                          " that the layout destroys: name the new one as " + std::to_string(g) + ":<mig>");
          else if (sameDeviceUuid(gpus[g].uuid, e.uuid) && wanted[g]->enabled)
            out.push_back(at + " names GPU " + std::to_string(g) + ", which the layout puts in MIG mode");
        }
        continue;
      }
      if (e.ordinal < 0 || !changes(static_cast<size_t>(e.ordinal))) continue;
      const Wanted& w = *wanted[static_cast<size_t>(e.ordinal)];
      unsigned devices = 0;
      for (const auto& [p, n] : w.counts) devices += n;
      if (e.migIndex < 0 && w.enabled)
        out.push_back(at + " names GPU " + e.key + ", which the layout puts in MIG mode");
      else if (e.migIndex >= 0 && !w.enabled)
        out.push_back(at + " names MIG device " + e.key + ", but the layout turns MIG off on GPU " +
                      std::to_string(e.ordinal));
      else if (e.migIndex >= 0 && static_cast<unsigned>(e.migIndex) >= devices)
        out.push_back(at + " names MIG device " + e.key + ", but the layout makes " + std::to_string(devices) +
                      " MIG device" + (devices == 1 ? "" : "s") + " on GPU " + std::to_string(e.ordinal));
    }
  };
  for (const Profile& p : c.profiles) check("profile " + p.name, p.memory);
  for (const Tenant& t : c.tenants)
    if (t.memory.path.rfind(t.path + ".", 0) == 0) check("tenant " + t.name, t.memory);  // a profile's: above

  // The devices the host will have, and the smallest GPU instance the layout makes.
  size_t devices = 0;
  uint64_t smallest = UINT64_MAX;
  std::string smallestName;
  bool newMig = false;
  for (size_t g = 0; g < gpus.size(); ++g) {
    if (!changes(g)) {
      devices += gpus[g].enabled ? gpus[g].migUuids.size() : 1;
      continue;
    }
    const Wanted& w = *wanted[g];
    if (!w.enabled) {
      ++devices;
      continue;
    }
    newMig = true;
    for (const auto& [name, n] : w.counts) {
      devices += n;
      for (const GiProfile& p : gpus[g].profiles)
        if (p.name == name && p.memoryBytes < smallest) {
          smallest = p.memoryBytes;
          smallestName = name + " on GPU " + std::to_string(g);
        }
    }
  }
  if (devices > kLedgerMaxDevices)
    out.push_back("the layout gives the host " + std::to_string(devices) + " devices (MIG devices count one each), more "
                  "than the " + std::to_string(kLedgerMaxDevices) + " one broker shares");
  if (!newMig) return out;
  // Single sizes apply on every device, so they must fit the smallest new GPU instance together
  // (a percentage scales with it).
  const Profile* unknown = nullptr;
  for (const Profile& p : c.profiles)
    if (p.name == c.unknownTenantsProfile) unknown = &p;
  unsigned __int128 sum = 0;
  std::string who;
  for (const Tenant& t : c.tenants)
    if (t.memory.kind == MemorySpec::kAll && !t.memory.all.isPercent()) {
      sum += t.memory.all.bytes;
      who += (who.empty() ? "" : ", ") + t.name;
    }
  if (unknown != nullptr && unknown->memory.kind == MemorySpec::kAll && !unknown->memory.all.isPercent()) {
    sum += static_cast<unsigned __int128>(unknown->memory.all.bytes) * c.maxUnknownTenants;
    who += (who.empty() ? "" : ", ") + std::string("the unknown tenants' pool");
  }
  if (smallest != UINT64_MAX && sum > smallest)
    out.push_back("the single memory sizes of " + who + " add up to " +
                  std::to_string(static_cast<uint64_t>(std::min<unsigned __int128>(sum, UINT64_MAX))) +
                  " bytes on every device, more than the smallest GPU instance the layout makes (" + smallestName + ", " +
                  std::to_string(smallest) + " bytes)");
  if (unknown != nullptr && unknown->memory.kind == MemorySpec::kPerDevice && c.maxUnknownTenants > 0)
    out.push_back("the unknown_tenants profile " + unknown->name +
                  " names its devices one by one, and the layout makes MIG devices it has no limit on (it needs one on "
                  "every device): give it a single size or a percentage");
  return out;
}

bool assertLayout(Host& host, const std::vector<MigLayoutEntry>& layout, std::vector<std::string>* differences,
                  std::string* err) {
  std::vector<Gpu> gpus;
  std::vector<std::optional<Wanted>> wanted;
  if (!host.read(&gpus, err) || !wantedOf(layout, gpus, &wanted, err)) return false;
  differences->clear();
  for (size_t g = 0; g < gpus.size(); ++g)
    if (wanted[g])
      if (std::string d = difference(gpus[g], *wanted[g]); !d.empty()) differences->push_back(d);
  return true;
}

bool applyLayout(Host& host, const Config& c, const std::vector<MigLayoutEntry>& layout, bool dryRun, Report* r,
                 std::string* err) {
  std::vector<Gpu> gpus;
  std::vector<std::optional<Wanted>> wanted;
  if (!host.read(&gpus, err) || !wantedOf(layout, gpus, &wanted, err)) return false;
  *r = Report{};
  std::vector<size_t> affected;
  for (size_t g = 0; g < gpus.size(); ++g) {
    if (!wanted[g]) continue;
    const std::string d = difference(gpus[g], *wanted[g]);
    if (d.empty()) {
      r->steps.push_back("GPU " + std::to_string(g) + ": already " + wantedText(*wanted[g]));
      continue;
    }
    if (wanted[g]->enabled && !gpus[g].capable) {
      r->problems.push_back(d);
      continue;
    }
    // Profiles, counts and placements are judged before anything is touched.
    std::vector<std::pair<GiProfile, std::pair<unsigned, unsigned>>> plan;
    std::string why;
    if (wanted[g]->enabled && !place(gpus[g], *wanted[g], &plan, &why)) {
      r->problems.push_back(why);
      continue;
    }
    if (!gpus[g].pids.empty()) {
      std::string pids;
      for (int p : gpus[g].pids) pids += (pids.empty() ? "" : " ") + std::to_string(p);
      r->problems.push_back("GPU " + std::to_string(g) + " is in use by process" + (gpus[g].pids.size() == 1 ? " " : "es ") +
                            pids + ": its layout changes only when no process runs on it (" + d + ")");
      continue;
    }
    affected.push_back(g);
  }
  for (const std::string& k : keyProblems(c, gpus, wanted)) r->problems.push_back(k);
  // Nothing is changed unless every affected GPU can be (a layout applied halfway helps no one).
  if (!r->problems.empty() || dryRun) {
    for (size_t g : affected) {
      r->steps.push_back(std::string(dryRun && r->problems.empty() ? "would change" : "not changed") + " GPU " +
                         std::to_string(g) + ": " + difference(gpus[g], *wanted[g]).substr(std::to_string(g).size() + 6));
    }
    return true;
  }
  for (size_t g : affected) {
    const int gpu = static_cast<int>(g);
    const Wanted& w = *wanted[g];
    const std::string name = "GPU " + std::to_string(g);
    if (gpus[g].enabled && !gpus[g].instances.empty()) {
      if (!host.destroyAll(gpu, err)) return false;
      r->steps.push_back(name + ": destroyed its " + std::to_string(gpus[g].instances.size()) + " GPU instance(s)");
      r->changes += gpus[g].instances.size();
    }
    if (gpus[g].enabled != w.enabled || gpus[g].pendingEnabled != w.enabled) {
      bool pending = false;
      if (!host.setMode(gpu, w.enabled, &pending, err)) return false;
      ++r->changes;
      r->steps.push_back(name + ": MIG mode " + (w.enabled ? "enabled" : "disabled") +
                         (pending ? " (pending: the driver applies it at the next GPU reset)" : ""));
      if (pending) {
        r->pendingReset = true;
        r->problems.push_back(name + ": the MIG mode change waits for a GPU reset (nvidia-smi -r -i " + std::to_string(g) +
                              " with no process on it, or a reboot); run apply again after it");
        continue;
      }
    }
    if (!w.enabled || w.counts.empty()) continue;
    std::vector<Gpu> now;
    if (!host.read(&now, err)) return false;
    std::vector<std::pair<GiProfile, std::pair<unsigned, unsigned>>> plan;
    std::string why;
    if (!place(now[g], w, &plan, &why)) {
      r->problems.push_back(why);
      continue;
    }
    for (const auto& [p, pl] : plan) {
      if (!host.create(gpu, p, pl, err)) return false;
      ++r->changes;
      r->steps.push_back(name + ": created " + p.name + " at " + std::to_string(pl.first) + ":" + std::to_string(pl.second) +
                         " with one compute instance");
    }
  }
  return true;
}

std::string applyLockPath(const Config& c) { return c.stateFile + kApplyLockSuffix; }

ApplyLock::~ApplyLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

namespace {

// Every directory above path exists (made 0755 when missing) and is a directory, not a link, of
// root or this user; others may write one only with the sticky bit (/tmp), and not the one that
// holds the lock: nobody else can swap the lock file (the broker's rule for state_file).
bool lockDirsSafe(const std::string& path, std::string* err) {
  const size_t last = path.rfind('/');
  for (size_t i = 1; i <= last; ++i) {
    if (path[i] != '/') continue;
    const std::string dir = path.substr(0, i);
    ::mkdir(dir.c_str(), 0755);
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0) {
      *err = "cannot use " + dir + " for the MIG layout lock: " + std::strerror(errno);
      return false;
    }
    const bool othersWrite = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    if (!S_ISDIR(st.st_mode) || (st.st_uid != 0 && st.st_uid != ::geteuid()) ||
        (othersWrite && (i == last || (st.st_mode & S_ISVTX) == 0))) {
      *err = "the MIG layout lock " + path + " would lie in " + dir +
             ", which is a link, or another user's, or writable by others: put state_file in a directory only root "
             "may change (docs/broker-configuration.md)";
      return false;
    }
  }
  return true;
}

}  // namespace

bool ApplyLock::acquire(const std::string& path, int waitMs, std::string* err,
                        const std::function<void(const std::string&)>& waiting) {
  if (!lockDirsSafe(path, err)) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(waitMs);
  bool said = false;
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      *err = "cannot open the MIG layout lock " + path + ": " + std::strerror(errno);
      return false;
    }
    // Checked before locking: a file others can open could be held by them for ever (flock needs
    // only a read-only descriptor), and a second name (hard link) could be someone else's file.
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || st.st_nlink != 1 ||
        (st.st_mode & 077) != 0) {
      ::close(fd);
      *err = "the MIG layout lock " + path +
             " is not a file of this user that only it may open (another user made it, it has other names, or "
             "its mode lets others open it): remove it";
      return false;
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      // Still the file at path (not one removed meanwhile, whose lock would exclude nobody)?
      struct stat now {};
      if (::stat(path.c_str(), &now) != 0 || now.st_dev != st.st_dev || now.st_ino != st.st_ino) {
        ::close(fd);
        continue;
      }
      const std::string me = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
        // Only the next one's message uses it.
      }
      if (fd_ >= 0) ::close(fd_);
      fd_ = fd;
      return true;
    }
    const int e = errno;
    char pid[24] = {};
    const ssize_t n = ::pread(fd, pid, sizeof pid - 1, 0);
    ::close(fd);
    if (e != EWOULDBLOCK && e != EINTR) {
      *err = "cannot lock " + path + ": " + std::strerror(e);
      return false;
    }
    std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string();
    holder.erase(std::remove_if(holder.begin(), holder.end(), [](char ch) { return ch < '0' || ch > '9'; }),
                 holder.end());
    const std::string who = "another cushare mig apply or starting broker" +
                            (holder.empty() ? std::string() : " (pid " + holder + ", as it recorded)") +
                            " is changing the MIG layout (it holds " + path + ")";
    if (std::chrono::steady_clock::now() >= until) {
      *err = who + "; try again when it is done";
      return false;
    }
    if (!said && waiting) waiting(who);
    said = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace cushare::broker::mig
