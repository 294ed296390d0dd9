// The broker's CDI spec; see containers.h.
#include "core/containers.h"

#include <sys/stat.h>

#include <algorithm>

#include "container/cdi.h"
#include "container/mig_nodes.h"
#include "core/log.h"
#include "core/places.h"

namespace cushare::broker {

bool hostPlaces(const Config& c, const std::string& mpsPipeDir, bool mustExist, container::HostPlaces* out,
                std::string* err) {
  container::HostPlaces h;
  if (!container::findShim(c.cdi.shim, mustExist, &h.shim, err)) {
    *err = "cdi: " + *err + (c.cdi.shim.empty() ? " (set cdi.shim to the shim's path on the host)" : "");
    return false;
  }
  // Every tenant's container preloads the shim and runtimes trust every spec in spec_dir: neither
  // may be replaceable by another user.
  // The spec and the plugin's answers carry the resolved path: a link another user may repoint
  // later is never handed to a runtime.
  std::string resolved;
  if (!checkTrustedFile(h.shim, "cdi.shim", &resolved, err) ||
      (c.cdi.enabled &&
       !checkParentsOf(c.cdi.specDir + "/" + container::kCdiSpecFile, "cdi.spec_dir", /*strict=*/true, err))) {
    *err = "cdi: " + *err;
    return false;
  }
  h.shim = resolved;
  if (!checkCuptiLibrary(c, &h.cuptiLibrary, err)) return false;
  h.ledgerDir = c.ledgerDir;
  h.mpsPipeDir = mpsPipeDir;
  *out = std::move(h);
  return true;
}

namespace {

bool build(const Config& c, const std::vector<DeviceInfo>& devices, const std::string& mpsPipeDir, bool mustExist,
           const std::set<std::string>& staleMig, container::CdiSpec* spec, bool* minorsFromFile, std::string* err) {
  container::HostPlaces h;
  if (!hostPlaces(c, mpsPipeDir, mustExist, &h, err)) return false;
  Placement placed;
  if (!placementOf(c, devices, &placed, err)) {
    *err = "cdi: " + *err;
    return false;
  }
  bool anyMig = false;
  for (const DeviceInfo& d : devices) anyMig = anyMig || d.mig();
  *minorsFromFile = false;
  const std::map<std::string, MigNodes> nodes =
      anyMig ? migNodesOf(devices, container::kMigMinorsFile, minorsFromFile) : std::map<std::string, MigNodes>{};
  std::vector<container::CdiTenant> tenants;
  for (const Tenant& t : c.tenants) {
    container::CdiTenant ct{t.name, {}};
    const auto& on = placed[t.name];
    for (const DeviceInfo& d : devices) {
      if (!d.mig() || (on && std::find(on->begin(), on->end(), d.uuid) == on->end())) continue;
      const MigNodes& n = nodes.at(d.uuid);
      if (staleMig.count(d.uuid))
        ct.mig.push_back({d.name(), d.uuid, {}, "MIG device " + d.name() + " changed since the broker listed it"});
      else
        ct.mig.push_back({d.name(), d.uuid, n.nodes, n.why});
    }
    tenants.push_back(std::move(ct));
  }
  if (!container::buildCdiSpec(tenants, h, spec, err)) {
    *err = "cdi: " + *err;
    return false;
  }
  return true;
}

}  // namespace

std::map<std::string, MigNodes> migNodesOf(const std::vector<DeviceInfo>& devices, const std::string& minorsFile,
                                           bool* fromFile) {
  std::map<std::string, MigNodes> out;
  container::MigMinors table;
  std::string tableErr;
  const bool tableOk = container::loadMigMinors(minorsFile, &table, &tableErr);
  *fromFile = tableOk && table.fromFile;
  for (const DeviceInfo& d : devices) {
    if (!d.mig()) continue;
    MigNodes& n = out[d.uuid];
    if (!tableOk) n.why = tableErr;
    else if (d.gpuMinor < 0) n.why = "NVML did not give GPU " + std::to_string(d.ordinal) + "'s minor number";
    else if (!container::migDeviceNodes(table, static_cast<unsigned>(d.gpuMinor), d.gpuInstance, d.computeInstance,
                                        &n.nodes, &n.why))
      n.nodes.clear();
  }
  return out;
}

bool publishCdiSpec(const Config& c, const std::vector<DeviceInfo>& devices, const std::string& mpsPipeDir,
                    const std::set<std::string>& staleMig, std::string* err) {
  if (!c.cdi.enabled) return true;
  container::CdiSpec spec;
  bool fromFile = false;
  if (!build(c, devices, mpsPipeDir, true, staleMig, &spec, &fromFile, err)) return false;
  for (const std::string& why : spec.leftOut) CUSHARE_BLOG(warn, "cdi: tenant {} left out of the spec", why);
  if (!spec.migDevices.empty() && !fromFile)
    CUSHARE_BLOG(info, "cdi: {} is not there: MIG capability nodes numbered as the driver's fixed table",
                 container::kMigMinorsFile);
  const std::string path = c.cdi.specDir + "/" + container::kCdiSpecFile;
  if (spec.json.empty()) {
    if (!container::removeCdiSpec(c.cdi.specDir, err)) return false;
    CUSHARE_BLOG(info, "cdi: no configured tenant can be a CDI device; {} removed", path);
    return true;
  }
  if (!container::writeCdiSpec(c.cdi.specDir, spec.json, err)) {
    *err = "cdi: " + *err;
    return false;
  }
  CUSHARE_BLOG(info, "cdi: wrote {} (cdiVersion {}, {} tenant device(s){}{})", path, spec.version, spec.devices.size(),
               spec.migDevices.empty() ? "" : ", " + std::to_string(spec.migDevices.size()) + " in MIG devices",
               mpsPipeDir.empty() ? "" : ", MPS pipe directory " + mpsPipeDir);
  return true;
}

bool containerEdits(const Config& c, const std::string& mpsPipeDir, std::vector<TenantEditsOf>* out,
                    std::vector<std::string>* leftOut, std::string* err) {
  container::HostPlaces h;
  if (!hostPlaces(c, mpsPipeDir, true, &h, err)) return false;
  std::vector<TenantEditsOf> all;
  for (const Tenant& t : c.tenants) {
    TenantEditsOf e;
    e.tenant = t.name;
    std::string why;
    if (!container::tenantEdits(t.name, h, container::View::kContainer, &e.edits, &why)) {
      leftOut->push_back(t.name + ": " + why);
      continue;
    }
    if (c.cdi.enabled && container::validCdiDeviceName(t.name, &why)) e.cdiDevice = container::cdiDeviceName(t.name);
    all.push_back(std::move(e));
  }
  *out = std::move(all);
  return true;
}

bool placementOf(const Config& c, const std::vector<DeviceInfo>& devices, Placement* out, std::string* err) {
  Placement p;
  for (const Tenant& t : c.tenants) {
    std::optional<std::vector<std::string>>& on = p[t.name];
    if (t.memory.kind != MemorySpec::kPerDevice) continue;  // everywhere
    std::vector<uint64_t> limits;
    if (!resolveMemory(c, t.memory, devices, &limits, err)) return false;
    on.emplace();
    for (size_t d = 0; d < devices.size(); ++d)
      if (limits[d] != kUnlimited) on->push_back(devices[d].uuid);
  }
  *out = std::move(p);
  return true;
}

void unpublishCdiSpec(const Config& c) {
  if (!c.cdi.enabled || !c.cdi.removeOnStop) return;
  std::string err;
  if (container::removeCdiSpec(c.cdi.specDir, &err))
    CUSHARE_BLOG(info, "cdi: removed {}/{} (remove_on_stop)", c.cdi.specDir, container::kCdiSpecFile);
  else
    CUSHARE_BLOG(error, "cdi: {}", err);
}

bool describeCdi(const Config& c, const std::vector<DeviceInfo>& devices, std::string* line, std::string* err) {
  if (!c.cdi.enabled) {
    *line = "cdi: off";
    return true;
  }
  container::CdiSpec spec;
  bool fromFile = false;
  if (!build(c, devices, c.mps.mode == MpsConfig::Mode::kOff ? "" : c.mps.pipeDir, false, {}, &spec, &fromFile, err))
    return false;
  // The start makes the spec directory and writes the spec there when there is one to write: a
  // place this user cannot write fails it (cdi asked for) or leaves it without a spec (the default).
  // (With no tenant it removes a spec left from before, which needs the directory writable too.)
  struct stat old{};
  const bool stale = ::stat((c.cdi.specDir + "/" + container::kCdiSpecFile).c_str(), &old) == 0;
  if ((!spec.devices.empty() || stale) && !checkDirWritable(c.cdi.specDir, "cdi.spec_dir", err)) return false;
  container::HostPlaces h;
  std::string ignored;
  hostPlaces(c, "", false, &h, &ignored);
  struct stat st{};
  *line = "cdi: " + c.cdi.specDir + "/" + container::kCdiSpecFile + " with " + std::to_string(spec.devices.size()) +
          " tenant device(s)" +
          (spec.migDevices.empty() ? "" : " and " + std::to_string(spec.migDevices.size()) + " in MIG devices") +
          ", cdiVersion " + spec.version + ", shim " + h.shim +
          (::stat(h.shim.c_str(), &st) == 0 ? "" : " (not found on this host: it must exist where the broker runs)");
  for (const std::string& why : spec.leftOut) *line += "; left out: " + why;
  return true;
}

}  // namespace cushare::broker
