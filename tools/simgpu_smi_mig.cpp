// simgpu-smi's MIG commands, after `nvidia-smi` (docs/simgpu.md, "MIG"). Only NVML calls, so they
// work the same against simgpu and a real driver:
//   simgpu-smi -L                          GPUs and their MIG devices with UUIDs
//   simgpu-smi [-i N] -mig 0|1             MIG mode
//   simgpu-smi mig [-i N] -lgip            GPU instance profiles (ID, free/total, memory, SMs...)
//   simgpu-smi mig [-i N] -lgipp           their possible placements
//   simgpu-smi mig [-i N] -lgi             GPU instances
//   simgpu-smi mig [-i N] -lci             compute instances
//   simgpu-smi mig [-i N] -cgi LIST [-C]   create GPU instances (profile IDs or names, comma
//                                          separated, in order); -C: each with its full CI
//   simgpu-smi mig [-i N] -gi ID -cci LIST create compute instances (CI profile IDs)
//   simgpu-smi mig [-i N] [-gi ID] [-ci ID] -dci   destroy compute instances
//   simgpu-smi mig [-i N] [-gi ID] -dgi    destroy GPU instances (their CIs first)
// Exit status 0 on success, 1 with a message on stderr otherwise.
#include "simgpu_smi_mig.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

int fail(const std::string& what, nvmlReturn_t r) {
  std::fprintf(stderr, "simgpu-smi: %s: %s\n", what.c_str(), nvmlErrorString(r));
  return 1;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t c = s.find(',', pos);
    out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
    if (c == std::string::npos) break;
    pos = c + 1;
  }
  return out;
}

// The GPU instance profiles a device has, by NVML index.
std::vector<nvmlGpuInstanceProfileInfo_v2_t> giProfiles(nvmlDevice_t dev) {
  std::vector<nvmlGpuInstanceProfileInfo_v2_t> out;
  for (unsigned i = 0; i < NVML_GPU_INSTANCE_PROFILE_COUNT; ++i) {
    nvmlGpuInstanceProfileInfo_v2_t p = {};
    p.version = nvmlGpuInstanceProfileInfo_v2;
    if (nvmlDeviceGetGpuInstanceProfileInfoV(dev, i, &p) == NVML_SUCCESS) out.push_back(p);
  }
  return out;
}

std::vector<nvmlGpuInstance_t> gpuInstances(nvmlDevice_t dev) {
  std::vector<nvmlGpuInstance_t> out;
  for (const auto& p : giProfiles(dev)) {
    nvmlGpuInstance_t gis[8];
    unsigned n = 8;
    if (nvmlDeviceGetGpuInstances(dev, p.id, gis, &n) == NVML_SUCCESS) out.insert(out.end(), gis, gis + n);
  }
  return out;
}

std::vector<nvmlComputeInstance_t> computeInstances(nvmlGpuInstance_t gi) {
  std::vector<nvmlComputeInstance_t> out;
  for (unsigned p = 0; p < NVML_COMPUTE_INSTANCE_PROFILE_COUNT; ++p) {
    nvmlComputeInstance_t cis[8];
    unsigned n = 8;
    if (nvmlGpuInstanceGetComputeInstances(gi, p, cis, &n) == NVML_SUCCESS) out.insert(out.end(), cis, cis + n);
  }
  return out;
}

// A profile ID given as a number or a name ("3g.40gb" or "MIG 3g.40gb").
bool profileId(nvmlDevice_t dev, const std::string& s, unsigned* id) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(s.c_str(), &end, 10);
  if (!s.empty() && *end == '\0') {
    *id = static_cast<unsigned>(v);
    return true;
  }
  for (const auto& p : giProfiles(dev))
    if (s == p.name || "MIG " + s == p.name) {
      *id = p.id;
      return true;
    }
  return false;
}

