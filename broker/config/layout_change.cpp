// Comparisons of device lists across a MIG layout change; see layout_change.h.
#include "config/layout_change.h"

#include <map>

namespace cushare::broker {

std::vector<std::string> describeDevices(const std::vector<DeviceInfo>& list) {
  std::vector<std::string> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const DeviceInfo& d = list[i];
    out.push_back(d.uuid + " " + d.name() + " " + std::to_string(d.totalBytes) + " " + std::to_string(d.group(i)) +
                  (d.mig() ? " " + d.profile + " gi" + std::to_string(d.gpuInstance) + " ci" +
                                 std::to_string(d.computeInstance) + " minor" + std::to_string(d.gpuMinor)
                           : std::string()));
  }
  return out;
}

std::set<std::string> gpusOf(const std::vector<DeviceInfo>& list, const std::vector<std::string>& idle) {
  std::set<std::string> out;
  for (const DeviceInfo& d : list) out.insert(d.mig() ? d.parentUuid : d.uuid);
  for (const std::string& i : idle)
    if (const size_t a = i.find('('), b = i.rfind(')'); a != std::string::npos && b != std::string::npos && b > a)
      out.insert(i.substr(a + 1, b - a - 1));
  return out;
}

std::set<std::string> changedMigDevices(const std::vector<DeviceInfo>& start, const std::vector<DeviceInfo>& now) {
  std::set<std::string> out;
  for (const DeviceInfo& s : start) {
    if (!s.mig()) continue;
    bool same = false;
    for (const DeviceInfo& n : now)
      same = same || (n.uuid == s.uuid && n.name() == s.name() && n.gpuInstance == s.gpuInstance &&
                      n.computeInstance == s.computeInstance && n.gpuMinor == s.gpuMinor);
    if (!same) out.insert(s.uuid);
  }
  return out;
}

bool sameLimitsAcross(const Config& now, const std::vector<DeviceInfo>& before, const Config& next,
                      const std::vector<DeviceInfo>& after, std::string* why) {
  // Per tenant (and the unknown tenants' profile): device UUID -> (limit, guarantee).
  using Given = std::map<std::string, std::map<std::string, std::pair<uint64_t, uint64_t>>>;
  const auto given = [&](const Config& c, const std::vector<DeviceInfo>& list, Given* out) {
    std::vector<Tenant> all = c.tenants;
    for (const Profile& p : c.profiles)
      if (p.name == c.unknownTenantsProfile) {
        Tenant t;
        t.name = "the unknown tenants' profile";
        t.memory = p.memory;
        all.push_back(t);
      }
    for (const Tenant& t : all) {
      std::vector<uint64_t> limits, guarantees;
      if (!resolveMemory(c, t.memory, list, &limits, why) || !resolveGuarantee(c, t, list, &guarantees, why))
        return false;
      for (size_t d = 0; d < list.size(); ++d) (*out)[t.name][list[d].uuid] = {limits[d], guarantees[d]};
    }
    return true;
  };
  Given b, a;
  if (!given(now, before, &b) || !given(next, after, &a)) return false;
  const std::pair<uint64_t, uint64_t> none{kUnlimited, kUnlimited};
  std::map<std::string, std::string> nameBefore;  // UUID -> its <gpu>[:<mig>] before the change
  for (const DeviceInfo& o : before) nameBefore[o.uuid] = o.name();
  std::set<std::string> names;
  for (const auto& [n, _] : b) names.insert(n);
  for (const auto& [n, _] : a) names.insert(n);
  for (const std::string& name : names)
    for (const DeviceInfo& d : after) {
      const auto beforeName = nameBefore.find(d.uuid);
      if (beforeName == nameBefore.end()) continue;  // a device new after the change
      const auto bt = b.find(name), at = a.find(name);
      const auto was = bt == b.end() ? none : bt->second.at(d.uuid);
      const auto is = at == a.end() ? none : at->second.at(d.uuid);
      if (was == is) continue;
      *why = name + "'s memory on " + d.uuid + " (" + beforeName->second + ", now " + d.name() +
             ") would change with the layout: a key by index names another device after it, or the configuration "
             "file changed it without a reload (name MIG devices by UUID, reload, or restart the broker to take the "
             "new meaning)";
      return false;
    }
  return true;
}

}  // namespace cushare::broker
