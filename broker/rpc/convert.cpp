// Snapshot to reply mapping; see convert.h.
#include "rpc/convert.h"

namespace cushare::rpc {
namespace {

using broker::BrokerSnapshot;
using broker::TenantSnapshot;

// The broker's device number of the device at position i of snap.devices: its position (the
// GPU's NVML index on a host without MIG devices, control.proto). The snapshot is built to keep
// every per-device vector aligned with snap.devices.
int deviceIndex(const BrokerSnapshot&, size_t i) { return static_cast<int>(i); }

// "0", or "0:1" for a MIG device.
std::string deviceName(const BrokerSnapshot& snap, size_t i) {
  if (i >= snap.devices.size()) return std::to_string(i);
  const broker::DeviceSnapshot& d = snap.devices[i];
  return d.name.empty() ? std::to_string(d.index) : d.name;
}

void toProto(const broker::TenantDeviceSnapshot& d, const BrokerSnapshot& snap, TenantDevice* out) {
  out->set_device(deviceIndex(snap, static_cast<size_t>(d.device)));
  out->set_device_name(deviceName(snap, static_cast<size_t>(d.device)));
  out->set_uuid(d.uuid);
  out->set_used_bytes(d.used);
  if (d.limit != broker::kNoLimit) out->set_limit_bytes(d.limit);
  if (d.guarantee != broker::kNoLimit) out->set_guarantee_bytes(d.guarantee);
  out->set_burst_bytes(d.burst);
  out->set_burst_host_bytes(d.burstHost);
  out->set_reclaimed_bytes(d.reclaimed);
  out->set_plain(d.plain);
  out->set_reclaim_seconds(d.reclaimSeconds);
  out->set_peak_bytes(d.peak);
  out->set_denied(d.denied);
  out->set_overridden(d.overridden);
  out->set_busy_ns(d.busyNs);
  out->set_metered_busy_ns(d.meteredBusyNs);
  out->set_device_busy_ns(d.deviceBusyNs);
  out->set_share_ns(d.shareNs);
  out->set_throttled_ns(d.throttledNs);
  out->set_paced(d.paced);
  out->set_contending(d.contending);
  out->set_fair_target(d.fairTarget);
  out->set_fair_achieved(d.fairAchieved);
  if (d.probe.known) {
    ProbeShare* p = out->mutable_probe();
    p->set_complete(d.probe.complete);
    p->set_enough(d.probe.enough);
    p->set_compute_share(d.probe.share);
    p->set_compute_share_stderr(d.probe.shareError);
    p->set_rounds(d.probe.rounds);
    p->set_rounds_with_work(d.probe.roundsWithWork);
    p->set_missing(d.probe.missing);
    p->set_bad(d.probe.bad);
    p->set_regime(d.probe.regime);
    p->set_started_fraction(d.probe.startedFraction);
    if (d.probe.spatial) p->set_spatial(*d.probe.spatial);
    if (d.probe.temporal) p->set_temporal(*d.probe.temporal);
    if (d.probe.intra) p->set_intra(*d.probe.intra);
    if (d.probe.bandwidthShare) p->set_bandwidth_share(*d.probe.bandwidthShare);
    if (d.probe.computeIndex) p->set_compute_index(*d.probe.computeIndex);
    if (d.probe.bandwidthIndex) p->set_bandwidth_index(*d.probe.bandwidthIndex);
    if (d.probe.latencyIndexNs) p->set_latency_index_ns(*d.probe.latencyIndexNs);
    if (d.probe.latencyP95Ns) p->set_latency_p95_ns(*d.probe.latencyP95Ns);
    p->set_window_seconds(d.probe.windowSeconds);
    p->set_last_error(d.probe.lastError);
    p->set_caveat(d.probe.caveat);
  }
}

void toProto(const TenantSnapshot& t, const broker::ProcessSnapshot& p, const BrokerSnapshot& snap,
             const std::function<int(int)>& innermostPid, Process* out) {
  out->set_tenant(t.name);
  out->set_pid(p.pid);
  out->set_host_pid(p.hostPid);
  out->set_pid_verified(p.hostPid > 0 && p.pid > 0 && innermostPid(p.hostPid) == p.pid);
  if (p.pod) {
    out->mutable_pod()->set_namespace_(p.pod->ns);
    out->mutable_pod()->set_pod(p.pod->pod);
    out->mutable_pod()->set_container(p.pod->container);
  }
  for (size_t i = 0; i < p.used.size(); ++i) {
    if (p.used[i] == 0) continue;  // a process touches few of the devices; zeros are noise
    ProcessUsage* u = out->add_usage();
    u->set_device(deviceIndex(snap, i));
    u->set_device_name(deviceName(snap, i));
    u->set_used_bytes(p.used[i]);
  }
}

bool selected(const TenantSnapshot& t, const std::string& tenantOrEmpty) {
  return tenantOrEmpty.empty() || t.name == tenantOrEmpty;
}

}  // namespace

namespace {

void toProto(const broker::DeviceSnapshot& d, int number, Device* dev) {
  dev->set_index(number);
  dev->set_name(d.name.empty() ? std::to_string(d.index) : d.name);
  if (d.migIndex >= 0) {
    dev->set_mig(true);
    dev->set_gpu_uuid(d.parentUuid);
    dev->set_mig_profile(d.migProfile);
    dev->set_gpu_instance_id(d.gpuInstance);
    dev->set_compute_instance_id(d.computeInstance);
  }
  dev->set_uuid(d.uuid);
  dev->set_capacity_bytes(d.capacity);
  dev->set_used_bytes(d.used);
  if (d.read) dev->set_device_used_bytes(d.deviceUsed);
  dev->set_outside_bytes(d.outside);
  for (int pid : d.outsidePids) dev->add_outside_pids(pid);
  dev->set_thrash_guard(d.thrashGuard);
  dev->set_thrash_turns(d.thrashTurns);
}

}  // namespace

void toProto(const BrokerSnapshot& snap, StatusReply* out) {
  out->set_version(snap.version);
  out->set_pid(snap.pid);
  out->set_config_file(snap.configFile);
  out->set_config_generation(snap.configGeneration);
  out->set_uptime_seconds(snap.uptimeSeconds);
  out->set_ledger_dir(snap.ledgerDir);
  out->set_unknown_tenants(snap.unknownTenants);
  out->set_metrics_address(snap.metricsAddress);
  for (size_t i = 0; i < snap.devices.size(); ++i)
    toProto(snap.devices[i], static_cast<int>(i), out->add_devices());
  size_t processes = 0;
  for (const TenantSnapshot& t : snap.tenants) processes += t.processes.size();
  out->set_tenants(static_cast<uint32_t>(snap.tenants.size()));
  out->set_processes(static_cast<uint32_t>(processes));
  out->set_reaped_processes(snap.reapedProcesses);
  out->set_reloads_refused(snap.reloadsRefused);
  const broker::MpsSnapshot& m = snap.mps;
  Mps* mps = out->mutable_mps();
  mps->set_mode(m.mode);
  mps->set_active(m.active);
  mps->set_why(m.why);
  mps->set_control(m.control);
  mps->set_pipe_dir(m.pipeDir);
  mps->set_log_dir(m.logDir);
  mps->set_up(m.up);
  mps->set_daemon_pid(m.daemonPid);
  mps->set_restarts(m.restarts);
  mps->set_faults(m.faults);
  mps->set_check_failures(m.checkFailures);
  mps->set_last_error(m.lastError);
  mps->set_default_thread_percentage(m.defaultThreads);
  for (const broker::MpsServerSnapshot& s : m.servers) {
    MpsServer* srv = mps->add_servers();
    srv->set_pid(s.pid);
    srv->set_state(s.state);
    for (int c : s.clients) srv->add_clients(c);
  }
}

void toProto(const TenantSnapshot& t, const BrokerSnapshot& snap, Tenant* out) {
  out->set_name(t.name);
  out->set_profile(t.profile);
  out->set_source(t.source);
  if (t.threadPercentage) out->set_thread_percentage(*t.threadPercentage);
  out->set_priority(priorityName(t.priority));
  out->set_weight(t.weight);
  out->set_threads_overridden(t.threadsOverridden);
  out->set_priority_overridden(t.priorityOverridden);
  out->set_ledger(t.ledgerPath);
  out->set_error(t.error);
  out->set_processes(static_cast<uint32_t>(t.processes.size()));
  for (const broker::TenantDeviceSnapshot& d : t.devices) toProto(d, snap, out->add_devices());
  out->set_mps(snap.mps.active);
  if (auto it = snap.mps.published.find(t.name); snap.mps.active && it != snap.mps.published.end() && it->second)
    out->set_mps_thread_percentage(*it->second);
  if (auto it = snap.mps.running.find(t.name); snap.mps.active && it != snap.mps.running.end())
    for (const auto& [cap, n] : it->second) {
      MpsRunning* r = out->add_mps_running();
      r->set_thread_percentage(cap);
      r->set_processes(n);
    }
}

bool tenantsToProto(const BrokerSnapshot& snap, const std::string& tenantOrEmpty,
                    TenantsReply* out) {
  bool found = false;
  for (const TenantSnapshot& t : snap.tenants) {
    if (!selected(t, tenantOrEmpty)) continue;
    toProto(t, snap, out->add_tenants());
    found = true;
  }
  for (size_t i = 0; i < snap.devices.size(); ++i)
    toProto(snap.devices[i], static_cast<int>(i), out->add_devices());
  return found || tenantOrEmpty.empty();
}

bool processesToProto(const BrokerSnapshot& snap, const std::string& tenantOrEmpty,
                      const std::function<int(int)>& innermostPid, ProcessesReply* out) {
  bool found = false;
  for (const TenantSnapshot& t : snap.tenants) {
    if (!selected(t, tenantOrEmpty)) continue;
    found = true;
    for (const broker::ProcessSnapshot& p : t.processes)
      toProto(t, p, snap, innermostPid, out->add_processes());
  }
  return found || tenantOrEmpty.empty();
}

}  // namespace cushare::rpc