int listProfiles(unsigned idx, nvmlDevice_t dev, bool placements) {
  std::printf("GPU %u profiles:\n", idx);
  for (const auto& p : giProfiles(dev)) {
    if (placements) {
      nvmlGpuInstancePlacement_t pl[8];
      unsigned n = 8;
      if (nvmlReturn_t r = nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, p.id, pl, &n); r != NVML_SUCCESS)
        return fail("placements of profile " + std::to_string(p.id), r);
      std::printf("  %-16s ID %2u  placements: {", p.name, p.id);
      for (unsigned k = 0; k < n; ++k) std::printf("%s%u", k ? "," : "", pl[k].start);
      std::printf("}:%u\n", n ? pl[0].size : 0);
      continue;
    }
    unsigned free = 0;
    nvmlDeviceGetGpuInstanceRemainingCapacity(dev, p.id, &free);
    std::printf("  %-16s ID %2u  %u/%u  %8.2f GiB  SM %3u  CE %u  DEC %u  ENC %u  JPEG %u  OFA %u\n", p.name, p.id,
                free, p.instanceCount, static_cast<double>(p.memorySizeMB) / 1024.0, p.multiprocessorCount,
                p.copyEngineCount, p.decoderCount, p.encoderCount, p.jpegCount, p.ofaCount);
  }
  return 0;
}

int listGpuInstances(unsigned idx, nvmlDevice_t dev, bool withCis) {
  const auto gis = gpuInstances(dev);
  if (gis.empty()) std::printf("GPU %u: no GPU instances\n", idx);
  for (nvmlGpuInstance_t gi : gis) {
    nvmlGpuInstanceInfo_t info = {};
    if (nvmlReturn_t r = nvmlGpuInstanceGetInfo(gi, &info); r != NVML_SUCCESS) return fail("GPU instance", r);
    nvmlGpuInstanceProfileInfo_v2_t p = {};
    p.version = nvmlGpuInstanceProfileInfo_v2;
    nvmlDeviceGetGpuInstanceProfileInfoByIdV(dev, info.profileId, &p);
    if (!withCis) {
      std::printf("GPU %u  GI %2u  %-16s profile %2u  placement %u:%u\n", idx, info.id, p.name, info.profileId,
                  info.placement.start, info.placement.size);
      continue;
    }
    for (nvmlComputeInstance_t ci : computeInstances(gi)) {
      nvmlComputeInstanceInfo_t c = {};
      if (nvmlReturn_t r = nvmlComputeInstanceGetInfo_v2(ci, &c); r != NVML_SUCCESS) return fail("compute instance", r);
      nvmlComputeInstanceProfileInfo_v2_t cp = {};
      cp.version = nvmlComputeInstanceProfileInfo_v2;
      nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi, c.profileId, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &cp);
      std::printf("GPU %u  GI %2u  CI %u  %-18s profile %u  placement %u:%u\n", idx, info.id, c.id, cp.name,
                  c.profileId, c.placement.start, c.placement.size);
    }
  }
  return 0;
}

int createGpuInstances(unsigned idx, nvmlDevice_t dev, const std::string& list, bool withCi) {
  for (const std::string& item : split(list)) {
    unsigned id = 0;
    if (!profileId(dev, item, &id)) {
      std::fprintf(stderr, "simgpu-smi: -cgi: no profile %s on GPU %u\n", item.c_str(), idx);
      return 1;
    }
    nvmlGpuInstance_t gi;
    if (nvmlReturn_t r = nvmlDeviceCreateGpuInstance(dev, id, &gi); r != NVML_SUCCESS)
      return fail("creating a GPU instance of profile " + item + " on GPU " + std::to_string(idx), r);
    nvmlGpuInstanceInfo_t info = {};
    nvmlGpuInstanceGetInfo(gi, &info);
    std::printf("Successfully created GPU instance ID %2u on GPU %u using profile %s (ID %2u)\n", info.id, idx,
                item.c_str(), id);
    if (!withCi) continue;
    // The full CI: the largest CI profile the GI has.
    for (int p = NVML_COMPUTE_INSTANCE_PROFILE_COUNT - 1; p >= 0; --p) {
      nvmlComputeInstanceProfileInfo_v2_t cp = {};
      cp.version = nvmlComputeInstanceProfileInfo_v2;
      if (nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi, static_cast<unsigned>(p),
                                                        NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &cp) != NVML_SUCCESS)
        continue;
      nvmlComputeInstance_t ci;
      if (nvmlReturn_t r = nvmlGpuInstanceCreateComputeInstance(gi, cp.id, &ci); r != NVML_SUCCESS)
        return fail("creating the compute instance of GPU instance " + std::to_string(info.id), r);
      nvmlComputeInstanceInfo_t c = {};
      nvmlComputeInstanceGetInfo_v2(ci, &c);
      std::printf("Successfully created compute instance ID %2u on GPU %u GPU instance ID %2u using profile %s (ID %2u)\n",
                  c.id, idx, info.id, cp.name, cp.id);
      break;
    }
  }
  return 0;
}

