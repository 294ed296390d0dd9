// MIG through NVML, as the real library presents it (docs/simgpu.md, "MIG"): the mode, GPU and
// compute instance profiles, placements, capacity, creation and destruction, and MIG device
// handles, over the host-wide MIG state (simgpu/src/mig.h) that every process sees.
//
// Invariants:
// - Only a board of a known model (SIMGPU_GPU_MODEL) has MIG; on any other every MIG call but
//   nvmlDeviceGetMigMode (disabled) answers NOT_SUPPORTED.
// - The state is read afresh by every call (another process may have changed it); a change is one
//   mig::update, so it happens whole or not at all.
// - What NVIDIA's header marks "requires root" or "privileged user" answers NO_PERMISSION to any
//   other user (simgpu has no mig/config capability file to grant it).
// - GPU and compute instance handles are pointers into leaked tables (one per parent and GI ID,
//   one per CI ID): like the real ones they may be reused after a destroy, and a call on a handle
//   whose instance is gone answers INVALID_ARGUMENT.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "nvml_internal.h"

namespace simgpu::nvml {
namespace {

struct GiHandle {
  int parent;
  unsigned id;
};
struct CiHandle {
  int parent;
  unsigned gi, id;
};

// Leaked tables of handles: [parent][GI id] and [parent][GI id][CI id].
GiHandle* giTable() {
  static GiHandle* t = [] {
    auto* p = new GiHandle[static_cast<size_t>(kMaxDevices) * mig::kMaxGpuInstances];
    for (int d = 0; d < kMaxDevices; ++d)
      for (int g = 0; g < mig::kMaxGpuInstances; ++g) p[d * mig::kMaxGpuInstances + g] = {d, static_cast<unsigned>(g)};
    return p;
  }();
  return t;
}
CiHandle* ciTable() {
  static CiHandle* t = [] {
    constexpr int per = mig::kMaxGpuInstances * mig::kMaxComputeInstances;
    auto* p = new CiHandle[static_cast<size_t>(kMaxDevices) * per];
    for (int d = 0; d < kMaxDevices; ++d)
      for (int g = 0; g < mig::kMaxGpuInstances; ++g)
        for (int c = 0; c < mig::kMaxComputeInstances; ++c)
          p[d * per + g * mig::kMaxComputeInstances + c] = {d, static_cast<unsigned>(g), static_cast<unsigned>(c)};
    return p;
  }();
  return t;
}

nvmlGpuInstance_t giHandle(int parent, unsigned id) {
  return reinterpret_cast<nvmlGpuInstance_t>(&giTable()[parent * mig::kMaxGpuInstances + static_cast<int>(id)]);
}
nvmlComputeInstance_t ciHandle(int parent, unsigned gi, unsigned id) {
  return reinterpret_cast<nvmlComputeInstance_t>(
      &ciTable()[parent * mig::kMaxGpuInstances * mig::kMaxComputeInstances +
                 static_cast<int>(gi) * mig::kMaxComputeInstances + static_cast<int>(id)]);
}

// Pointer arithmetic on integers, as fromHandle does.
template <typename T>
T* inTable(const void* h, T* base, size_t n) {
  const auto p = reinterpret_cast<uintptr_t>(h), b = reinterpret_cast<uintptr_t>(base);
  if (!h || p < b || (p - b) % sizeof(T) != 0 || (p - b) / sizeof(T) >= n) return nullptr;
  return &base[(p - b) / sizeof(T)];
}

bool privileged() { return ::geteuid() == 0; }

bool load(mig::State* s) {
  std::string err;
  if (mig::load(stateDir(), s, &err)) return true;
  std::fprintf(stderr, "%s\n", err.c_str());
  return false;
}

// The usual start of a parent-device MIG call: the device, the model and the state.
struct Parent {
  nvmlDevice_st* d = nullptr;
  const mig::Model* m = nullptr;
  mig::State s;
  mig::DeviceMig& dev() { return s.dev[d->host]; }
};

nvmlReturn_t parent(nvmlDevice_t handle, Parent* p, bool needEnabled, bool needPrivilege) {
  if (nvmlReturn_t r = checkDevice(handle, &p->d); r != NVML_SUCCESS) return r;
  p->m = model();
  if (!p->m) return NVML_ERROR_NOT_SUPPORTED;
  if (!load(&p->s)) return NVML_ERROR_UNKNOWN;
  if (needEnabled && p->dev().current != NVML_DEVICE_MIG_ENABLE) return NVML_ERROR_NOT_SUPPORTED;
  if (needPrivilege && !privileged()) return NVML_ERROR_NO_PERMISSION;
  return NVML_SUCCESS;
}

// A GPU instance handle that names a live GI.
struct Instance {
  Parent p;
  GiHandle* h = nullptr;
  const mig::GiProfile* profile = nullptr;
  mig::Gi& gi() { return p.dev().gi[h->id]; }
};

nvmlReturn_t instance(nvmlGpuInstance_t handle, Instance* in, bool needPrivilege) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  in->h = inTable(handle, giTable(), static_cast<size_t>(kMaxDevices) * mig::kMaxGpuInstances);
  if (!in->h || in->h->parent >= deviceCount()) return NVML_ERROR_INVALID_ARGUMENT;
  if (nvmlReturn_t r = parent(reinterpret_cast<nvmlDevice_t>(device(in->h->parent)), &in->p, true, false);
      r != NVML_SUCCESS)
    return r == NVML_ERROR_NOT_SUPPORTED ? NVML_ERROR_INVALID_ARGUMENT : r;
  if (!in->gi().used) return NVML_ERROR_INVALID_ARGUMENT;
  in->profile = mig::giProfileById(*in->p.m, in->gi().profileId);
  if (!in->profile) return NVML_ERROR_UNKNOWN;
  if (needPrivilege && !privileged()) return NVML_ERROR_NO_PERMISSION;
  return NVML_SUCCESS;
}

void fillGiInfo(const mig::GiProfile& p, unsigned* id, unsigned* slices, unsigned* instances, unsigned* sms,
                unsigned* ce, unsigned* dec, unsigned* enc, unsigned* jpeg, unsigned* ofa, unsigned long long* mb) {
  *id = p.id;
  *slices = p.slices;
  *instances = p.instances;
  *sms = p.sms;
  *ce = p.ce;
  *dec = p.dec;
  *enc = p.enc;
  *jpeg = p.jpeg;
  *ofa = p.ofa;
  *mb = p.memoryMiB;
}

nvmlReturn_t giProfileInfoV(const mig::GiProfile& p, nvmlGpuInstanceProfileInfo_v2_t* info) {
  if (info->version == nvmlGpuInstanceProfileInfo_v2) {
    fillGiInfo(p, &info->id, &info->sliceCount, &info->instanceCount, &info->multiprocessorCount,
               &info->copyEngineCount, &info->decoderCount, &info->encoderCount, &info->jpegCount, &info->ofaCount,
               &info->memorySizeMB);
    info->isP2pSupported = 0;
    std::snprintf(info->name, sizeof info->name, "MIG %s", p.name);
    return NVML_SUCCESS;
  }
  if (info->version == nvmlGpuInstanceProfileInfo_v3) {
    auto* v3 = reinterpret_cast<nvmlGpuInstanceProfileInfo_v3_t*>(info);
    fillGiInfo(p, &v3->id, &v3->sliceCount, &v3->instanceCount, &v3->multiprocessorCount, &v3->copyEngineCount,
               &v3->decoderCount, &v3->encoderCount, &v3->jpegCount, &v3->ofaCount, &v3->memorySizeMB);
    std::snprintf(v3->name, sizeof v3->name, "MIG %s", p.name);
    v3->capabilities = 0;
    return NVML_SUCCESS;
  }
  return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
}

nvmlReturn_t createGi(nvmlDevice_t handle, unsigned profileId, const nvmlGpuInstancePlacement_t* placement,
                      nvmlGpuInstance_t* out) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, true, true); r != NVML_SUCCESS) return r;
  if (!out) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::GiProfile* prof = mig::giProfileById(*p.m, profileId);
  if (!prof) return NVML_ERROR_INVALID_ARGUMENT;
  if (placement && placement->size != prof->memSlices) return NVML_ERROR_INVALID_ARGUMENT;
  const int host = p.d->host;
  const mig::Model& m = *p.m;
  nvmlReturn_t result = NVML_ERROR_INSUFFICIENT_RESOURCES;
  unsigned id = 0;
  std::string err;
  mig::update(
      stateDir(),
      [&](mig::State* s) {
        mig::DeviceMig& d = s->dev[host];
        if (d.current != NVML_DEVICE_MIG_ENABLE) {
          result = NVML_ERROR_NOT_SUPPORTED;
          return false;
        }
        const int start = placement ? static_cast<int>(placement->start) : mig::defaultStart(d, *prof);
        if (start < 0 || !mig::fits(m, d, *prof, static_cast<unsigned>(start))) return false;
        id = mig::addGi(d, *prof, static_cast<unsigned>(start));
        result = NVML_SUCCESS;
        return true;
      },
      &err);
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return NVML_ERROR_UNKNOWN;
  }
  if (result == NVML_SUCCESS) *out = giHandle(p.d->ordinal, id);
  return result;
}

