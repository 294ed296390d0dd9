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

bool sameLimitsAcross(const Config& c, const std::vector<DeviceInfo>& before, const std::vector<DeviceInfo>& after,
                      std::string* why) {
  // Per tenant (and the unknown tenants' profile): device UUID -> (limit, guarantee) on each list.
  using Given = std::map<std::string, std::pair<uint64_t, uint64_t>>;
  const auto given = [&](const Tenant& t, const std::vector<DeviceInfo>& list, Given* out) {
    std::vector<uint64_t> limits, guarantees;
    if (!resolveMemory(c, t.memory, list, &limits, why) || !resolveGuarantee(c, t, list, &guarantees, why))
      return false;
    for (size_t d = 0; d < list.size(); ++d) (*out)[list[d].uuid] = {limits[d], guarantees[d]};
    return true;
  };
  std::vector<Tenant> all = c.tenants;
  for (const Profile& p : c.profiles)
    if (p.name == c.unknownTenantsProfile) {
      Tenant t;
      t.name = "the unknown tenants' profile " + p.name;
      t.memory = p.memory;
      all.push_back(t);
    }
  for (const Tenant& t : all) {
    Given b, a;
    if (!given(t, before, &b) || !given(t, after, &a)) return false;
    for (const DeviceInfo& d : after) {
      const auto was = b.find(d.uuid);
      if (was == b.end() || was->second == a.at(d.uuid)) continue;
      std::string before_name;
      for (const DeviceInfo& o : before)
        if (o.uuid == d.uuid) before_name = o.name();
      *why = t.name + "'s memory on " + d.uuid + " (" + before_name + ", now " + d.name() +
             ") would change with the layout: a key by index names another device after it (name MIG devices by "
             "UUID, or restart the broker to take the new meaning)";
      return false;
    }
  }
  return true;
}

}  // namespace cushare::broker