int createComputeInstances(unsigned idx, nvmlDevice_t dev, int giId, const std::string& list) {
  if (giId < 0) {
    std::fprintf(stderr, "simgpu-smi: -cci needs -gi ID\n");
    return 1;
  }
  nvmlGpuInstance_t gi;
  if (nvmlReturn_t r = nvmlDeviceGetGpuInstanceById(dev, static_cast<unsigned>(giId), &gi); r != NVML_SUCCESS)
    return fail("GPU instance " + std::to_string(giId), r);
  for (const std::string& item : split(list)) {
    char* end = nullptr;
    const unsigned long id = std::strtoul(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') {
      std::fprintf(stderr, "simgpu-smi: -cci: '%s' is not a compute instance profile ID\n", item.c_str());
      return 1;
    }
    nvmlComputeInstance_t ci;
    if (nvmlReturn_t r = nvmlGpuInstanceCreateComputeInstance(gi, static_cast<unsigned>(id), &ci); r != NVML_SUCCESS)
      return fail("creating a compute instance of profile " + item, r);
    nvmlComputeInstanceInfo_t c = {};
    nvmlComputeInstanceGetInfo_v2(ci, &c);
    std::printf("Successfully created compute instance ID %2u on GPU %u GPU instance ID %2d using profile ID %2lu\n",
                c.id, idx, giId, id);
  }
  return 0;
}

int destroy(unsigned idx, nvmlDevice_t dev, int giId, int ciId, bool gpuInstancesToo) {
  int destroyed = 0;
  for (nvmlGpuInstance_t gi : gpuInstances(dev)) {
    nvmlGpuInstanceInfo_t info = {};
    nvmlGpuInstanceGetInfo(gi, &info);
    if (giId >= 0 && info.id != static_cast<unsigned>(giId)) continue;
    for (nvmlComputeInstance_t ci : computeInstances(gi)) {
      nvmlComputeInstanceInfo_t c = {};
      nvmlComputeInstanceGetInfo_v2(ci, &c);
      if (!gpuInstancesToo && ciId >= 0 && c.id != static_cast<unsigned>(ciId)) continue;
      if (nvmlReturn_t r = nvmlComputeInstanceDestroy(ci); r != NVML_SUCCESS)
        return fail("destroying compute instance " + std::to_string(c.id) + " of GPU instance " + std::to_string(info.id), r);
      std::printf("Successfully destroyed compute instance ID %2u from GPU %u GPU instance ID %2u\n", c.id, idx, info.id);
      ++destroyed;
    }
    if (!gpuInstancesToo) continue;
    if (nvmlReturn_t r = nvmlGpuInstanceDestroy(gi); r != NVML_SUCCESS)
      return fail("destroying GPU instance " + std::to_string(info.id), r);
    std::printf("Successfully destroyed GPU instance ID %2u from GPU %u\n", info.id, idx);
    ++destroyed;
  }
  if (destroyed == 0) {
    std::fprintf(stderr, "simgpu-smi: GPU %u: nothing to destroy\n", idx);
    return 1;
  }
  return 0;
}

}  // namespace

int forEachGpu(int index, const std::function<int(unsigned, nvmlDevice_t)>& f) {
  unsigned count = 0;
  nvmlDeviceGetCount_v2(&count);
  for (unsigned i = 0; i < count; ++i) {
    if (index >= 0 && i != static_cast<unsigned>(index)) continue;
    nvmlDevice_t dev;
    if (nvmlReturn_t r = nvmlDeviceGetHandleByIndex_v2(i, &dev); r != NVML_SUCCESS) return fail("GPU " + std::to_string(i), r);
    if (const int rc = f(i, dev); rc != 0) return rc;
  }
  return 0;
}