nvmlReturn_t createCi(nvmlGpuInstance_t handle, unsigned profileId, const nvmlComputeInstancePlacement_t* placement,
                      nvmlComputeInstance_t* out) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, true); r != NVML_SUCCESS) return r;
  if (!out) return NVML_ERROR_INVALID_ARGUMENT;
  mig::CiProfile cp;
  if (!mig::ciProfile(*in.profile, profileId, &cp)) return NVML_ERROR_INVALID_ARGUMENT;
  if (placement && placement->size != cp.slices) return NVML_ERROR_INVALID_ARGUMENT;
  const int host = in.p.d->host;
  const unsigned giId = in.h->id;
  const mig::GiProfile& gp = *in.profile;
  nvmlReturn_t result = NVML_ERROR_INSUFFICIENT_RESOURCES;
  unsigned id = 0;
  std::string err;
  mig::update(
      stateDir(),
      [&](mig::State* s) {
        mig::Gi& gi = s->dev[host].gi[giId];
        if (!gi.used || s->dev[host].current != NVML_DEVICE_MIG_ENABLE) {
          result = NVML_ERROR_INVALID_ARGUMENT;
          return false;
        }
        const int start = placement ? static_cast<int>(placement->start) : mig::defaultCiStart(gi, gp, cp);
        if (start < 0 || !mig::ciFits(gi, gp, cp, static_cast<unsigned>(start))) return false;
        const int ci = mig::addCi(gi, cp, static_cast<unsigned>(start));
        if (ci < 0) return false;
        id = static_cast<unsigned>(ci);
        result = NVML_SUCCESS;
        return true;
      },
      &err);
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return NVML_ERROR_UNKNOWN;
  }
  if (result == NVML_SUCCESS) *out = ciHandle(in.p.d->ordinal, giId, id);
  return result;
}

