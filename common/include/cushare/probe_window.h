// Per-tenant shares of one device over a window of probe rounds (docs/probe-analysis.md,
// "Window estimates"). A round is the probes of every tenant launched at one instant; the window
// turns each tenant's rounds into its achieved compute share (with the number of valid rounds and
// a standard error), its bandwidth share and three interference indices.
//
// Which factors make a share (the rule):
// - kTimeSliced (no MPS, no pacing: the GPU time-slices between contexts) and kTurns (cushare's
//   exclusive turns; the probe goes through the tenant's gate): only one tenant holds the device
//   at a time, so a round's sample is 1 when the tenant's probe started within the start
//   threshold (AggregatorOptions) of the round's instant, else 0. The mean over rounds is the
//   fraction of time the tenant held the device. The SM factors are not used (while it holds the
//   device they only show the tenant's own load).
// - kConcurrent (MPS clients): tenants run side by side; a round's sample is the SM probe's
//   spatial x temporal x intra-SM factor (self-stacking corrected), summed over the tenant's
//   contexts and capped at 1.
// A tenant without work in a round gives no share sample (its share is left to the others); a
// round whose samples are missing (every block late) or bad gives none either.
//
// Not thread-safe: one aggregator per device, fed by the broker's probe thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cushare/probe_analysis.h"

namespace cushare::probe {

enum class Regime : uint8_t { kTimeSliced, kTurns, kConcurrent };
const char* regimeName(Regime r);

// Where a tenant's round instant lies in the clock its records follow. The broker asks for the
// instant in host realtime (at_realtime); %globaltimer follows realtime on NVIDIA GPUs, the host's
// monotonic clock on simgpu. The tenant's answer carries both host clocks at its launch
// (launch_realtime, launch_monotonic: a container's time namespace may shift its monotonic clock)
// and its records' earliest start (first_start); the records follow the clock first_start lies
// within `match_ns` of. Returns the instant in that clock, 0 when they follow neither. Judged per
// tenant: one tenant's stamps never place another's samples in time.
uint64_t instantInRecordsClock(uint64_t at_realtime, uint64_t first_start, uint64_t launch_realtime,
                               uint64_t launch_monotonic, uint64_t match_ns);

struct ProbeLaunch {
  // ctx.round_start_ns: the round's instant in the clock of this tenant's records (each tenant's
  // clock is judged from its own stamps, so no tenant can move another's instant); 0: the round's.
  LaunchContext ctx;
  std::vector<BlockRecord> records;
};

// The probes run in one context (process) of a tenant in one round.
struct ContextProbes {
  std::vector<ProbeLaunch> launches;
  // Its first launch waited at the tenant's closed compute gate, or the instant came while the
  // probe thread waited at it for an earlier round (the shim's kAnswerFirstLaunchWaitedAtGate):
  // the tenant did not hold the device at the instant, so this context did not start, however
  // soon the gate opened; nor is its start a solo latency.
  bool waited_at_gate = false;
};

struct TenantRound {
  std::string tenant;
  Regime regime = Regime::kTimeSliced;
  bool has_work = false;  // the tenant had kernels queued or running at the round's instant
  std::vector<ContextProbes> contexts;
  // Why this tenant's answer cannot be placed in time (e.g. its records follow neither host
  // clock): counted as bad with this reason, no sample; empty when fine.
  std::string error;
};

struct Round {
  uint64_t start_ns = 0;  // the round's instant in device time (%globaltimer ns); launches may carry their own
  std::vector<TenantRound> tenants;
};

struct AggregatorOptions {
  // A probe whose round's earliest start came within solo p95 latency + max(start_epsilon_ns,
  // start_epsilon_fraction x solo p95) of the instant did not wait for the device. Small on
  // purpose: a launch that arrives within the threshold before the tenant's hardware slice begins
  // counts as started, a bias of about threshold / cycle per slice (before its turn, under
  // cushare's turns, it waits at its closed gate: a wait).
  double start_epsilon_ns = 5'000;
  double start_epsilon_fraction = 0.5;
  // Without a solo latency in the baseline: this is the whole threshold.
  double default_start_threshold_ns = 100'000;
  // In turns, at least this (docs/probes.md, "The start threshold"): turns last 10 ms and more,
  // so a wait shorter than this is the holder's own (behind its running blocks), not another's
  // turn (a launch before its own turn waits at its gate and is a wait whatever its latency).
  double turns_min_start_threshold_ns = 500'000;
  uint32_t min_rounds = 10;  // fewer valid rounds: the estimate is given but not `enough`
};

struct Estimate {
  bool known = false;   // at least one valid round
  bool enough = false;  // at least min_rounds valid rounds
  double value = 0;     // mean of the round samples
  double stderr_ = 0;   // standard error of the mean (sample standard deviation / sqrt(n))
  uint32_t rounds = 0;  // valid rounds it is from
};

struct TenantWindow {
  std::string tenant;
  Regime regime = Regime::kTimeSliced;  // of its latest round
  uint32_t rounds = 0;                  // rounds the tenant was in
  uint32_t rounds_with_work = 0;
  uint32_t missing = 0;      // rounds with work whose SM or memory sample was missing
  uint32_t bad = 0;          // launches with bad records (or parameters not the baseline's)
  uint32_t uncompared = 0;   // SM and memory launches with no baseline to compare with yet
  std::string last_error;    // the latest bad launch's reason
  Estimate compute_share;    // what its work received of the device
  Estimate bandwidth_share;  // of the device's memory bandwidth
  // Means over the valid concurrent rounds (0 when none): what the compute share is made of.
  double spatial = 0, temporal = 0, intra = 0;
  double clock = 0;             // cycles per ns vs solo, mean over its SM probes (0: none)
  double started_fraction = 0;  // rounds with work that started without waiting
  // Interference indices (nullopt: not measurable in this window).
  std::optional<double> compute_index;     // 1 - 1/slowdown, slowdown = 1 / (share x clock)
  std::optional<double> bandwidth_index;   // 1 - bandwidth share
  std::optional<double> latency_index_ns;  // p95 start latency - solo p95
  std::optional<double> latency_p95_ns;    // p95 start latency (every round, with work or not)
};

class ShareAggregator {
 public:
  explicit ShareAggregator(SoloBaseline baseline, AggregatorOptions options = {});
  void setBaseline(const SoloBaseline& baseline) { baseline_ = baseline; }
  const SoloBaseline& baseline() const { return baseline_; }

  // Analyses every launch of the round. Returns one line per bad launch (tenant and reason) for
  // the log; the tenant's other launches and the other tenants still count. A round without an
  // instant (start_ns 0) is not counted at all; a tenant listed twice counts once.
  std::vector<std::string> addRound(const Round& round);

  // The estimates of the window so far, one per tenant seen, by tenant name.
  std::vector<TenantWindow> window() const;
  void reset();  // starts a new window (the baseline is kept)

  // The fastest start of each round so far (for RollingBaseline::observeRoundFastestStart).
  const std::vector<double>& fastestStarts() const { return fastest_; }

 private:
  struct Acc {
    Regime regime = Regime::kTimeSliced;
    uint32_t rounds = 0, with_work = 0, missing = 0, bad = 0, uncompared = 0, started = 0,
             started_of = 0;
    std::string last_error;
    std::vector<double> share, bandwidth, latency, clock;
    double spatial = 0, temporal = 0, intra = 0;
    uint32_t concurrent = 0;
  };
  double startThreshold() const;
  SoloBaseline baseline_;
  AggregatorOptions options_;
  std::map<std::string, Acc> acc_;
  std::vector<double> fastest_;
};

}  // namespace cushare::probe