int smiListWithMig() {
  unsigned count = 0;
  nvmlDeviceGetCount_v2(&count);
  for (unsigned i = 0; i < count; ++i) {
    nvmlDevice_t dev;
    if (nvmlDeviceGetHandleByIndex_v2(i, &dev) != NVML_SUCCESS) continue;
    char name[96] = {}, uuid[96] = {};
    nvmlDeviceGetName(dev, name, sizeof name);
    nvmlDeviceGetUUID(dev, uuid, sizeof uuid);
    std::printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
    unsigned max = 0;
    nvmlDeviceGetMaxMigDeviceCount(dev, &max);
    for (unsigned j = 0; j < max; ++j) {
      nvmlDevice_t m;
      if (nvmlDeviceGetMigDeviceHandleByIndex(dev, j, &m) != NVML_SUCCESS) continue;
      char mname[96] = {}, muuid[96] = {};
      nvmlDeviceGetName(m, mname, sizeof mname);
      nvmlDeviceGetUUID(m, muuid, sizeof muuid);
      unsigned gi = 0, ci = 0;
      nvmlDeviceGetGpuInstanceId(m, &gi);
      nvmlDeviceGetComputeInstanceId(m, &ci);
      const char* profile = std::strstr(mname, " MIG ");
      std::printf("  MIG %-14s Device %2u: (UUID: %s) GI %u CI %u\n", profile ? profile + 5 : mname, j, muuid, gi, ci);
    }
  }
  return 0;
}

int smiSetMigMode(int index, const char* mode) {
  if (std::strcmp(mode, "0") != 0 && std::strcmp(mode, "1") != 0) {
    std::fprintf(stderr, "simgpu-smi: -mig takes 0 or 1\n");
    return 1;
  }
  const unsigned m = mode[0] == '1' ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
  return forEachGpu(index, [&](unsigned i, nvmlDevice_t dev) {
    nvmlReturn_t activation = NVML_SUCCESS;
    if (nvmlReturn_t r = nvmlDeviceSetMigMode(dev, m, &activation); r != NVML_SUCCESS)
      return fail("setting MIG mode on GPU " + std::to_string(i), r);
    char bus[32] = {};
    nvmlPciInfo_t pci = {};
    if (nvmlDeviceGetPciInfo_v3(dev, &pci) == NVML_SUCCESS) std::snprintf(bus, sizeof bus, "%s", pci.busId);
    if (activation == NVML_SUCCESS)
      std::printf("%s MIG Mode for GPU %s.\n", m ? "Enabled" : "Disabled", bus);
    else
      std::printf("Warning: MIG mode is in pending %s state for GPU %s: %s\nReboot the system or reset the GPU "
                  "(simgpu-smi --gpu-reset -i %u).\n",
                  m ? "enable" : "disable", bus, nvmlErrorString(activation), i);
    return 0;
  });
}

int smiMig(int argc, char** argv) {
  int index = -1, gi = -1, ci = -1;
  std::string action, list;
  bool withCi = false;
  for (int a = 0; a < argc; ++a) {
    const std::string s = argv[a];
    auto next = [&](const char* what) -> const char* {
      if (a + 1 >= argc) {
        std::fprintf(stderr, "simgpu-smi: mig %s needs a value\n", what);
        std::exit(1);
      }
      return argv[++a];
    };
    if (s == "-i") index = std::atoi(next("-i"));
    else if (s == "-gi") gi = std::atoi(next("-gi"));
    else if (s == "-ci") ci = std::atoi(next("-ci"));
    else if (s == "-C") withCi = true;
    else if (s == "-cgi" || s == "-cci") {
      action = s;
      list = next(s.c_str());
    } else if (s == "-lgip" || s == "-lgipp" || s == "-lgi" || s == "-lci" || s == "-dci" || s == "-dgi") action = s;
    else {
      std::fprintf(stderr, "simgpu-smi: mig: unknown option %s (see the comment of tools/simgpu_smi_mig.cpp)\n",
                   s.c_str());
      return 1;
    }
  }
  if (action.empty()) {
    std::fprintf(stderr, "simgpu-smi: mig: what to do? -lgip, -lgipp, -lgi, -lci, -cgi, -cci, -dci or -dgi\n");
    return 1;
  }
  return forEachGpu(index, [&](unsigned i, nvmlDevice_t dev) {
    if (action == "-lgip" || action == "-lgipp") return listProfiles(i, dev, action == "-lgipp");
    if (action == "-lgi" || action == "-lci") return listGpuInstances(i, dev, action == "-lci");
    if (action == "-cgi") return createGpuInstances(i, dev, list, withCi);
    if (action == "-cci") return createComputeInstances(i, dev, gi, list);
    return destroy(i, dev, gi, ci, action == "-dgi");
  });
}