// Whether any process has a context or memory on host device `host` now.
bool busy(int host) {
  int total = 0;
  SharedState::ProcUsage one[1];
  state()->processes(host, one, 1, &total);
  return total > 0;
}

}  // namespace

nvmlReturn_t checkDeviceOrMig(nvmlDevice_t handle, nvmlDevice_st** out, mig::MigDevice* migOut, bool* isMig) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (nvmlDevice_st* d = fromHandle(handle)) {
    *out = d;
    *isMig = false;
    return NVML_SUCCESS;
  }
  nvmlDevice_st* m = fromMigHandle(handle);
  if (!m || !model()) return NVML_ERROR_INVALID_ARGUMENT;
  mig::State s;
  if (!load(&s)) return NVML_ERROR_UNKNOWN;
  const std::vector<mig::MigDevice> devs = mig::migDevices(*model(), s.dev[m->host]);
  if (m->migIndex >= devs.size()) return NVML_ERROR_INVALID_ARGUMENT;
  *migOut = devs[m->migIndex];
  *out = m;
  *isMig = true;
  return NVML_SUCCESS;
}

bool migMode(int host, unsigned* current, unsigned* pending) {
  *current = *pending = NVML_DEVICE_MIG_DISABLE;
  if (!model()) return true;  // a board without MIG
  mig::State s;
  if (!load(&s)) return false;
  *current = s.dev[host].current;
  *pending = s.dev[host].pending;
  return true;
}

bool migEnabled(int host) {
  unsigned current, pending;
  return migMode(host, &current, &pending) && current == NVML_DEVICE_MIG_ENABLE;
}

}  // namespace simgpu::nvml

using namespace simgpu;
using namespace simgpu::nvml;

// ---- Mode ----

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t handle, unsigned int* currentMode,
                                                  unsigned int* pendingMode) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!currentMode || !pendingMode) return NVML_ERROR_INVALID_ARGUMENT;
  return migMode(d->host, currentMode, pendingMode) ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

