// The broker's metrics endpoint (broker/metrics): the exact text rendered for a snapshot with an
// unlimited tenant and one whose ledger has an error, label escaping, HELP/TYPE once per family,
// a strict validator of the exposition format run over the output, the HTTP server over real
// sockets (status codes, a silent client, the connection limit, prompt stop), and the example
// broker configuration in examples/, which must always parse.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "config/config.h"
#include "core/snapshot.h"
#include "metrics/http_server.h"
#include "metrics/prometheus.h"

namespace cushare::broker {
namespace {

constexpr uint64_t kMiB = 1ull << 20, kGiB = 1ull << 30;
constexpr const char* kUuid = "GPU-5e1a90c0-0000-4000-8000-000000000000";

// ---- A strict validator of the text format, version 0.0.4 ----

// "" when text is valid exposition text as renderMetrics promises it, else the first problem
// with its line number. Stricter than Prometheus where our output should be: every family has
// exactly one HELP, then its TYPE, then its samples (so families are grouped); a sample belongs
// to the family of the last TYPE; counters end in _total; no duplicate series or label names.
std::string validateExposition(const std::string& text) {
  static const std::regex kHelp("# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) [^\\\\\\n]+");
  static const std::regex kType(
      "# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)");
  const std::string label = R"([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")";
  const std::string value =
      R"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|NaN|[+-]Inf)";
  static const std::regex kSample("([a-zA-Z_:][a-zA-Z0-9_:]*)(\\{" + label + "(?:," + label +
                                  ")*\\})? (" + value + ")(?: -?[0-9]+)?");
  static const std::regex kLabelName(R"(([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*")");

  if (text.empty() || text.back() != '\n') return "text does not end in a newline";
  std::set<std::string> helped, series;
  std::string helpFor, family, familyType;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string at = "line " + std::to_string(n) + " '" + line + "': ";
    std::smatch m;
    if (std::regex_match(line, m, kHelp)) {
      if (!helped.insert(m[1]).second) return at + "second HELP for the family";
      helpFor = m[1];
    } else if (std::regex_match(line, m, kType)) {
      if (m[1] != helpFor) return at + "TYPE not right after its family's HELP";
      family = m[1];
      familyType = m[2];
      helpFor.clear();
    } else if (line.starts_with("#")) {
      return at + "unexpected comment";
    } else if (std::regex_match(line, m, kSample)) {
      if (m[1] != family) return at + "sample outside its family (or before its TYPE)";
      if (familyType == "counter" && !family.ends_with("_total"))
        return at + "counter without _total";
      std::set<std::string> names;
      const std::string labels = m[2];
      for (std::sregex_iterator it(labels.begin(), labels.end(), kLabelName), end; it != end; ++it)
        if (!names.insert((*it)[1]).second) return at + "duplicate label name";
      if (!series.insert(std::string(m[1]) + labels).second) return at + "duplicate series";
    } else {
      return at + "not a sample line";
    }
  }
  if (!helpFor.empty()) return "HELP for " + helpFor + " without TYPE";
  return "";
}

TEST(ExpositionValidator, RejectsWhatTheFormatForbids) {
  const std::string head = "# HELP a_total x\n# TYPE a_total counter\n";
  EXPECT_EQ(validateExposition(head + "a_total{l=\"v\"} 1\n"), "");
  EXPECT_EQ(validateExposition(head + "a_total 1.5e3\na_total{l=\"\\\"\\n\\\\\"} +Inf\n"), "");
  EXPECT_NE(validateExposition(head + "a_total 1"), "");                     // no final newline
  EXPECT_NE(validateExposition(head + "a_total{l=\"a\"b\"} 1\n"), "");       // raw quote
  EXPECT_NE(validateExposition(head + "a_total{l=\"\\x\"} 1\n"), "");        // bad escape
  EXPECT_NE(validateExposition(head + "a_total{l=\"v\",} 1\n"), "");         // trailing comma
  EXPECT_NE(validateExposition(head + "a_total{l=\"v\",l=\"w\"} 1\n"), "");  // duplicate label
  EXPECT_NE(validateExposition(head + "a_total 1\na_total 2\n"), "");        // duplicate series
  EXPECT_NE(validateExposition(head + "a_total 0x10\n"), "");                // not a float
  EXPECT_NE(validateExposition(head + "b 1\n"), "");                         // other family
  EXPECT_NE(validateExposition(head + head), "");                            // HELP twice
  EXPECT_NE(validateExposition("# HELP b x\n# TYPE b counter\nb 1\n"), "");  // counter name
  EXPECT_NE(validateExposition("# TYPE b gauge\nb 1\n"), "");                // TYPE without HELP
}

// ---- Rendering ----

