// Probe rounds (docs/probes.md, "Rounds"): the broker's side. Every `probes.interval_ms` per
// device, one round: each tenant with a live process there is asked (its ledger's probe_* words)
// to run the probes in one of its processes at one instant; the records come back through the
// tenant's probe file and a ShareAggregator (cushare/probe_window.h) turns them into each
// tenant's achieved share over `probes.window_s`.
//
// Owned by the broker, called from the compute thread under the broker's mutex (computeTick), so
// it takes no lock of its own. Reads the probe files with pread only (a tenant that truncates its
// file makes a short read, never a fault); writes the request words inside the caller's guard.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "config/config.h"
#include "cushare/ledger.h"
#include "cushare/probe_analysis.h"
#include "cushare/probe_window.h"

namespace cushare::broker {

// What the scheduler knows of a tenant on a device at a step.
struct ProbeTenant {
  std::string name;
  Ledger* ledger = nullptr;  // its ledger (the request words, the slots)
  int entry = -1;            // its device entry in the ledger
  bool work = false;         // it had work on the device lately (compute state)
  probe::Regime regime = probe::Regime::kTimeSliced;
  uid_t owner = 0;           // the probe file's owner, group and mode: the ledger's
  int gid = -1;
  mode_t mode = 0600;
};

// A tenant's share on a device as the last complete window (or, before one, the current) saw it.
struct ProbeView {
  bool known = false;
  probe::TenantWindow window;
  uint64_t windowNs = 0;  // the window's length
  bool complete = false;  // a whole window (false: the current one, still filling)
};

class ProbeScheduler {
 public:
  ProbeScheduler(const ProbeConfig& config, std::string ledgerDir, size_t devices);
  ~ProbeScheduler();
  void configure(const ProbeConfig& config);  // a reload

  // One step for device d (monotonic now). guarded runs a function touching a ledger's mapping
  // inside the broker's SIGBUS guard and says whether it faulted (fault: the caller's tenant).
  void step(size_t d, uint64_t nowMono, std::vector<ProbeTenant>& tenants,
            const std::function<bool(const std::function<void()>&)>& guarded);

  std::optional<ProbeView> view(const std::string& tenant, size_t d) const;
  void forget(const std::string& tenant);  // a tenant gone: its probe file closed and removed

 private:
  struct Pending {
    uint32_t seq = 0;
    bool done = false;
    bool work = false;
    probe::Regime regime = probe::Regime::kTimeSliced;
    probe::ContextProbes probes;
    uint64_t launchRealtime = 0, launchMonotonic = 0;  // of its first launch
    uint64_t firstStart = 0;                           // earliest record start (device ns)
  };
  struct Round {
    uint64_t atRealtime = 0;
    uint64_t deadlineMono = 0;
    std::map<std::string, Pending> tenants;
  };
  struct Device {
    uint64_t nextMono = 0;
    std::vector<Round> rounds;  // asked, not all answered yet (in the order asked)
    std::unique_ptr<probe::ShareAggregator> agg;
    // The start threshold's solo latency is the 75th percentile of the rounds' fastest starts: the
    // 95th (the analysis's default) takes in the rounds that fell on a turn switch (every tenant
    // waited a drain), which makes the threshold as long as a switch (with 10 ms turns that
    // counted a fifth of the waits as starts).
    probe::RollingBaseline rolling{256, 0.75};
    uint64_t windowStart = 0;
    std::map<std::string, probe::TenantWindow> last;  // the last complete window
    uint64_t lastLength = 0;
    // Per tenant, why its last answer carried no records (the shim's own words, e.g. "the process
    // does not use the device's primary context: not probed"); cleared by an answer with records.
    std::map<std::string, std::string> answerError;
  };

  int fileFor(const ProbeTenant& t);  // the tenant's probe file (created if missing); -1: none
  // why: set to the answer's error when it came without records, cleared when it came with them.
  bool collect(int fd, Pending* p, uint32_t* smCount, std::string* why);
  void finish(size_t d, Device& dev, Round r);

  ProbeConfig config_;
  std::string ledgerDir_;
  std::vector<Device> devices_;
  std::map<std::string, int> fds_;
  std::map<std::string, std::tuple<uid_t, int, mode_t>> made_;  // owner, group, mode fds_ were made for
  std::set<std::string> warned_;  // tenants whose probe file could not be made (said once)
  uint32_t seq_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace cushare::broker