// Root only. Refused (IN_USE) while a process has a context on the GPU or instances exist. A board
// that changes mode without a reset (Hopper) switches at once; an A100 keeps the new mode pending
// (activation status RESET_REQUIRED) until the GPU is reset (simgpu-smi --gpu-reset).
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t handle, unsigned int mode,
                                                  nvmlReturn_t* activationStatus) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, false, false); r != NVML_SUCCESS) return r;
  if (!activationStatus || (mode != NVML_DEVICE_MIG_DISABLE && mode != NVML_DEVICE_MIG_ENABLE))
    return NVML_ERROR_INVALID_ARGUMENT;
  if (!privileged()) return NVML_ERROR_NO_PERMISSION;
  const int host = p.d->host;
  if (busy(host)) return NVML_ERROR_IN_USE;
  const bool resetless = p.m->resetless;
  nvmlReturn_t result = NVML_SUCCESS;
  std::string err;
  mig::update(
      stateDir(),
      [&](mig::State* s) {
        mig::DeviceMig& d = s->dev[host];
        for (const mig::Gi& gi : d.gi)
          if (gi.used) {
            result = NVML_ERROR_IN_USE;  // instances first (mig-parted destroys them before a mode change)
            return false;
          }
        d.pending = mode;
        if (resetless) d.current = mode;
        return true;
      },
      &err);
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    return NVML_ERROR_UNKNOWN;
  }
  if (result == NVML_SUCCESS) *activationStatus = resetless ? NVML_SUCCESS : NVML_ERROR_RESET_REQUIRED;
  return result;
}

// ---- GPU instance profiles, placements, capacity ----

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t handle, unsigned int profile,
                                                                 nvmlGpuInstanceProfileInfo_t* info) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, false, false); r != NVML_SUCCESS) return r;
  if (!info || profile >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::GiProfile* g = mig::giProfileByIndex(*p.m, profile);
  if (!g) return NVML_ERROR_NOT_SUPPORTED;
  fillGiInfo(*g, &info->id, &info->sliceCount, &info->instanceCount, &info->multiprocessorCount,
             &info->copyEngineCount, &info->decoderCount, &info->encoderCount, &info->jpegCount, &info->ofaCount,
             &info->memorySizeMB);
  info->isP2pSupported = 0;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t handle, unsigned int profile,
                                                                  nvmlGpuInstanceProfileInfo_v2_t* info) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, false, false); r != NVML_SUCCESS) return r;
  if (!info || profile >= NVML_GPU_INSTANCE_PROFILE_COUNT) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::GiProfile* g = mig::giProfileByIndex(*p.m, profile);
  if (!g) return NVML_ERROR_NOT_SUPPORTED;
  return giProfileInfoV(*g, info);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t handle, unsigned int profileId,
                                                                      nvmlGpuInstanceProfileInfo_v2_t* info) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, false, false); r != NVML_SUCCESS) return r;
  if (!info) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::GiProfile* g = mig::giProfileById(*p.m, profileId);
  if (!g) return NVML_ERROR_INVALID_ARGUMENT;
  return giProfileInfoV(*g, info);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t handle, unsigned int profileId,
                                                                           nvmlGpuInstancePlacement_t* placements,
                                                                           unsigned int* count) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, false, true); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::GiProfile* g = mig::giProfileById(*p.m, profileId);
  if (!g) return NVML_ERROR_INVALID_ARGUMENT;
  const auto n = static_cast<unsigned>(g->starts.size());
  if (!placements) {
    *count = n;
    return NVML_SUCCESS;
  }
  if (*count < n) {
    *count = n;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (unsigned i = 0; i < n; ++i) placements[i] = {g->starts[i], g->memSlices};
  *count = n;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t handle, unsigned int profileId,
                                                                       unsigned int* count) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, true, true); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::GiProfile* g = mig::giProfileById(*p.m, profileId);
  if (!g) return NVML_ERROR_INVALID_ARGUMENT;
  *count = mig::remaining(*p.m, p.dev(), *g);
  return NVML_SUCCESS;
}

