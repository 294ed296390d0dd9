// Rendering of a BrokerSnapshot as Prometheus text (see prometheus.h for the invariants).
//
// Families are written in a fixed order: the broker, then devices, then tenant x device, then
// tenants. Within a family, samples follow the snapshot's order (devices by index, tenants as
// configured, then the others by name), so scrapes of an unchanged broker are byte-identical.
#include "metrics/prometheus.h"

#include <charconv>
#include <cmath>
#include <initializer_list>
#include <map>
#include <optional>

namespace cushare::broker {
namespace {

constexpr std::string_view kGauge = "gauge";
constexpr std::string_view kCounter = "counter";

struct Label {
  std::string_view name;
  std::string_view value;
};

std::string formatUint(uint64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// The shortest text that reads back as exactly v (std::to_chars), or the format's own spellings
// of the values C++ would write as "inf" and "nan".
std::string formatFloat(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// Appends families to a text: family() writes a family's HELP and TYPE lines, and the sample()
// calls that follow add its samples. HELP texts are constants of this file, free of backslashes
// and newlines, so they need no escaping.
class Writer {
 public:
  void family(std::string_view name, std::string_view type, std::string_view help) {
    name_ = name;
    out_.append("# HELP ").append(name).append(" ").append(help).append("\n");
    out_.append("# TYPE ").append(name).append(" ").append(type).append("\n");
  }
  void sample(std::initializer_list<Label> labels, uint64_t value) {
    line(labels, formatUint(value));
  }
  void sampleFloat(std::initializer_list<Label> labels, double value) {
    line(labels, formatFloat(value));
  }
  std::string take() { return std::move(out_); }

 private:
  void line(std::initializer_list<Label> labels, const std::string& value) {
    out_.append(name_);
    if (labels.size() > 0) {
      char sep = '{';
      for (const Label& l : labels) {
        out_.append(1, sep).append(l.name).append("=\"").append(escapeLabelValue(l.value));
        out_.append("\"");
        sep = ',';
      }
      out_.append("}");
    }
    out_.append(" ").append(value).append("\n");
  }

  std::string out_;
  std::string_view name_;
};

// The device label of a tenant's entry: the device's name ("0", "0:1" for a MIG device), as on
// the cushare_device_* families. TenantDeviceSnapshot::device indexes BrokerSnapshot::devices; an index out of range
// (a bug in the snapshot's producer) is printed as it is rather than taking the endpoint down.
// "0" for GPU 0, "0:1" for its MIG device 1.
std::string deviceLabel(const DeviceSnapshot& d) { return d.name.empty() ? std::to_string(d.index) : d.name; }

std::string deviceLabel(const BrokerSnapshot& s, int i) {
  const bool known = i >= 0 && static_cast<size_t>(i) < s.devices.size();
  return known ? deviceLabel(s.devices[static_cast<size_t>(i)]) : std::to_string(i);
}

void renderBroker(const BrokerSnapshot& s, Writer& w) {
  w.family("cushare_broker_up", kGauge,
           "1 while the broker runs (a failed scrape means it is down).");
  w.sample({}, 1);
  w.family("cushare_broker_info", kGauge,
           "Always 1; the version label carries the broker's version.");
  w.sample({{"version", s.version}}, 1);
  w.family("cushare_broker_config_generation", kGauge,
           "Generation of the running configuration: 1 at start, +1 per accepted reload.");
  w.sample({}, s.configGeneration);
  w.family("cushare_broker_start_time_seconds", kGauge,
           "Start time of the broker, seconds since the Unix epoch.");
  w.sampleFloat({}, s.startedAt);
  w.family("cushare_broker_reaped_processes_total", kCounter,
           "Dead tenant processes whose device memory the broker returned to their tenant.");
  w.sample({}, s.reapedProcesses);
  w.family("cushare_broker_reloads_refused_total", kCounter,
           "Configuration reloads refused; the running configuration was kept.");
  w.sample({}, s.reloadsRefused);
  w.family("cushare_broker_ledgers_refused_total", kCounter,
           "Ledger files the broker refused to adopt: unknown tenants beyond max_unknown_tenants or "
           "max_unknown_tenants_per_uid, renamed ledgers it has no record of.");
  w.sample({}, s.ledgersRefused);
  w.family("cushare_broker_log_lines_dropped_total", kCounter,
           "Log lines that other users can cause at will (refused ledger files, GPU processes that are no "
           "tenant's, malformed control requests) held back beyond their budget of 20 at once and one "
           "every 6 s per kind.");
  w.sample({}, s.logLinesDropped);
  w.family("cushare_mig_layout_matches", kGauge,
           "With a mig: layout in the configuration: 1 when every GPU it names had it at the broker's start (after "
           "mig.apply_at_start), 0 when some did not (the log says how); no sample without one.");
  if (s.migLayout.checked) w.sample({}, s.migLayout.matches ? 1 : 0);
  w.family("cushare_mig_layout_changes", kGauge,
           "Changes the broker made at start to bring the GPUs to the mig: layout (instances destroyed and "
           "created, mode changes); no sample without a layout.");
  if (s.migLayout.checked) w.sample({}, s.migLayout.changes);
}

// The broker's MPS control daemon (docs/mps.md): samples only while the broker runs MPS.
void renderMps(const MpsSnapshot& m, Writer& w) {
  const bool on = m.active;
  w.family("cushare_mps_up", kGauge, "1 when the last health check of the MPS control daemon got an answer.");
  if (on) w.sample({}, m.up ? 1 : 0);
  w.family("cushare_mps_restarts_total", kCounter,
           "Times the broker restarted the MPS control daemon after it exited or hung.");
  if (on) w.sample({}, m.restarts);
  w.family("cushare_mps_health_check_failures_total", kCounter,
           "Health checks of the MPS control daemon that got no answer.");
  if (on) w.sample({}, m.checkFailures);
  w.family("cushare_mps_server_faults_total", kCounter, "MPS servers seen entering the FAULT state.");
  if (on) w.sample({}, m.faults);
  w.family("cushare_mps_server_fault", kGauge,
           "1 for an MPS server in FAULT (its clients get errors; new clients are refused until they exit).");
  for (const MpsServerSnapshot& srv : m.servers)
    w.sample({{"server", std::to_string(srv.pid)}}, srv.state == "FAULT" ? 1 : 0);
  w.family("cushare_mps_server_clients", kGauge, "Clients of each MPS server.");
  for (const MpsServerSnapshot& srv : m.servers) w.sample({{"server", std::to_string(srv.pid)}}, srv.clients.size());
  w.family("cushare_mps_tenant_thread_percentage", kGauge,
           "The active thread percentage a tenant's new processes get as MPS clients (100: no cap).");
  for (const auto& [tenant, pct] : m.published)
    if (!tenant.empty()) w.sample({{"tenant", tenant}}, static_cast<uint64_t>(pct.value_or(100)));
}

void renderDevices(const BrokerSnapshot& s, Writer& w) {
  struct Family {
    std::string_view name, help;
    std::optional<uint64_t> (*value)(const DeviceSnapshot&);  // nullopt: no sample
  };
  static constexpr Family kFamilies[] = {
      {"cushare_device_memory_capacity_bytes", "Device memory of the GPU, bytes.",
       [](const DeviceSnapshot& d) -> std::optional<uint64_t> { return d.capacity; }},
      {"cushare_device_memory_used_bytes",
       "Device memory in use by the tenants the broker manages (sum over tenants), bytes.",
       [](const DeviceSnapshot& d) -> std::optional<uint64_t> { return d.used; }},
      {"cushare_device_memory_reported_used_bytes",
       "Device memory in use as the device itself reports it (every process, cushare's or not), bytes; "
       "absent while the device's accounting cannot be read.",
       [](const DeviceSnapshot& d) -> std::optional<uint64_t> {
         return d.read ? std::optional<uint64_t>(d.deviceUsed) : std::nullopt;
       }},
      {"cushare_device_memory_outside_bytes",
       "Device memory held by processes outside cushare (mapping no tenant's ledger): no tenant's limit "
       "counts it, bytes; absent while the device's accounting cannot be read.",
       [](const DeviceSnapshot& d) -> std::optional<uint64_t> {
         return d.read ? std::optional<uint64_t>(d.outside) : std::nullopt;
       }},
  };
  for (const Family& f : kFamilies) {
    w.family(f.name, kGauge, f.help);
    for (const DeviceSnapshot& d : s.devices)
      if (const std::optional<uint64_t> v = f.value(d))
        w.sample({{"device", deviceLabel(d)}, {"uuid", d.uuid}}, *v);
  }
  // The device's utilisation, for a dashboard and for the tenants' share of it: rate() of this.
  w.family("cushare_device_busy_seconds_total", kCounter,
           "Time any process's kernels ran on the device, as NVML's per-process utilization counts it (every "
           "process, cushare's or not; MPS clients running side by side each count), seconds.");
  for (const DeviceSnapshot& d : s.devices)
    w.sampleFloat({{"device", deviceLabel(d)}, {"uuid", d.uuid}}, static_cast<double>(d.busyNs) / 1e9);
  // The thrashing guard (docs/memory-elasticity.md, "Thrashing").
  w.family("cushare_device_thrash_guard", kGauge,
           "1 while the tenants bursting into managed memory on the device take turns on it (their bursts do not "
           "fit in the memory the device has for them together), else 0.");
  for (const DeviceSnapshot& d : s.devices) w.sample({{"device", deviceLabel(d)}, {"uuid", d.uuid}}, d.thrashGuard ? 1 : 0);
  w.family("cushare_device_thrash_turns_total", kCounter,
           "Turns the thrashing guard gave the tenants bursting into managed memory on the device (each turn "
           "brings its holder's working set back to the device).");
  for (const DeviceSnapshot& d : s.devices) w.sample({{"device", deviceLabel(d)}, {"uuid", d.uuid}}, d.thrashTurns);
  // What each device is, to join on (device, uuid): a GPU, or a MIG device with its GPU, profile
  // and instance IDs, so that usage can be billed per MIG instance.
  w.family("cushare_device_info", kGauge,
           "1 per device the broker shares: kind \"gpu\" or \"mig\"; the GPU's UUID (gpu_uuid: a MIG device's "
           "GPU, a GPU's own), a MIG device's profile (e.g. 3g.40gb), GPU instance and compute instance IDs (empty "
           "for a GPU).");
  for (const DeviceSnapshot& d : s.devices) {
    const bool mig = d.migIndex >= 0;
    w.sample({{"device", deviceLabel(d)},
              {"uuid", d.uuid},
              {"kind", mig ? "mig" : "gpu"},
              {"gpu_uuid", mig ? d.parentUuid : d.uuid},
              {"mig_profile", mig ? d.migProfile : ""},
              {"gpu_instance_id", mig ? std::to_string(d.gpuInstance) : ""},
              {"compute_instance_id", mig ? std::to_string(d.computeInstance) : ""}},
             1);
  }
}

void renderTenantDevices(const BrokerSnapshot& s, Writer& w) {
  struct Family {
    std::string_view name, type, help;
    std::optional<uint64_t> (*value)(const TenantDeviceSnapshot&);  // nullopt: no sample
  };
  static constexpr Family kFamilies[] = {
      {"cushare_tenant_memory_used_bytes", kGauge, "Device memory the tenant holds, bytes.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> { return d.used; }},
      {"cushare_tenant_memory_limit_bytes", kGauge,
       "The tenant's memory limit on the device, bytes (no sample: no limit).",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> {
         if (d.limit == kNoLimit) return std::nullopt;
         return d.limit;
       }},
      {"cushare_tenant_memory_guarantee_bytes", kGauge,
       "The tenant's guarantee on the device, bytes: what is reserved for it; above it, up to its limit, it "
       "bursts into managed memory (no sample: it does not burst).",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> {
         if (d.guarantee == kNoLimit) return std::nullopt;
         return d.guarantee;
       }},
      {"cushare_tenant_memory_burst_bytes", kGauge,
       "Device memory the tenant holds above its guarantee (managed memory the device may evict to host "
       "memory), bytes; included in cushare_tenant_memory_used_bytes.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> {
         if (d.guarantee == kNoLimit) return std::nullopt;
         return d.burst;
       }},
      {"cushare_tenant_memory_burst_host_bytes", kGauge,
       "Of cushare_tenant_memory_burst_bytes, what is on host memory now (the device evicted it for allocations "
       "that needed the room, or it found none), bytes; an estimate (no sample: it does not burst).",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> {
         if (d.guarantee == kNoLimit) return std::nullopt;
         return d.burstHost;
       }},
      {"cushare_tenant_reclaimed_bytes_total", kCounter,
       "Bytes of the tenant's bursts found moved to host memory since the broker started (rises of "
       "cushare_tenant_memory_burst_host_bytes); an estimate (no sample: it does not burst).",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> {
         if (d.guarantee == kNoLimit) return std::nullopt;
         return d.reclaimed;
       }},
      {"cushare_tenant_memory_peak_bytes", kGauge,
       "Highest device memory the tenant has held, bytes.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> { return d.peak; }},
      {"cushare_tenant_allocations_denied_total", kCounter,
       "Allocations refused because they would exceed the tenant's limit.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> { return d.denied; }},
      {"cushare_tenant_hidden_bytes", kGauge,
       "Device memory the tenant's processes hold beyond what its ledger shows (NVML per-process "
       "accounting), charged to the tenant by the broker; included in "
       "cushare_tenant_memory_used_bytes.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> { return d.hidden; }},
      {"cushare_tenant_left_behind_bytes", kGauge,
       "Device memory the tenant's exited processes left on the device (shareable memory an "
       "exported descriptor keeps alive), charged to the tenant by the broker; included in "
       "cushare_tenant_memory_used_bytes.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> { return d.leftBehind; }},
      {"cushare_tenant_memory_limit_overridden", kGauge,
       "1 when the limit was set live (cushare set-limit) rather than by the configuration.",
       [](const TenantDeviceSnapshot& d) -> std::optional<uint64_t> {
         return d.overridden ? 1 : 0;
       }},
  };
  for (const Family& f : kFamilies) {
    w.family(f.name, f.type, f.help);
    for (const TenantSnapshot& t : s.tenants) {
      if (!t.error.empty()) continue;  // its ledger cannot be read: no numbers to report
      for (const TenantDeviceSnapshot& d : t.devices)
        if (const std::optional<uint64_t> v = f.value(d))
          w.sample({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, *v);
    }
  }
  w.family("cushare_tenant_reclaim_seconds", kGauge,
           "A plain burster's last reclaim: the time from the broker's request to the tenant holding no more than it "
           "was asked, seconds (up to a tick, 50 ms, late); 0 before the first, or when it never got there (no "
           "sample: it does not burst into plain memory).");
  for (const TenantSnapshot& t : s.tenants) {
    if (!t.error.empty()) continue;
    for (const TenantDeviceSnapshot& d : t.devices)
      if (d.guarantee != kNoLimit && d.plain)
        w.sampleFloat({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, d.reclaimSeconds);
  }
}

// Compute time per tenant and device (docs/compute.md): seconds, counters since the broker started.
void renderTenantCompute(const BrokerSnapshot& s, Writer& w) {
  struct Family {
    std::string_view name, help;
    uint64_t TenantDeviceSnapshot::*ns;
  };
  static constexpr Family kFamilies[] = {
      {"cushare_tenant_gpu_busy_seconds_total",
       "GPU time during which the tenant's work executed on the device, as charged and billed: the "
       "larger of what its processes metered and what the device counted for them, seconds.",
       &TenantDeviceSnapshot::busyNs},
      {"cushare_tenant_gpu_metered_busy_seconds_total",
       "GPU time the tenant's processes metered (timing events on their streams, or CUPTI), seconds.",
       &TenantDeviceSnapshot::meteredBusyNs},
      {"cushare_tenant_gpu_device_busy_seconds_total",
       "GPU time the device counted for the tenant's processes (NVML per-process utilization), seconds.",
       &TenantDeviceSnapshot::deviceBusyNs},
      {"cushare_tenant_gpu_share_seconds_total",
       "The tenant's share of the device's time, for chargeback: busy time times the fraction of the "
       "SMs it could use (its MPS percentage, 1 outside MPS), scaled so that the tenants of a device "
       "never sum to more than the device's time, seconds.",
       &TenantDeviceSnapshot::shareNs},
      {"cushare_tenant_throttled_seconds_total",
       "Time the tenant's launches waited for their turn (compute caps and priorities), seconds.",
       &TenantDeviceSnapshot::throttledNs},
  };
  for (const Family& f : kFamilies) {
    w.family(f.name, kCounter, f.help);
    for (const TenantSnapshot& t : s.tenants) {
      if (!t.error.empty()) continue;
      for (const TenantDeviceSnapshot& d : t.devices)
        w.sampleFloat({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, static_cast<double>(d.*f.ns) / 1e9);
    }
  }
}

// Fair share (docs/compute.md): weights, and the controller's view while a tenant contends.
void renderTenantFairShare(const BrokerSnapshot& s, Writer& w) {
  w.family("cushare_tenant_weight", kGauge, "The tenant's weight: its share among tenants contending for a device.");
  for (const TenantSnapshot& t : s.tenants) w.sample({{"tenant", t.name}}, t.weight);
  const struct {
    std::string_view name, help;
    double TenantDeviceSnapshot::*v;
  } kFamilies[] = {
      {"cushare_tenant_fair_share_target",
       "Share of the contending tenants' device time the fair-share controller targets for the tenant "
       "(0..1; only while it contends).",
       &TenantDeviceSnapshot::fairTarget},
      {"cushare_tenant_fair_share_achieved",
       "Share of the contending tenants' device time the tenant got in the controller's last window "
       "(0..1; only while it contends).",
       &TenantDeviceSnapshot::fairAchieved},
  };
  for (const auto& f : kFamilies) {
    w.family(f.name, kGauge, f.help);
    for (const TenantSnapshot& t : s.tenants) {
      if (!t.error.empty()) continue;
      for (const TenantDeviceSnapshot& d : t.devices)
        if (d.contending) w.sampleFloat({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, d.*f.v);
    }
  }
}

// Probe rounds (docs/probes.md): each tenant's share as its probes measured it, over the last
// window (the current one before a window is complete). Only where the tenant has a window.
void renderTenantProbes(const BrokerSnapshot& s, Writer& w) {
  const auto each = [&](const auto& fn) {
    for (const TenantSnapshot& t : s.tenants) {
      if (!t.error.empty()) continue;
      for (const TenantDeviceSnapshot& d : t.devices)
        if (d.probe.known) fn(t, d);
    }
  };
  w.family("cushare_tenant_compute_share", kGauge,
           "Share of the device the tenant's work received, as its probe kernels measured it over the window (0..1; "
           "only once rounds with work were measured).");
  each([&](const TenantSnapshot& t, const TenantDeviceSnapshot& d) {
    if (d.probe.roundsWithWork > 0)
      w.sampleFloat({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, d.probe.share);
  });
  // How far to trust it (issue 26, point 7): with few rounds in the window the number alone says
  // little, and a dashboard or alert should say so or wait.
  w.family("cushare_tenant_compute_share_stderr", kGauge,
           "Standard error of cushare_tenant_compute_share over the window's rounds (0..1).");
  each([&](const TenantSnapshot& t, const TenantDeviceSnapshot& d) {
    if (d.probe.roundsWithWork > 0)
      w.sampleFloat({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, d.probe.shareError);
  });
  w.family("cushare_tenant_compute_share_trusted", kGauge,
           "1 when the window holds enough rounds (10 with work) for cushare_tenant_compute_share to be trusted; 0 "
           "while it does not and the share is only indicative.");
  each([&](const TenantSnapshot& t, const TenantDeviceSnapshot& d) {
    if (d.probe.roundsWithWork > 0)
      w.sample({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, d.probe.enough ? 1 : 0);
  });
  w.family("cushare_tenant_bandwidth_share", kGauge,
           "Share of the device's memory bandwidth the tenant's memory probes got over the window (0..1).");
  each([&](const TenantSnapshot& t, const TenantDeviceSnapshot& d) {
    if (d.probe.bandwidthShare) w.sampleFloat({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, *d.probe.bandwidthShare);
  });
  w.family("cushare_tenant_interference", kGauge,
           "Interference the tenant's probes measured over the window, by kind: compute (1 - 1/slowdown), bandwidth "
           "(1 - bandwidth share), latency (p95 start latency above solo, seconds).");
  each([&](const TenantSnapshot& t, const TenantDeviceSnapshot& d) {
    const std::string dev = deviceLabel(s, d.device);
    if (d.probe.computeIndex) w.sampleFloat({{"tenant", t.name}, {"device", dev}, {"uuid", d.uuid}, {"kind", "compute"}}, *d.probe.computeIndex);
    if (d.probe.bandwidthIndex)
      w.sampleFloat({{"tenant", t.name}, {"device", dev}, {"uuid", d.uuid}, {"kind", "bandwidth"}}, *d.probe.bandwidthIndex);
    if (d.probe.latencyIndexNs)
      w.sampleFloat({{"tenant", t.name}, {"device", dev}, {"uuid", d.uuid}, {"kind", "latency"}}, *d.probe.latencyIndexNs / 1e9);
  });
  w.family("cushare_tenant_probe_rounds", kGauge, "Probe rounds the tenant was in over the window.");
  each([&](const TenantSnapshot& t, const TenantDeviceSnapshot& d) {
    w.sample({{"tenant", t.name}, {"device", deviceLabel(s, d.device)}, {"uuid", d.uuid}}, d.probe.rounds);
  });
}

void renderTenants(const BrokerSnapshot& s, Writer& w) {
  w.family("cushare_tenant_processes", kGauge, "Live processes of the tenant.");
  for (const TenantSnapshot& t : s.tenants) w.sample({{"tenant", t.name}}, t.processes.size());
  w.family("cushare_tenant_info", kGauge,
           "Always 1; labels carry the tenant's profile, source and priority.");
  for (const TenantSnapshot& t : s.tenants)
    w.sample({{"tenant", t.name},
              {"profile", t.profile},
              {"source", t.source},
              {"priority", priorityName(t.priority)}},
             1);
  w.family("cushare_tenant_ledger_error", kGauge,
           "1 for a tenant whose ledger the broker cannot manage (see cushare status); absent "
           "otherwise.");
  for (const TenantSnapshot& t : s.tenants)
    if (!t.error.empty()) w.sample({{"tenant", t.name}}, 1);
  w.family("cushare_tenant_tamper_total", kCounter,
           "Changes a process of the tenant made to its ledger that the broker undid or charged, "
           "by kind: hidden, limit, uuid, descriptor, link, busy (GPU time its processes did not "
           "meter), killed (processes taken down for hidden memory); not-mps-client counts its "
           "processes found running outside the broker's MPS (docs/mps.md).");
  for (const TenantSnapshot& t : s.tenants)
    for (const auto& [kind, n] : t.tamper) w.sample({{"tenant", t.name}, {"kind", kind}}, n);
}

// Kubernetes containers (docs/kubernetes.md, "Pods, namespaces and containers"): what the tenant's
// processes in each container hold, from snapshotWithPods. Containers in PodRef order.
void renderContainers(const BrokerSnapshot& s, Writer& w) {
  w.family("cushare_kubernetes_pod_resources_up", kGauge,
           "With pod labels on: 1 when the kubelet's pod resources API answered the broker's last "
           "List, 0 when it did not (containers allocated since are not named); no sample when off.");
  if (s.podLabels.on) w.sample({}, s.podLabels.up ? 1 : 0);
  w.family("cushare_container_processes", kGauge,
           "Live processes of the tenant in the Kubernetes container (pod labels on, the "
           "container known).");
  for (const TenantSnapshot& t : s.tenants) {
    std::map<PodRef, uint64_t> n;
    for (const ProcessSnapshot& p : t.processes)
      if (p.pod) ++n[*p.pod];
    for (const auto& [pod, count] : n)
      w.sample({{"tenant", t.name}, {"namespace", pod.ns}, {"pod", pod.pod}, {"container", pod.container}}, count);
  }
  w.family("cushare_container_memory_used_bytes", kGauge,
           "Device memory the tenant's processes in the Kubernetes container hold on the device, "
           "bytes (part of cushare_tenant_memory_used_bytes).");
  for (const TenantSnapshot& t : s.tenants) {
    if (!t.error.empty()) continue;
    for (const TenantDeviceSnapshot& d : t.devices) {
      std::map<PodRef, uint64_t> used;
      for (const ProcessSnapshot& p : t.processes)
        if (p.pod) used[*p.pod] += static_cast<size_t>(d.device) < p.used.size() ? p.used[static_cast<size_t>(d.device)] : 0;
      for (const auto& [pod, bytes] : used)
        w.sample({{"tenant", t.name},
                  {"device", deviceLabel(s, d.device)},
                  {"uuid", d.uuid},
                  {"namespace", pod.ns},
                  {"pod", pod.pod},
                  {"container", pod.container}},
                 bytes);
    }
  }
}

}  // namespace

std::string escapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string renderMetrics(const BrokerSnapshot& s) {
  Writer w;
  renderBroker(s, w);
  renderDevices(s, w);
  renderTenantDevices(s, w);
  renderTenantCompute(s, w);
  renderTenantFairShare(s, w);
  renderTenantProbes(s, w);
  renderTenants(s, w);
  renderContainers(s, w);
  renderMps(s.mps, w);
  return w.take();
}

}  // namespace cushare::broker