// Two tenants on one device: alpha with a limit (set live), a peak past 2^53 and memory it hid
// from its ledger, beta unlimited; gamma's ledger cannot be opened.
BrokerSnapshot twoTenants() {
  BrokerSnapshot s;
  s.version = "0.1.0";
  s.configGeneration = 3;
  s.startedAt = 1733150000.25;
  s.reapedProcesses = 7;
  s.reloadsRefused = 1;
  s.ledgersRefused = 298;
  s.logLinesDropped = 2980;
  DeviceSnapshot d0;
  d0.index = 0;
  d0.uuid = kUuid;
  d0.busyNs = 2'500'000'000;
  d0.capacity = 16 * kGiB;
  d0.used = 768 * kMiB;
  d0.read = true;
  d0.deviceUsed = 5 * kGiB;
  d0.outside = 4 * kGiB;
  d0.outsidePids = {4242};
  s.devices = {d0};
  TenantSnapshot alpha;
  alpha.name = "alpha";
  alpha.source = "config";
  alpha.priority = Priority::kHigh;
  alpha.devices = {{0, kUuid, 512 * kMiB, 1 * kGiB, (1ull << 53) + 1, 3, true}};
  alpha.devices[0].hidden = 64 * kMiB;
  alpha.devices[0].leftBehind = 32 * kMiB;
  alpha.devices[0].busyNs = 1'500'000'000;
  alpha.devices[0].meteredBusyNs = 250'000'000;  // billed: the device's count, the larger
  alpha.devices[0].deviceBusyNs = 1'500'000'000;
  alpha.devices[0].shareNs = 750'000'000;
  alpha.devices[0].throttledNs = 250'000'000;
  alpha.devices[0].contending = true;
  alpha.devices[0].fairTarget = 0.5;
  alpha.devices[0].fairAchieved = 0.25;
  alpha.weight = 2;
  alpha.devices[0].probe.known = true;
  alpha.devices[0].probe.share = 0.3;
  alpha.devices[0].probe.shareError = 0.02;
  alpha.devices[0].probe.enough = true;
  alpha.devices[0].probe.rounds = 40;
  alpha.devices[0].probe.roundsWithWork = 38;
  alpha.devices[0].probe.latencyIndexNs = 2'500'000;
  alpha.processes = {{10, {256 * kMiB}}, {11, {256 * kMiB}}};
  alpha.tamper = {{"hidden", 2}, {"limit", 1}};
  TenantSnapshot beta;
  beta.name = "beta";
  beta.profile = "balanced";
  beta.source = "unknown-tenant";
  beta.devices = {{0, kUuid, 256 * kMiB, kNoLimit, 256 * kMiB, 0, false}};
  beta.processes = {{12, {256 * kMiB}}};
  TenantSnapshot gamma;
  gamma.name = "gamma";
  gamma.source = "config";
  gamma.priority = Priority::kLow;
  gamma.error = "cannot open /dev/shm/cushare/gamma.ledger: Permission denied";
  s.tenants = {alpha, beta, gamma};
  return s;
}