// ---- GPU instances ----

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                         nvmlGpuInstance_t* gpuInstance) {
  return createGi(device, profileId, nullptr, gpuInstance);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                                      const nvmlGpuInstancePlacement_t* placement,
                                                                      nvmlGpuInstance_t* gpuInstance) {
  if (!placement) return initialized() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
  return createGi(device, profileId, placement, gpuInstance);
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t handle) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, true); r != NVML_SUCCESS) return r;
  const int host = in.p.d->host;
  const unsigned id = in.h->id;
  nvmlReturn_t result = NVML_SUCCESS;
  std::string err;
  mig::update(
      stateDir(),
      [&](mig::State* s) {
        mig::Gi& gi = s->dev[host].gi[id];
        if (!gi.used) {
          result = NVML_ERROR_INVALID_ARGUMENT;
          return false;
        }
        if (state()->instanceInUse(host, id, ~0u)) {  // under the state's lock: see chooseMigDevice
          result = NVML_ERROR_IN_USE;
          return false;
        }
        for (const mig::Ci& c : gi.ci)
          if (c.used) {
            result = NVML_ERROR_IN_USE;  // its compute instances first
            return false;
          }
        gi = mig::Gi{};
        return true;
      },
      &err);
  if (!err.empty()) return NVML_ERROR_UNKNOWN;
  return result;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t handle, unsigned int profileId,
                                                       nvmlGpuInstance_t* gpuInstances, unsigned int* count) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, true, true); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  if (!mig::giProfileById(*p.m, profileId)) return NVML_ERROR_INVALID_ARGUMENT;
  std::vector<unsigned> ids;
  for (const mig::Gi& gi : p.dev().gi)
    if (gi.used && gi.profileId == profileId) ids.push_back(gi.id);
  if (!gpuInstances && !ids.empty()) return NVML_ERROR_INVALID_ARGUMENT;
  if (*count < ids.size()) {
    *count = static_cast<unsigned>(ids.size());
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (size_t i = 0; i < ids.size(); ++i) gpuInstances[i] = giHandle(p.d->ordinal, ids[i]);
  *count = static_cast<unsigned>(ids.size());
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t handle, unsigned int id,
                                                          nvmlGpuInstance_t* gpuInstance) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, true, true); r != NVML_SUCCESS) return r;
  if (!gpuInstance) return NVML_ERROR_INVALID_ARGUMENT;
  if (id >= mig::kMaxGpuInstances || !p.dev().gi[id].used) return NVML_ERROR_NOT_FOUND;
  *gpuInstance = giHandle(p.d->ordinal, id);
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t handle, nvmlGpuInstanceInfo_t* info) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, false); r != NVML_SUCCESS) return r;
  if (!info) return NVML_ERROR_INVALID_ARGUMENT;
  info->device = reinterpret_cast<nvmlDevice_t>(in.p.d);
  info->id = in.gi().id;
  info->profileId = in.gi().profileId;
  info->placement = {in.gi().start, in.gi().size};
  return NVML_SUCCESS;
}

// ---- Compute instances ----

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t handle, unsigned int profile,
                                                                          unsigned int engProfile,
                                                                          nvmlComputeInstanceProfileInfo_t* info) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, false); r != NVML_SUCCESS) return r;
  if (!info || profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT ||
      engProfile >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
    return NVML_ERROR_INVALID_ARGUMENT;
  mig::CiProfile cp;
  if (!mig::ciProfile(*in.profile, profile, &cp)) return NVML_ERROR_NOT_SUPPORTED;
  *info = {cp.index, cp.slices, cp.instances, cp.sms, in.profile->ce, in.profile->dec, in.profile->enc,
           in.profile->jpeg, in.profile->ofa};
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t handle,
                                                                           unsigned int profile, unsigned int engProfile,
                                                                           nvmlComputeInstanceProfileInfo_v2_t* info) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, false); r != NVML_SUCCESS) return r;
  if (!info || profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT ||
      engProfile >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT)
    return NVML_ERROR_INVALID_ARGUMENT;
  mig::CiProfile cp;
  if (!mig::ciProfile(*in.profile, profile, &cp)) return NVML_ERROR_NOT_SUPPORTED;
  if (info->version != nvmlComputeInstanceProfileInfo_v2 && info->version != nvmlComputeInstanceProfileInfo_v3)
    return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  const unsigned version = info->version;
  info->id = cp.index;
  info->sliceCount = cp.slices;
  info->instanceCount = cp.instances;
  info->multiprocessorCount = cp.sms;
  info->sharedCopyEngineCount = in.profile->ce;
  info->sharedDecoderCount = in.profile->dec;
  info->sharedEncoderCount = in.profile->enc;
  info->sharedJpegCount = in.profile->jpeg;
  info->sharedOfaCount = in.profile->ofa;
  std::snprintf(info->name, sizeof info->name, "MIG %s", mig::profileName(*in.profile, cp).c_str());
  if (version == nvmlComputeInstanceProfileInfo_v3)
    reinterpret_cast<nvmlComputeInstanceProfileInfo_v3_t*>(info)->capabilities = 0;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t handle,
                                                                                unsigned int profileId,
                                                                                unsigned int* count) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, true); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  mig::CiProfile cp;
  if (!mig::ciProfile(*in.profile, profileId, &cp)) return NVML_ERROR_INVALID_ARGUMENT;
  *count = mig::ciRemaining(in.gi(), *in.profile, cp);
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    nvmlGpuInstance_t handle, unsigned int profileId, nvmlComputeInstancePlacement_t* placements, unsigned int* count) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, true); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  mig::CiProfile cp;
  if (!mig::ciProfile(*in.profile, profileId, &cp)) return NVML_ERROR_INVALID_ARGUMENT;
  const std::vector<unsigned> starts = mig::ciStarts(*in.profile, cp);
  const auto n = static_cast<unsigned>(starts.size());
  if (!placements) {
    *count = n;
    return NVML_SUCCESS;
  }
  if (*count < n) {
    *count = n;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (unsigned i = 0; i < n; ++i) placements[i] = {starts[i], cp.slices};
  *count = n;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                                  nvmlComputeInstance_t* computeInstance) {
  return createCi(gpuInstance, profileId, nullptr, computeInstance);
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId, const nvmlComputeInstancePlacement_t* placement,
    nvmlComputeInstance_t* computeInstance) {
  if (!placement) return initialized() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
  return createCi(gpuInstance, profileId, placement, computeInstance);
}

