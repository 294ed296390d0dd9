// `cushare top`: the frame built from two samples of the tenants an interval apart (top.h).
#include "top.h"

#include <algorithm>
#include <map>
#include <utility>

namespace cushare::cli {
namespace {

// A counter's growth per second; a counter that went back (the broker restarted between the two
// samples) counts from zero.
double rate(uint64_t before, uint64_t after, double seconds) {
  if (seconds <= 0) return 0;
  const uint64_t grew = after >= before ? after - before : after;
  return static_cast<double>(grew) / seconds;
}

}  // namespace

rpc::TopFrame topFrame(const rpc::TenantsReply& before, const rpc::TenantsReply& after, double seconds, double now) {
  rpc::TopFrame f;
  f.set_time(now);
  f.set_interval_seconds(seconds);
  std::map<std::pair<std::string, int>, const rpc::TenantDevice*> was;
  for (const rpc::Tenant& t : before.tenants())
    for (const rpc::TenantDevice& d : t.devices()) was[{t.name(), d.device()}] = &d;
  std::map<int, rpc::TopDevice*> devices;
  for (const rpc::Device& d : after.devices()) {
    rpc::TopDevice* td = f.add_devices();
    td->set_index(d.index());
    td->set_name(d.name());
    td->set_uuid(d.uuid());
    td->set_capacity_bytes(d.capacity_bytes());
    td->set_used_bytes(d.used_bytes());
    if (d.has_device_used_bytes()) td->set_device_used_bytes(d.device_used_bytes());
    td->set_outside_bytes(d.outside_bytes());
    devices[d.index()] = td;
  }
  for (const rpc::Tenant& t : after.tenants()) {
    if (!t.error().empty()) f.add_errors("tenant " + t.name() + ": " + t.error());
    for (const rpc::TenantDevice& d : t.devices()) {
      const auto dev = devices.find(d.device());
      if (dev == devices.end()) continue;
      const auto prev = was.find({t.name(), d.device()});
      const rpc::TenantDevice* p = prev == was.end() ? nullptr : prev->second;
      rpc::TopTenant* tt = dev->second->add_tenants();
      tt->set_tenant(t.name());
      tt->set_priority(t.priority());
      tt->set_processes(t.processes());
      tt->set_used_bytes(d.used_bytes());
      if (d.has_limit_bytes()) tt->set_limit_bytes(d.limit_bytes());
      // A tenant new since the first sample has no rate yet.
      tt->set_busy(p ? std::min(1.0, rate(p->busy_ns(), d.busy_ns(), seconds) / 1e9) : 0);
      tt->set_throttled(p ? std::min(1.0, rate(p->throttled_ns(), d.throttled_ns(), seconds) / 1e9) : 0);
      tt->set_denied_per_second(p ? rate(p->denied(), d.denied(), seconds) : 0);
      tt->set_paced(d.paced());
      if (t.has_thread_percentage()) tt->set_thread_percentage(t.thread_percentage());
      if (d.has_probe()) *tt->mutable_probe() = d.probe();
      dev->second->set_busy(dev->second->busy() + tt->busy());
    }
  }
  // Busiest first, then by name: the tenants worth looking at are on top.
  for (rpc::TopDevice& d : *f.mutable_devices())
    std::stable_sort(d.mutable_tenants()->begin(), d.mutable_tenants()->end(),
                     [](const rpc::TopTenant& a, const rpc::TopTenant& b) {
                       if (a.busy() != b.busy()) return a.busy() > b.busy();
                       return a.tenant() < b.tenant();
                     });
  return f;
}

}  // namespace cushare::cli