TEST(Prometheus, RendersTwoTenantsExactly) {
  const std::string expected =
      R"(# HELP cushare_broker_up 1 while the broker runs (a failed scrape means it is down).
# TYPE cushare_broker_up gauge
cushare_broker_up 1
# HELP cushare_broker_info Always 1; the version label carries the broker's version.
# TYPE cushare_broker_info gauge
cushare_broker_info{version="0.1.0"} 1
# HELP cushare_broker_config_generation Generation of the running configuration: 1 at start, +1 per accepted reload.
# TYPE cushare_broker_config_generation gauge
cushare_broker_config_generation 3
# HELP cushare_broker_start_time_seconds Start time of the broker, seconds since the Unix epoch.
# TYPE cushare_broker_start_time_seconds gauge
cushare_broker_start_time_seconds 1733150000.25
# HELP cushare_broker_reaped_processes_total Dead tenant processes whose device memory the broker returned to their tenant.
# TYPE cushare_broker_reaped_processes_total counter
cushare_broker_reaped_processes_total 7
# HELP cushare_broker_reloads_refused_total Configuration reloads refused; the running configuration was kept.
# TYPE cushare_broker_reloads_refused_total counter
cushare_broker_reloads_refused_total 1
# HELP cushare_broker_ledgers_refused_total Ledger files the broker refused to adopt: unknown tenants beyond max_unknown_tenants or max_unknown_tenants_per_uid, renamed ledgers it has no record of.
# TYPE cushare_broker_ledgers_refused_total counter
cushare_broker_ledgers_refused_total 298
# HELP cushare_broker_log_lines_dropped_total Log lines that other users can cause at will (refused ledger files, GPU processes that are no tenant's, malformed control requests) held back beyond their budget of 20 at once and one every 6 s per kind.
# TYPE cushare_broker_log_lines_dropped_total counter
cushare_broker_log_lines_dropped_total 2980
# HELP cushare_mig_layout_matches With a mig: layout in the configuration: 1 when every GPU it names had it at the broker's start (after mig.apply_at_start), 0 when some did not (the log says how); no sample without one.
# TYPE cushare_mig_layout_matches gauge
# HELP cushare_mig_layout_changes Changes the broker made at start to bring the GPUs to the mig: layout (instances destroyed and created, mode changes); no sample without a layout.
# TYPE cushare_mig_layout_changes gauge
# HELP cushare_device_memory_capacity_bytes Device memory of the GPU, bytes.
# TYPE cushare_device_memory_capacity_bytes gauge
cushare_device_memory_capacity_bytes{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 17179869184
# HELP cushare_device_memory_used_bytes Device memory in use by the tenants the broker manages (sum over tenants), bytes.
# TYPE cushare_device_memory_used_bytes gauge
cushare_device_memory_used_bytes{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 805306368
# HELP cushare_device_memory_reported_used_bytes Device memory in use as the device itself reports it (every process, cushare's or not), bytes; absent while the device's accounting cannot be read.
# TYPE cushare_device_memory_reported_used_bytes gauge
cushare_device_memory_reported_used_bytes{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 5368709120
# HELP cushare_device_memory_outside_bytes Device memory held by processes outside cushare (mapping no tenant's ledger): no tenant's limit counts it, bytes; absent while the device's accounting cannot be read.
# TYPE cushare_device_memory_outside_bytes gauge
cushare_device_memory_outside_bytes{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 4294967296
# HELP cushare_device_busy_seconds_total Time any process's kernels ran on the device, as NVML's per-process utilization counts it (every process, cushare's or not; MPS clients running side by side each count), seconds.
# TYPE cushare_device_busy_seconds_total counter
cushare_device_busy_seconds_total{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 2.5
# HELP cushare_device_thrash_guard 1 while the tenants bursting into managed memory on the device take turns on it (their bursts do not fit in the memory the device has for them together), else 0.
# TYPE cushare_device_thrash_guard gauge
cushare_device_thrash_guard{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_device_thrash_turns_total Turns the thrashing guard gave the tenants bursting into managed memory on the device (each turn brings its holder's working set back to the device).
# TYPE cushare_device_thrash_turns_total counter
cushare_device_thrash_turns_total{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_device_info 1 per device the broker shares: kind "gpu" or "mig"; the GPU's UUID (gpu_uuid: a MIG device's GPU, a GPU's own), a MIG device's profile (e.g. 3g.40gb), GPU instance and compute instance IDs (empty for a GPU).
# TYPE cushare_device_info gauge
cushare_device_info{device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000",kind="gpu",gpu_uuid="GPU-5e1a90c0-0000-4000-8000-000000000000",mig_profile="",gpu_instance_id="",compute_instance_id=""} 1
# HELP cushare_tenant_memory_used_bytes Device memory the tenant holds, bytes.
# TYPE cushare_tenant_memory_used_bytes gauge
cushare_tenant_memory_used_bytes{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 536870912
cushare_tenant_memory_used_bytes{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 268435456
# HELP cushare_tenant_memory_limit_bytes The tenant's memory limit on the device, bytes (no sample: no limit).
# TYPE cushare_tenant_memory_limit_bytes gauge
cushare_tenant_memory_limit_bytes{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 1073741824
# HELP cushare_tenant_memory_guarantee_bytes The tenant's guarantee on the device, bytes: what is reserved for it; above it, up to its limit, it bursts into managed memory (no sample: it does not burst).
# TYPE cushare_tenant_memory_guarantee_bytes gauge
# HELP cushare_tenant_memory_burst_bytes Device memory the tenant holds above its guarantee (managed memory the device may evict to host memory), bytes; included in cushare_tenant_memory_used_bytes.
# TYPE cushare_tenant_memory_burst_bytes gauge
# HELP cushare_tenant_memory_burst_host_bytes Of cushare_tenant_memory_burst_bytes, what is on host memory now (the device evicted it for allocations that needed the room, or it found none), bytes; an estimate (no sample: it does not burst).
# TYPE cushare_tenant_memory_burst_host_bytes gauge
# HELP cushare_tenant_reclaimed_bytes_total Bytes of the tenant's bursts found moved to host memory since the broker started (rises of cushare_tenant_memory_burst_host_bytes); an estimate (no sample: it does not burst).
# TYPE cushare_tenant_reclaimed_bytes_total counter
# HELP cushare_tenant_memory_peak_bytes Highest device memory the tenant has held, bytes.
# TYPE cushare_tenant_memory_peak_bytes gauge
cushare_tenant_memory_peak_bytes{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 9007199254740993
cushare_tenant_memory_peak_bytes{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 268435456
# HELP cushare_tenant_allocations_denied_total Allocations refused because they would exceed the tenant's limit.
# TYPE cushare_tenant_allocations_denied_total counter
cushare_tenant_allocations_denied_total{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 3
cushare_tenant_allocations_denied_total{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_hidden_bytes Device memory the tenant's processes hold beyond what its ledger shows (NVML per-process accounting), charged to the tenant by the broker; included in cushare_tenant_memory_used_bytes.
# TYPE cushare_tenant_hidden_bytes gauge
cushare_tenant_hidden_bytes{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 67108864
cushare_tenant_hidden_bytes{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_left_behind_bytes Device memory the tenant's exited processes left on the device (shareable memory an exported descriptor keeps alive), charged to the tenant by the broker; included in cushare_tenant_memory_used_bytes.
# TYPE cushare_tenant_left_behind_bytes gauge
cushare_tenant_left_behind_bytes{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 33554432
cushare_tenant_left_behind_bytes{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_memory_limit_overridden 1 when the limit was set live (cushare set-limit) rather than by the configuration.
# TYPE cushare_tenant_memory_limit_overridden gauge
cushare_tenant_memory_limit_overridden{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 1
cushare_tenant_memory_limit_overridden{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_reclaim_seconds A plain burster's last reclaim: the time from the broker's request to the tenant holding no more than it was asked, seconds (up to a tick, 50 ms, late); 0 before the first, or when it never got there (no sample: it does not burst into plain memory).
# TYPE cushare_tenant_reclaim_seconds gauge
# HELP cushare_tenant_gpu_busy_seconds_total GPU time during which the tenant's work executed on the device, as charged and billed: the larger of what its processes metered and what the device counted for them, seconds.
# TYPE cushare_tenant_gpu_busy_seconds_total counter
cushare_tenant_gpu_busy_seconds_total{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 1.5
cushare_tenant_gpu_busy_seconds_total{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_gpu_metered_busy_seconds_total GPU time the tenant's processes metered (timing events on their streams, or CUPTI), seconds.
# TYPE cushare_tenant_gpu_metered_busy_seconds_total counter
cushare_tenant_gpu_metered_busy_seconds_total{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.25
cushare_tenant_gpu_metered_busy_seconds_total{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_gpu_device_busy_seconds_total GPU time the device counted for the tenant's processes (NVML per-process utilization), seconds.
# TYPE cushare_tenant_gpu_device_busy_seconds_total counter
cushare_tenant_gpu_device_busy_seconds_total{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 1.5
cushare_tenant_gpu_device_busy_seconds_total{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_gpu_share_seconds_total The tenant's share of the device's time, for chargeback: busy time times the fraction of the SMs it could use (its MPS percentage, 1 outside MPS), scaled so that the tenants of a device never sum to more than the device's time, seconds.
# TYPE cushare_tenant_gpu_share_seconds_total counter
cushare_tenant_gpu_share_seconds_total{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.75
cushare_tenant_gpu_share_seconds_total{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_throttled_seconds_total Time the tenant's launches waited for their turn (compute caps and priorities), seconds.
# TYPE cushare_tenant_throttled_seconds_total counter
cushare_tenant_throttled_seconds_total{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.25
cushare_tenant_throttled_seconds_total{tenant="beta",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0
# HELP cushare_tenant_weight The tenant's weight: its share among tenants contending for a device.
# TYPE cushare_tenant_weight gauge
cushare_tenant_weight{tenant="alpha"} 2
cushare_tenant_weight{tenant="beta"} 1
cushare_tenant_weight{tenant="gamma"} 1
# HELP cushare_tenant_fair_share_target Share of the contending tenants' device time the fair-share controller targets for the tenant (0..1; only while it contends).
# TYPE cushare_tenant_fair_share_target gauge
cushare_tenant_fair_share_target{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.5
# HELP cushare_tenant_fair_share_achieved Share of the contending tenants' device time the tenant got in the controller's last window (0..1; only while it contends).
# TYPE cushare_tenant_fair_share_achieved gauge
cushare_tenant_fair_share_achieved{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.25
# HELP cushare_tenant_compute_share Share of the device the tenant's work received, as its probe kernels measured it over the window (0..1; only once rounds with work were measured).
# TYPE cushare_tenant_compute_share gauge
cushare_tenant_compute_share{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.3
# HELP cushare_tenant_compute_share_stderr Standard error of cushare_tenant_compute_share over the window's rounds (0..1).
# TYPE cushare_tenant_compute_share_stderr gauge
cushare_tenant_compute_share_stderr{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 0.02
# HELP cushare_tenant_compute_share_trusted 1 when the window holds enough rounds (10 with work) for cushare_tenant_compute_share to be trusted; 0 while it does not and the share is only indicative.
# TYPE cushare_tenant_compute_share_trusted gauge
cushare_tenant_compute_share_trusted{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 1
# HELP cushare_tenant_bandwidth_share Share of the device's memory bandwidth the tenant's memory probes got over the window (0..1).
# TYPE cushare_tenant_bandwidth_share gauge
# HELP cushare_tenant_interference Interference the tenant's probes measured over the window, by kind: compute (1 - 1/slowdown), bandwidth (1 - bandwidth share), latency (p95 start latency above solo, seconds).
# TYPE cushare_tenant_interference gauge
cushare_tenant_interference{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000",kind="latency"} 0.0025
# HELP cushare_tenant_probe_rounds Probe rounds the tenant was in over the window.
# TYPE cushare_tenant_probe_rounds gauge
cushare_tenant_probe_rounds{tenant="alpha",device="0",uuid="GPU-5e1a90c0-0000-4000-8000-000000000000"} 40
# HELP cushare_tenant_processes Live processes of the tenant.
# TYPE cushare_tenant_processes gauge
cushare_tenant_processes{tenant="alpha"} 2
cushare_tenant_processes{tenant="beta"} 1
cushare_tenant_processes{tenant="gamma"} 0
# HELP cushare_tenant_info Always 1; labels carry the tenant's profile, source and priority.
# TYPE cushare_tenant_info gauge
cushare_tenant_info{tenant="alpha",profile="",source="config",priority="high"} 1
cushare_tenant_info{tenant="beta",profile="balanced",source="unknown-tenant",priority="normal"} 1
cushare_tenant_info{tenant="gamma",profile="",source="config",priority="low"} 1
# HELP cushare_tenant_ledger_error 1 for a tenant whose ledger the broker cannot manage (see cushare status); absent otherwise.
# TYPE cushare_tenant_ledger_error gauge
cushare_tenant_ledger_error{tenant="gamma"} 1
# HELP cushare_tenant_tamper_total Changes a process of the tenant made to its ledger that the broker undid or charged, by kind: hidden, limit, uuid, descriptor, link, busy (GPU time its processes did not meter), killed (processes taken down for hidden memory); not-mps-client counts its processes found running outside the broker's MPS (docs/mps.md).
# TYPE cushare_tenant_tamper_total counter
cushare_tenant_tamper_total{tenant="alpha",kind="hidden"} 2
cushare_tenant_tamper_total{tenant="alpha",kind="limit"} 1
# HELP cushare_kubernetes_pod_resources_up With pod labels on: 1 when the kubelet's pod resources API answered the broker's last List, 0 when it did not (containers allocated since are not named); no sample when off.
# TYPE cushare_kubernetes_pod_resources_up gauge
# HELP cushare_container_processes Live processes of the tenant in the Kubernetes container (pod labels on, the container known).
# TYPE cushare_container_processes gauge
# HELP cushare_container_memory_used_bytes Device memory the tenant's processes in the Kubernetes container hold on the device, bytes (part of cushare_tenant_memory_used_bytes).
# TYPE cushare_container_memory_used_bytes gauge
# HELP cushare_mps_up 1 when the last health check of the MPS control daemon got an answer.
# TYPE cushare_mps_up gauge
# HELP cushare_mps_restarts_total Times the broker restarted the MPS control daemon after it exited or hung.
# TYPE cushare_mps_restarts_total counter
# HELP cushare_mps_health_check_failures_total Health checks of the MPS control daemon that got no answer.
# TYPE cushare_mps_health_check_failures_total counter
# HELP cushare_mps_server_faults_total MPS servers seen entering the FAULT state.
# TYPE cushare_mps_server_faults_total counter
# HELP cushare_mps_server_fault 1 for an MPS server in FAULT (its clients get errors; new clients are refused until they exit).
# TYPE cushare_mps_server_fault gauge
# HELP cushare_mps_server_clients Clients of each MPS server.
# TYPE cushare_mps_server_clients gauge
# HELP cushare_mps_tenant_thread_percentage The active thread percentage a tenant's new processes get as MPS clients (100: no cap).
# TYPE cushare_mps_tenant_thread_percentage gauge
)";
  const std::string text = renderMetrics(twoTenants());
  EXPECT_EQ(text, expected);
  EXPECT_EQ(validateExposition(text), "");
}

TEST(Prometheus, EveryFamilyHasOneHelpAndOneTypeEvenWithoutSamples) {
  for (const BrokerSnapshot& s : {BrokerSnapshot{}, twoTenants()}) {
    const std::string text = renderMetrics(s);
    ASSERT_EQ(validateExposition(text), "") << text;
    std::map<std::string, int> helps, types;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      if (line.starts_with("# HELP ")) ++helps[line.substr(7, line.find(' ', 7) - 7)];
      if (line.starts_with("# TYPE ")) ++types[line.substr(7, line.find(' ', 7) - 7)];
    }
    EXPECT_EQ(helps.size(), 58u);
    EXPECT_EQ(helps, types);
    for (const auto& [name, count] : helps) EXPECT_EQ(count, 1) << name;
  }
}

// Pod labels (docs/kubernetes.md): per container of each tenant, its processes and what they hold
// per device; processes whose container is not known count only in the tenant's families.
TEST(Prometheus, RendersContainersOfTenantsExactly) {
  BrokerSnapshot s = twoTenants();
  s.podLabels.on = true;
  TenantSnapshot& alpha = s.tenants[0];
  alpha.processes = {{10, {100 * kMiB}}, {11, {28 * kMiB}}, {13, {128 * kMiB}}, {14, {0}}};
  alpha.processes[0].pod = PodRef{"team-a", "infer-0", "server"};
  alpha.processes[1].pod = PodRef{"team-a", "infer-0", "server"};
  alpha.processes[3].pod = PodRef{"team-a", "infer-0", "side\"car\""};  // escaped like any label value
  s.tenants[1].processes[0].pod = PodRef{"team-b", "batch-7", "main"};
  s.tenants[2].processes = {{20, {}}};  // gamma: its ledger is in error, no memory figures
  s.tenants[2].processes[0].pod = PodRef{"team-c", "x", "y"};
  const std::string text = renderMetrics(s);
  ASSERT_EQ(validateExposition(text), "") << text;
  std::string got;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("cushare_container_") || line.starts_with("cushare_kubernetes_")) got += line + "\n";
  const std::string d = std::string("device=\"0\",uuid=\"") + kUuid + "\"";
  EXPECT_EQ(got, "cushare_kubernetes_pod_resources_up 0\n"
                 "cushare_container_processes{tenant=\"alpha\",namespace=\"team-a\",pod=\"infer-0\",container=\"server\"} 2\n"
                 "cushare_container_processes{tenant=\"alpha\",namespace=\"team-a\",pod=\"infer-0\",container=\"side\\\"car\\\"\"} 1\n"
                 "cushare_container_processes{tenant=\"beta\",namespace=\"team-b\",pod=\"batch-7\",container=\"main\"} 1\n"
                 "cushare_container_processes{tenant=\"gamma\",namespace=\"team-c\",pod=\"x\",container=\"y\"} 1\n"
                 "cushare_container_memory_used_bytes{tenant=\"alpha\"," + d + ",namespace=\"team-a\",pod=\"infer-0\",container=\"server\"} 134217728\n"
                 "cushare_container_memory_used_bytes{tenant=\"alpha\"," + d + ",namespace=\"team-a\",pod=\"infer-0\",container=\"side\\\"car\\\"\"} 0\n"
                 "cushare_container_memory_used_bytes{tenant=\"beta\"," + d + ",namespace=\"team-b\",pod=\"batch-7\",container=\"main\"} 268435456\n");
  s.podLabels.up = true;
  EXPECT_NE(renderMetrics(s).find("\ncushare_kubernetes_pod_resources_up 1\n"), std::string::npos);
}

TEST(Prometheus, RendersTheMpsDaemonWhileTheBrokerRunsIt) {
  BrokerSnapshot s = twoTenants();
  s.mps.active = true;
  s.mps.up = true;
  s.mps.restarts = 2;
  s.mps.faults = 1;
  s.mps.servers = {{4242, "FAULT", {10, 11}, ""}};
  s.mps.published = {{"alpha", 30}, {"beta", std::nullopt}, {"", 50}};
  const std::string text = renderMetrics(s);
  EXPECT_EQ(validateExposition(text), "") << text;
  for (const char* sample : {"\ncushare_mps_up 1\n", "\ncushare_mps_restarts_total 2\n",
                             "\ncushare_mps_server_faults_total 1\n", "\ncushare_mps_server_fault{server=\"4242\"} 1\n",
                             "\ncushare_mps_server_clients{server=\"4242\"} 2\n",
                             "\ncushare_mps_tenant_thread_percentage{tenant=\"alpha\"} 30\n",
                             "\ncushare_mps_tenant_thread_percentage{tenant=\"beta\"} 100\n"})
    EXPECT_NE(text.find(sample), std::string::npos) << sample << text;
  EXPECT_EQ(text.find("tenant=\"\"}"), std::string::npos) << "the unknown-tenant profile is no tenant";
}

TEST(Prometheus, EscapesLabelValues) {
  EXPECT_EQ(escapeLabelValue(R"(a\b"c)"
                             "\nd\te"),
            R"(a\\b\"c\nd)"
            "\te");
  BrokerSnapshot s = twoTenants();
  s.version = "1.0 \"rc\"\n\\x";
  s.tenants[1].name = "b\\\"\n";
  s.tenants[1].profile = "p=\"{x}\",y";
  const std::string text = renderMetrics(s);
  EXPECT_EQ(validateExposition(text), "") << text;
  EXPECT_NE(text.find("cushare_broker_info{version=\"1.0 \\\"rc\\\"\\n\\\\x\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("cushare_tenant_info{tenant=\"b\\\\\\\"\\n\",profile=\"p=\\\"{x}\\\",y\","),
            std::string::npos);
}

TEST(Prometheus, PrintsExtremeValuesExactly) {
  BrokerSnapshot s = twoTenants();
  s.tenants[0].devices[0].denied = UINT64_MAX;
  s.startedAt = 0.1;
  const std::string text = renderMetrics(s);
  EXPECT_NE(text.find("{tenant=\"alpha\",device=\"0\",uuid=\"GPU-5e1a90c0-0000-4000-8000-000000000000\"} 18446744073709551615\n"),
            std::string::npos);
  EXPECT_NE(text.find("cushare_broker_start_time_seconds 0.1\n"), std::string::npos);
}

// ---- HTTP server ----

uint16_t portOf(const MetricsServer& server) {
  const std::string a = server.address();
  return static_cast<uint16_t>(std::stoi(a.substr(a.rfind(':') + 1)));
}

// A blocking client socket from source address `from` (any of 127/8) to 127.0.0.1:port; reads
// time out after 10 s.
int connectFrom(const char* from, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from, &src.sin_addr);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src), 0) << std::strerror(errno);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  return fd;
}

int connectTo(uint16_t port) { return connectFrom("127.0.0.1", port); }

// Everything the server sends until it closes (or the 10 s read timeout).
std::string readAll(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    out.append(buf, static_cast<size_t>(n));
  return out;
}

// Sends raw (ignoring a server that closes early) and returns the whole reply.
std::string roundTrip(uint16_t port, const std::string& raw) {
  const int fd = connectTo(port);
  ::send(fd, raw.data(), raw.size(), MSG_NOSIGNAL);
  std::string reply = readAll(fd);
  ::close(fd);
  return reply;
}

std::string statusLine(const std::string& reply) { return reply.substr(0, reply.find("\r\n")); }
std::string bodyOf(const std::string& reply) { return reply.substr(reply.find("\r\n\r\n") + 4); }

class MetricsServerTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string err;
    ASSERT_TRUE(server_.start(
        "127.0.0.1", 0,
        [this] {
          ++renders_;
          return std::string("cushare_broker_up 1\n");
        },
        &err))
        << err;
    port_ = portOf(server_);
  }
  MetricsServer server_;
  uint16_t port_ = 0;
  std::atomic<int> renders_{0};
};

TEST_F(MetricsServerTest, ServesMetrics) {
  EXPECT_TRUE(server_.address().starts_with("127.0.0.1:")) << server_.address();
  EXPECT_NE(port_, 0);
  for (const char* version : {"HTTP/1.1", "HTTP/1.0"}) {
    const std::string reply =
        roundTrip(port_, std::string("GET /metrics ") + version + "\r\nHost: x\r\n\r\n");
    EXPECT_EQ(reply,
              "HTTP/1.1 200 OK\r\n"
              "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Content-Length: 20\r\n"
              "Connection: close\r\n\r\n"
              "cushare_broker_up 1\n");
  }
  EXPECT_EQ(renders_, 2);
  // A query string, an absolute-form target and bare-LF line ends are accepted.
  EXPECT_EQ(bodyOf(roundTrip(port_, "GET /metrics?x=1 HTTP/1.1\r\n\r\n")), "cushare_broker_up 1\n");
  EXPECT_EQ(bodyOf(roundTrip(port_, "GET http://h:1/metrics HTTP/1.1\r\n\r\n")),
            "cushare_broker_up 1\n");
  EXPECT_EQ(bodyOf(roundTrip(port_, "GET /metrics HTTP/1.0\nHost: x\n\n")),
            "cushare_broker_up 1\n");
}

TEST_F(MetricsServerTest, HeadIsGetWithoutBody) {
  const std::string reply = roundTrip(port_, "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(statusLine(reply), "HTTP/1.1 200 OK");
  EXPECT_NE(reply.find("Content-Length: 20\r\n"), std::string::npos) << reply;
  EXPECT_EQ(bodyOf(reply), "");
}

TEST_F(MetricsServerTest, AnswersErrorsWithTheirStatus) {
  const std::string index = roundTrip(port_, "GET / HTTP/1.1\r\n\r\n");
  EXPECT_EQ(statusLine(index), "HTTP/1.1 200 OK");
  EXPECT_NE(bodyOf(index).find("/metrics"), std::string::npos);
  EXPECT_EQ(statusLine(roundTrip(port_, "GET /nope HTTP/1.1\r\n\r\n")), "HTTP/1.1 404 Not Found");
  const std::string post =
      roundTrip(port_, "POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc");
  EXPECT_EQ(statusLine(post), "HTTP/1.1 405 Method Not Allowed");
  EXPECT_NE(post.find("\r\nAllow: GET, HEAD\r\n"), std::string::npos) << post;
  for (const char* bad :
       {"garbage\r\n\r\n", "GET /metrics\r\n\r\n", "GET  /metrics HTTP/1.1\r\n\r\n",
        "GET metrics HTTP/1.1\r\n\r\n", "G(T /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1 x\r\n\r\n", "\r\n\r\n"})
    EXPECT_EQ(statusLine(roundTrip(port_, bad)), "HTTP/1.1 400 Bad Request") << bad;
  // A malformed request line is answered without waiting for the end of the headers.
  EXPECT_EQ(statusLine(roundTrip(port_, "garbage\r\n")), "HTTP/1.1 400 Bad Request");
  EXPECT_EQ(statusLine(roundTrip(port_, "GET /metrics HTTP/2.0\r\n\r\n")),
            "HTTP/1.1 505 HTTP Version Not Supported");
  const std::string huge = "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(9000, 'a') + "\r\n\r\n";
  EXPECT_EQ(statusLine(roundTrip(port_, huge)), "HTTP/1.1 431 Request Header Fields Too Large");
  EXPECT_EQ(statusLine(roundTrip(port_, std::string(20000, 'a'))),
            "HTTP/1.1 431 Request Header Fields Too Large");
  EXPECT_EQ(renders_, 0);
}

TEST(MetricsServer, RenderFailureIs500) {
  MetricsServer server;
  std::string err;
  ASSERT_TRUE(server.start(
      "127.0.0.1", 0, []() -> std::string { throw std::runtime_error("boom"); }, &err))
      << err;
  const std::string reply = roundTrip(portOf(server), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(statusLine(reply), "HTTP/1.1 500 Internal Server Error");
  EXPECT_EQ(bodyOf(reply), "cannot render metrics: boom\n");
}

TEST_F(MetricsServerTest, SilentClientDoesNotBlockOthersAndIsDroppedAfter5s) {
  using namespace std::chrono;
  const auto start = steady_clock::now();
  const int silent = connectTo(port_);
  ::send(silent, "GET /met", 8, MSG_NOSIGNAL);  // never finished
  const auto before = steady_clock::now();
  EXPECT_EQ(statusLine(roundTrip(port_, "GET /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 200 OK");
  EXPECT_LT(steady_clock::now() - before, milliseconds(2000));
  EXPECT_EQ(readAll(silent), "");  // dropped: EOF, no response
  const auto waited = steady_clock::now() - start;
  EXPECT_GE(waited, milliseconds(4900));
  EXPECT_LT(waited, milliseconds(8000));
  ::close(silent);
}

// How long one GET /metrics takes, from connect to the whole response; "" status on failure.
std::chrono::milliseconds timedScrape(uint16_t port, std::string* status) {
  const auto t0 = std::chrono::steady_clock::now();
  *status = statusLine(roundTrip(port, "GET /metrics HTTP/1.1\r\n\r\n"));
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               t0);
}

// 64 connections that send half a request and wait (slow loris) hold every slot: a newcomer
// displaces the oldest of them and is answered at once, not after their 5 s head timeout.
TEST_F(MetricsServerTest, SilentConnectionsCannotStarveANewClient) {
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) {
    idle.push_back(connectTo(port_));
    ::send(idle.back(), "GET /met", 8, MSG_NOSIGNAL);
  }
  for (int round = 0; round < 3; ++round) {
    std::string status;
    const auto took = timedScrape(port_, &status);
    EXPECT_EQ(status, "HTTP/1.1 200 OK");
    EXPECT_LT(took, std::chrono::milliseconds(2000)) << "round " << round;
  }
  // The displaced ones were the oldest, closed without a response.
  EXPECT_EQ(readAll(idle[0]), "");
  for (int fd : idle) ::close(fd);
}

// One address holds at most 16 connections: a 17th from it displaces its own oldest waiting
// one, and a client of another address is never displaced by it.
TEST_F(MetricsServerTest, OneAddressHoldsAtMost16Connections) {
  std::vector<int> hog;
  for (int i = 0; i < 40; ++i) {
    hog.push_back(connectFrom("127.0.0.2", port_));
    ::send(hog.back(), "GET /met", 8, MSG_NOSIGNAL);
  }
  const int other = connectFrom("127.0.0.3", port_);
  ::send(other, "GET /met", 8, MSG_NOSIGNAL);
  // Another 40 from the hog: none of them may displace 127.0.0.3's waiting connection.
  for (int i = 0; i < 40; ++i) {
    hog.push_back(connectFrom("127.0.0.2", port_));
    ::send(hog.back(), "GET /met", 8, MSG_NOSIGNAL);
  }
  const std::string rest = "rics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::send(other, rest.data(), rest.size(), MSG_NOSIGNAL), static_cast<ssize_t>(rest.size()));
  EXPECT_EQ(statusLine(readAll(other)), "HTTP/1.1 200 OK");
  ::close(other);
  // Of the hog's 80, the first 64 were displaced, oldest first, at once (end of file, no
  // response; not the 5 s head timeout); the last 16 are still open.
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < hog.size(); ++i) {
    pollfd p{hog[i], POLLIN, 0};
    const bool closed = ::poll(&p, 1, i < 64 ? 1000 : 0) == 1 && readAll(hog[i]).empty();
    EXPECT_EQ(closed, i < 64) << "connection " << i;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  for (int fd : hog) ::close(fd);
}

// A client that opens connections as fast as it can from four addresses (enough to fill all 64
// slots) and leaves them silent, and one on the scraper's own address that sends whole requests
// as fast as it can: every scrape is still answered, promptly.
TEST_F(MetricsServerTest, FloodingClientsDoNotStarveAScraper) {
  std::atomic<bool> stop{false};
  std::atomic<int> silentOpened{0}, floodServed{0};
  std::vector<std::thread> attackers;
  attackers.emplace_back([&] {
    const char* const from[] = {"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"};
    std::deque<int> open;
    for (int i = 0; !stop; ++i) {
      open.push_back(connectFrom(from[i % 4], port_));
      ::send(open.back(), "G", 1, MSG_NOSIGNAL);
      ++silentOpened;
      if (open.size() > 200) {
        ::close(open.front());
        open.pop_front();
      }
    }
    for (int fd : open) ::close(fd);
  });
  attackers.emplace_back([&] {
    while (!stop)
      if (statusLine(roundTrip(port_, "GET /metrics HTTP/1.1\r\n\r\n")) == "HTTP/1.1 200 OK")
        ++floodServed;
  });
  while (silentOpened < 400) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::chrono::milliseconds worst{0};
  for (int i = 0; i < 10; ++i) {
    std::string status;
    worst = std::max(worst, timedScrape(port_, &status));
    EXPECT_EQ(status, "HTTP/1.1 200 OK") << i;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  stop = true;
  for (std::thread& t : attackers) t.join();
  EXPECT_LT(worst, std::chrono::milliseconds(2500));
  EXPECT_GT(floodServed, 0);
  std::printf("worst scrape %lld ms under %d silent connections and %d flooding requests\n",
              static_cast<long long>(worst.count()), silentOpened.load(), floodServed.load());
}

TEST_F(MetricsServerTest, StopIsPromptWithClientsConnectedAndIdempotent) {
  const int silent = connectTo(port_);
  const auto before = std::chrono::steady_clock::now();
  server_.stop();
  EXPECT_LT(std::chrono::steady_clock::now() - before, std::chrono::milliseconds(2000));
  EXPECT_EQ(server_.address(), "");
  EXPECT_EQ(readAll(silent), "");  // closed by stop()
  ::close(silent);
  server_.stop();
  // The port is free again: nothing listens there.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port_);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_NE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ::close(fd);
}

TEST_F(MetricsServerTest, StartFailuresAreOneSpecificLine) {
  MetricsServer other;
  std::string err;
  EXPECT_FALSE(other.start(
      "127.0.0.1", port_, [] { return std::string(); }, &err));
  EXPECT_EQ(err,
            "cannot listen on 127.0.0.1:" + std::to_string(port_) + ": Address already in use");
  EXPECT_FALSE(other.start(
      "192.0.2.1", 9464, [] { return std::string(); }, &err));  // not ours
  EXPECT_EQ(err, "cannot listen on 192.0.2.1:9464: Cannot assign requested address");
  EXPECT_FALSE(server_.start(
      "127.0.0.1", 0, [] { return std::string(); }, &err));
  EXPECT_EQ(err, "metrics server already listening on " + server_.address());
}

TEST(MetricsServer, ListensOnNamesAndIpv6) {
  MetricsServer byName;
  std::string err;
  ASSERT_TRUE(byName.start(
      "localhost", 0, [] { return std::string(); }, &err))
      << err;
  EXPECT_TRUE(byName.address().starts_with("127.0.0.1:") || byName.address().starts_with("[::1]:"))
      << byName.address();
  MetricsServer v6;
  if (!v6.start(
          "::1", 0, [] { return std::string(); }, &err))
    GTEST_SKIP() << "no IPv6: " << err;
  EXPECT_TRUE(v6.address().starts_with("[::1]:")) << v6.address();
}

// ---- The example configuration ----

TEST(ExampleConfig, BrokerYamlParsesAndFitsOneSimulatedGpu) {
  const std::filesystem::path source = std::filesystem::path(__FILE__).parent_path().parent_path();
  const std::string file = (source.parent_path() / "examples" / "broker.yaml").string();
  Config c;
  std::string error;
  ASSERT_TRUE(loadConfig(file, &c, &error)) << error;
  EXPECT_EQ(c.metricsHost, "127.0.0.1");
  EXPECT_EQ(c.metricsPort, 9464);
  ASSERT_EQ(c.profiles.size(), 2u);
  EXPECT_EQ(c.profiles[0].name, "memory-optimized");
  EXPECT_EQ(c.profiles[1].name, "balanced");
  ASSERT_EQ(c.tenants.size(), 3u);
  EXPECT_EQ(c.tenants[0].name, "alpha");
  EXPECT_EQ(c.tenants[0].uid, 1000u);
  EXPECT_EQ(c.tenants[0].memory.all.bytes, 4 * kGiB);
  EXPECT_EQ(c.tenants[1].profile, "balanced");
  EXPECT_EQ(c.tenants[1].threadPercentage, 25);
  EXPECT_EQ(c.tenants[2].memory.kind, MemorySpec::kPerDevice);
  // The limits fit simgpu's default device (16 GiB) as well as an 80 GB H100.
  for (uint64_t total : {16 * kGiB, 80 * kGiB}) {
    DeviceInfo d;
    d.uuid = kUuid;
    d.totalBytes = total;
    EXPECT_TRUE(checkAgainstDevices(c, {d}, &error)) << error;
  }
}

}  // namespace
}  // namespace cushare::broker