namespace {

// A compute instance handle that names a live CI (and its GI).
nvmlReturn_t computeInstance(nvmlComputeInstance_t handle, Instance* in, CiHandle** h, bool needPrivilege) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  *h = inTable(handle, ciTable(),
               static_cast<size_t>(kMaxDevices) * mig::kMaxGpuInstances * mig::kMaxComputeInstances);
  if (!*h || (*h)->parent >= deviceCount()) return NVML_ERROR_INVALID_ARGUMENT;
  if (nvmlReturn_t r = instance(giHandle((*h)->parent, (*h)->gi), in, needPrivilege); r != NVML_SUCCESS) return r;
  if (!in->gi().ci[(*h)->id].used) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_SUCCESS;
}

}  // namespace

// Refused (IN_USE) while a process runs in it.
SIMGPU_NVML_API nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t handle) {
  Instance in;
  CiHandle* h;
  if (nvmlReturn_t r = computeInstance(handle, &in, &h, true); r != NVML_SUCCESS) return r;
  const int host = in.p.d->host;
  std::string err;
  const unsigned gi = h->gi, id = h->id;
  bool gone = false, used = false;
  mig::update(
      stateDir(),
      [&](mig::State* s) {
        mig::Ci& c = s->dev[host].gi[gi].ci[id];
        if (!c.used) {
          gone = true;
          return false;
        }
        if (state()->instanceInUse(host, gi, id)) {  // under the state's lock: see chooseMigDevice
          used = true;
          return false;
        }
        c = mig::Ci{};
        return true;
      },
      &err);
  if (!err.empty()) return NVML_ERROR_UNKNOWN;
  return gone ? NVML_ERROR_INVALID_ARGUMENT : used ? NVML_ERROR_IN_USE : NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t handle, unsigned int profileId,
                                                                nvmlComputeInstance_t* computeInstances,
                                                                unsigned int* count) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, true); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  mig::CiProfile cp;
  if (!mig::ciProfile(*in.profile, profileId, &cp)) return NVML_ERROR_INVALID_ARGUMENT;
  std::vector<unsigned> ids;
  for (const mig::Ci& c : in.gi().ci)
    if (c.used && c.profile == profileId) ids.push_back(c.id);
  if (!computeInstances && !ids.empty()) return NVML_ERROR_INVALID_ARGUMENT;
  if (*count < ids.size()) {
    *count = static_cast<unsigned>(ids.size());
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  for (size_t i = 0; i < ids.size(); ++i) computeInstances[i] = ciHandle(in.p.d->ordinal, in.h->id, ids[i]);
  *count = static_cast<unsigned>(ids.size());
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t handle, unsigned int id,
                                                                   nvmlComputeInstance_t* computeInstance) {
  Instance in;
  if (nvmlReturn_t r = instance(handle, &in, true); r != NVML_SUCCESS) return r;
  if (!computeInstance) return NVML_ERROR_INVALID_ARGUMENT;
  if (id >= mig::kMaxComputeInstances || !in.gi().ci[id].used) return NVML_ERROR_NOT_FOUND;
  *computeInstance = ciHandle(in.p.d->ordinal, in.h->id, id);
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t handle,
                                                           nvmlComputeInstanceInfo_t* info) {
  Instance in;
  CiHandle* h;
  if (nvmlReturn_t r = computeInstance(handle, &in, &h, false); r != NVML_SUCCESS) return r;
  if (!info) return NVML_ERROR_INVALID_ARGUMENT;
  const mig::Ci& c = in.gi().ci[h->id];
  info->device = reinterpret_cast<nvmlDevice_t>(in.p.d);
  info->gpuInstance = giHandle(h->parent, h->gi);
  info->id = c.id;
  info->profileId = c.profile;
  info->placement = {c.start, c.size};
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t handle, nvmlComputeInstanceInfo_t* info) {
  return nvmlComputeInstanceGetInfo_v2(handle, info);
}

