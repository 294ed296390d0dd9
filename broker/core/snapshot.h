// A consistent picture of the broker's state at one moment: what the control API, the CLI and the
// metrics endpoint report. Plain data, no behaviour; built by Broker::snapshot().
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/pod_labels.h"
#include "cushare/shim_config.h"

namespace cushare::broker {

inline constexpr uint64_t kNoLimit = UINT64_MAX;

struct DeviceSnapshot {
  int index = 0;             // the GPU's NVML index (a MIG device's: its parent's)
  std::string uuid;          // "GPU-...", or "MIG-..." for a MIG device
  uint64_t capacity = 0;     // bytes
  uint64_t used = 0;         // bytes, summed over every tenant the broker manages
  // The device's own accounting (NVML), as of the broker's last tick (outside_memory.cpp):
  uint64_t deviceUsed = 0;   // used memory as the device reports it, every process and driver reserve
  uint64_t outside = 0;      // held by processes that map no tenant's ledger (outside cushare)
  std::vector<int> outsidePids;  // those processes (host pids), largest first
  bool read = false;         // the device's accounting could be read
  uint64_t busyNs = 0;       // every process's busy time on it as NVML counted it, ns (counter)
  // The thrashing guard of its memory group (docs/memory-elasticity.md): managed bursters taking
  // turns now, and the turns given since the broker started (a counter).
  bool thrashGuard = false;
  uint64_t thrashTurns = 0;
  std::string name;          // "0", or "0:1" for MIG device 1 of GPU 0 (set by the broker)
  int migIndex = -1;         // MIG devices only (-1 otherwise): index under the GPU, and below
  std::string parentUuid;    // the GPU's UUID
  std::string migProfile;    // e.g. "3g.40gb"
  unsigned gpuInstance = 0, computeInstance = 0;
};

struct TenantDeviceSnapshot {
  int device = 0;            // index into BrokerSnapshot::devices
  std::string uuid;
  uint64_t used = 0;
  uint64_t limit = kNoLimit;  // kNoLimit: none
  uint64_t peak = 0;
  uint64_t denied = 0;        // allocations refused (a counter)
  bool overridden = false;    // limit set live by set-limit
  // Bursting (docs/memory-elasticity.md): its guarantee (kNoLimit: it does not burst) and what it
  // holds above it (managed memory the device may evict to host memory).
  uint64_t guarantee = kNoLimit;
  uint64_t burst = 0;
  uint64_t burstHost = 0;  // of burst, on host memory now (an estimate, elasticity.cpp)
  uint64_t reclaimed = 0;  // bytes of its bursts moved to host memory or given back (a counter)
  bool plain = false;          // it bursts into plain memory (reclaimed cooperatively)
  double reclaimSeconds = 0;   // plain: the last reclaim's time to reach its target (0: none yet)
  uint64_t hidden = 0;        // bytes the device holds for the tenant beyond its ledger, charged
                              // by the broker (included in used)
  uint64_t leftBehind = 0;    // bytes its exited processes left on the device (exported memory),
                              // charged by the broker (included in used)
  // Compute (docs/compute.md): counters since the broker started, never going back.
  uint64_t busyNs = 0;        // GPU time the tenant is charged and billed: the larger of
                              // meteredBusyNs and deviceBusyNs
  uint64_t meteredBusyNs = 0; // GPU time the tenant's processes metered (events or CUPTI)
  uint64_t deviceBusyNs = 0;  // GPU time the device counted for the tenant's processes (NVML)
  uint64_t shareNs = 0;       // its share of the device's time, summing to at most the device's (docs/compute.md)
  uint64_t throttledNs = 0;   // time its launches waited at the closed gate
  bool paced = false;         // the scheduler gates the tenant's launches on this device now
  // Fair share (docs/compute.md): the tenant contends on the device (it had work lately, beside
  // another tenant), and the controller's last view of its share: the target and what it got
  // (of the contenders' device time, 0..1; 0 before the first 500 ms window).
  bool contending = false;
  double fairTarget = 0, fairAchieved = 0;
  // Probe rounds (docs/probes.md): the tenant's share as its probes measured it over the last
  // window (or the current one before a window is complete).
  struct Probe {
    bool known = false;
    bool complete = false;     // a whole window
    bool enough = false;       // enough rounds for the estimate
    double share = 0, shareError = 0;  // achieved compute share, its standard error
    uint32_t rounds = 0, roundsWithWork = 0, missing = 0, bad = 0;
    std::string regime;        // time-sliced, turns, concurrent
    double startedFraction = 0;
    // Concurrent (MPS) rounds: the SM probe's factors, means over those rounds (none: no such round).
    std::optional<double> spatial, temporal, intra;
    std::optional<double> bandwidthShare, computeIndex, bandwidthIndex, latencyIndexNs, latencyP95Ns;
    double windowSeconds = 0;
    std::string lastError;
    std::string caveat;  // why the share may not be what it got (empty: none known)
  } probe{};
};

struct ProcessSnapshot {
  int pid = 0;                  // as recorded in the ledger (the process's own pid namespace)
  std::vector<uint64_t> used;   // bytes, indexed like BrokerSnapshot::devices
  int hostPid = 0;              // the slot's holder as the kernel names it in the broker's pid
                                // namespace (Ledger::slotHolderPid); 0: unknown
  // The Kubernetes container it runs in (pod_labels.h); only in Broker::snapshotWithPods, and
  // only for a process whose container the broker could tell.
  std::optional<PodRef> pod{};
};

struct TenantSnapshot {
  std::string name;
  std::string profile;          // empty: none
  std::string source;           // "config", "unknown-tenant", "removed"
  std::optional<int> threadPercentage;
  Priority priority = Priority::kNormal;
  uint32_t weight = 1;              // fair share (docs/compute.md)
  bool threadsOverridden = false;   // threadPercentage set live (set-limit --threads)
  bool priorityOverridden = false;  // priority set live (set-limit --priority)
  std::string ledgerPath;
  std::string error;            // non-empty: the broker cannot manage this tenant's ledger
  // Per broker device, the memory limit the broker holds the tenant to (configuration, live
  // changes; kNoLimit: none), whatever the state of its ledger: what its MPS settings say.
  std::vector<uint64_t> limits;
  std::vector<TenantDeviceSnapshot> devices;   // one per broker device (empty when error)
  std::vector<ProcessSnapshot> processes;      // live processes
  // Changes to its ledger a process of the tenant made that the broker undid or charged, by kind:
  // "hidden" (memory on the device its ledger did not show), "limit", "uuid" (a device entry
  // rewritten), "descriptor" (a live process's slot unlocked), "link" (hard links to the ledger).
  std::map<std::string, uint64_t> tamper;
};

// The broker's MPS control daemon as its supervisor last saw it (core/mps_daemon.h).
struct MpsServerSnapshot {
  int pid = 0;
  std::string state;         // INITIALIZING, ACTIVE, FAULT (as get_server_status answers)
  std::vector<int> clients;  // client pids (get_client_list)
  std::string daemon;        // its control daemon's MIG device ("MIG-..."), "" for the whole GPUs'
};

struct MpsSnapshot {
  std::string mode = "off";  // as configured: "off", "on", "auto"
  bool active = false;       // the broker runs MPS (on, or auto found a working control binary)
  std::string why;           // mode auto and not active: why not
  std::string control;       // the control binary in use
  std::string pipeDir, logDir;
  bool up = false;           // the last health check got an answer (from every daemon)
  // Per broker device: its daemon answered the last health check (empty: `up` for every device).
  std::vector<uint8_t> deviceUp;
  int daemonPid = 0;         // from the pipe directory's pid file; 0: unknown
  uint64_t restarts = 0;     // daemon restarts after it died or hung (a counter)
  uint64_t faults = 0;       // servers seen entering FAULT (a counter)
  uint64_t checkFailures = 0;  // health checks that got no answer (a counter)
  std::string lastError;     // the last problem (empty while healthy)
  int defaultThreads = 100;  // set_default_active_thread_percentage
  std::vector<MpsServerSnapshot> servers;
  // Per tenant, the active thread percentage its new processes get ("" tenant: the unknown-tenant
  // profile); unset: no cap.
  std::map<std::string, std::optional<int>> published;
  // Per tenant, its live processes by the percentage they started with, as far as the broker can
  // tell from their start times against its publications ("30", "none": no cap, "unknown": started
  // before this broker published): a change applies to new processes only.
  std::map<std::string, std::map<std::string, uint32_t>> running;
};

struct BrokerSnapshot {
  std::string version;          // cushare version
  int pid = 0;
  std::string configFile;
  uint64_t configGeneration = 0;   // 1 at start, +1 per accepted reload
  double startedAt = 0;            // unix time, seconds
  double uptimeSeconds = 0;
  std::string ledgerDir;
  std::string unknownTenants;      // "refuse" or the profile name
  std::string metricsAddress;      // host:port bound, empty when off
  std::vector<DeviceSnapshot> devices;
  std::vector<TenantSnapshot> tenants;  // configured first (config order), then the others by name
  uint64_t reapedProcesses = 0;    // dead processes whose usage the broker returned (counter)
  uint64_t reloadsRefused = 0;     // counter
  uint64_t ledgersRefused = 0;     // counter: ledger files not adopted (unknown-tenant caps, unknown renamed files)
  uint64_t logLinesDropped = 0;    // counter: log lines other users caused beyond their budget (log_limit.h)
  MpsSnapshot mps;                 // mode "off" and not active when the broker runs no MPS
  // Pod labels (pod_labels.h), in Broker::snapshotWithPods while they are on.
  struct PodLabels {
    bool on = false;    // configured (kubernetes.pod_resources_socket)
    bool up = false;    // the kubelet's pod resources API answered its last List
    std::string error;  // why not
  } podLabels;
  // The mig: layout (docs/mig.md), checked at start after mig.apply_at_start applied it.
  struct MigLayout {
    bool checked = false;                  // a mig: block, and the check could read the GPUs
    bool matches = false;                  // every GPU it names has it
    uint64_t changes = 0;                  // changes the broker made at start (instances, modes)
    std::vector<std::string> differences;  // one line per GPU that differs
  } migLayout;
};

}  // namespace cushare::broker