// ---- MIG device handles ----

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t handle, unsigned int* count) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!count) return NVML_ERROR_INVALID_ARGUMENT;
  unsigned current, pending;
  if (!migMode(d->host, &current, &pending)) return NVML_ERROR_UNKNOWN;
  *count = current == NVML_DEVICE_MIG_ENABLE ? mig::kMaxMigDevices : 0;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t handle, unsigned int index,
                                                                 nvmlDevice_t* migDevice) {
  Parent p;
  if (nvmlReturn_t r = parent(handle, &p, true, false); r != NVML_SUCCESS) return r;
  if (!migDevice || index >= static_cast<unsigned>(mig::kMaxMigDevices)) return NVML_ERROR_INVALID_ARGUMENT;
  if (index >= mig::migDevices(*p.m, p.dev()).size()) return NVML_ERROR_NOT_FOUND;
  *migDevice = reinterpret_cast<nvmlDevice_t>(migHandle(p.d->ordinal, index));
  return NVML_SUCCESS;
}

namespace {

// The preamble of the queries about a MIG device: a device or live MIG handle and a non-null out
// pointer; for a handle that is not a MIG device's, `notMig` (nothing written).
template <typename T, typename F>
nvmlReturn_t migQuery(nvmlDevice_t handle, T* out, nvmlReturn_t notMig, F answer) {
  nvmlDevice_st* d;
  mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!out) return NVML_ERROR_INVALID_ARGUMENT;
  if (!isMig) return notMig;
  *out = answer(*d, m);
  return NVML_SUCCESS;
}

}  // namespace

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t handle, unsigned int* isMigDevice) {
  nvmlDevice_st* d;
  mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!isMigDevice) return NVML_ERROR_INVALID_ARGUMENT;
  *isMigDevice = isMig ? 1 : 0;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t handle, unsigned int* id) {
  return migQuery(handle, id, NVML_ERROR_NOT_SUPPORTED, [](const nvmlDevice_st&, const mig::MigDevice& m) { return m.gi; });
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t handle, unsigned int* id) {
  return migQuery(handle, id, NVML_ERROR_NOT_SUPPORTED, [](const nvmlDevice_st&, const mig::MigDevice& m) { return m.ci; });
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t handle, nvmlDevice_t* device) {
  return migQuery(handle, device, NVML_ERROR_INVALID_ARGUMENT, [](const nvmlDevice_st& d, const mig::MigDevice&) {
    return reinterpret_cast<nvmlDevice_t>(nvml::device(d.migParent));
  });
}

// MIG device handles only, as NVIDIA's header says.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t handle, nvmlDeviceAttributes_t* attributes) {
  return migQuery(handle, attributes, NVML_ERROR_NOT_SUPPORTED, [](const nvmlDevice_st&, const mig::MigDevice& m) {
    return nvmlDeviceAttributes_t{m.ciProfile.sms, m.giProfile->ce, m.giProfile->dec, m.giProfile->enc,
                                  m.giProfile->jpeg, m.giProfile->ofa, m.giProfile->slices, m.ciProfile.slices,
                                  m.giProfile->memoryMiB};
  });
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t handle, nvmlDeviceAttributes_t* attributes) {
  return nvmlDeviceGetAttributes_v2(handle, attributes);
}
