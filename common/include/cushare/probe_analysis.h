// Host-side analysis of one probe launch (docs/probe-analysis.md): the records of a launch of
// cushare_probe_sm, cushare_probe_mem or cushare_probe_tick (probe_abi.h) in, the launch's numbers
// out, or a one-line reason why the records cannot be trusted. Also the solo baselines the numbers
// are compared with: how they are calibrated, kept up to date and persisted.
//
// Invariants:
// - Pure code: no CUDA, no global state, no logging, no allocation beyond the results; safe on any
//   thread of the broker.
// - Bad records (kProbeBadArgs, a block that wrote nothing, end < start, unknown flags, absurd
//   values, the wrong number of records) give false with *err, never a number.
// - A launch in which no block ran (every block late) is a missing sample: analyzeLaunch returns
//   kMissing, never a rate of zero.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cushare/probe_abi.h"

namespace cushare::probe {

// Bounds beyond which a record is absurd rather than slow.
inline constexpr uint64_t kMaxBudgetNs = 100'000'000;     // 100 ms: probes are time-boxed far below
inline constexpr uint64_t kMaxOverrunNs = 1'000'000'000;  // a block ending > 1 s past its deadline
inline constexpr uint32_t kMaxSmId = 4096;                // %smid (virtual under MPS) below this
inline constexpr double kMaxCyclesPerNs = 10.0;           // 10 GHz
inline constexpr double kMaxBytesPerNs = 100'000.0;       // 100 TB/s for the whole device
inline constexpr uint32_t kMaxRecords = 1u << 20;
inline constexpr uint64_t kMaxTimerNs = 1ull << 62;  // %globaltimer past this: garbage
// A probe that starts up to this long before its round's instant is put at the instant (the
// host-to-device clock relation is that uncertain); earlier is a wrong round start: bad.
inline constexpr uint64_t kMaxClockSkewNs = 100'000;

// What the host knows about a launch besides its records.
struct LaunchContext {
  ProbeKind kind = kProbeSm;
  uint64_t budget_ns = 0;      // ProbeArgs::budget_ns
  uint32_t grid_blocks = 0;    // blocks launched: exactly this many records are read back
  uint32_t work_per_step = 0;  // ProbeArgs::work_per_step (SM probe)
  uint32_t sm_count = 0;       // multiprocessors of the whole device (not an MPS client's view)
  // Device time (ns, the %globaltimer clock) of the round's instant; 0: unknown (no latency).
  uint64_t round_start_ns = 0;
  // Device time of the host's launch call (the same clock); 0: unknown or not to be used. Given
  // only when the probe thread was idle at the instant, so that a late launch is the host's CPU
  // delay (uncorrelated with who holds the device; judged from the instant it would drop the
  // holder's sample) and not a wait at the tenant's own gate (which is the share being measured).
  uint64_t launch_ns = 0;
};

enum class LaunchOutcome { kNumbers, kMissing, kBad };

// Numbers of one launch, before any comparison with a baseline.
struct LaunchNumbers {
  ProbeKind kind = kProbeSm;
  uint64_t budget_ns = 0;
  uint32_t work_per_step = 0;
  uint32_t sm_count = 0;        // the device's, from the context
  uint32_t blocks = 0;          // records read
  uint32_t ran = 0;             // blocks with kProbeRan
  uint32_t late = 0;            // blocks with kProbeLate (did no work; never counted as zero work)
  uint32_t migrated = 0;        // blocks that ended on another SM than they started on
  uint64_t first_start_ns = 0;  // earliest entry of any block (ran or late)
  bool has_latency = false;     // round_start_ns was given
  // first_start_ns - max(round_start_ns, ctx.launch_ns) (>= 0): how long the probe waited once
  // it was launched (from the instant when the launch time is unknown or earlier).
  double start_latency_ns = 0;
  double window_ns = 0;         // earliest entry to latest exit of the blocks that ran
  // SM probe.
  double steps_per_us = 0;       // progress steps of all blocks per us of the window
  uint32_t distinct_sms = 0;     // SMs reached (by %smid at entry)
  uint32_t max_stack = 0;        // most of this launch's blocks on one SM at one instant
  double mean_stack = 0;         // mean number of its blocks on an SM while any was there
  double resident_fraction = 0;  // 1 - gaps/window over the SMs reached (stack-corrected)
  double cycles_per_step = 0;    // SM cycles per step, stacked blocks divided out
  double cycles_per_ns = 0;      // SM clock while resident
  // Memory probe.
  double bytes_per_us = 0;
  // Tick probe (and any kind: the gaps the blocks recorded).
  uint64_t tick_ns = 0;     // smallest non-zero timer step seen (tick probe); 0 otherwise
  uint64_t gap_ns = 0;      // sum of the blocks' gap_ns
  uint64_t max_gap_ns = 0;  // largest max_gap_ns of a block
  uint64_t samples = 0;     // tick probe: timer reads
};

// Reads exactly expected_count records from the bytes copied back from the device (little-endian
// BlockRecord layout of probe_abi.h, decoded field by field).
bool decodeRecords(std::span<const uint8_t> bytes, uint32_t expected_count,
                   std::vector<BlockRecord>* out, std::string* err);

// The launch's numbers. kBad: *err says which block and what is wrong; *out is unspecified.
// kMissing: every block was late (no block ran); *out has the counts and first_start_ns only.
LaunchOutcome analyzeLaunch(std::span<const BlockRecord> records, const LaunchContext& ctx,
                            LaunchNumbers* out, std::string* err);

// Nearest-rank percentile (p in (0, 1]) of a non-empty sample.
double nearestRankPercentile(std::vector<double> v, double p);

// The same probes on an otherwise idle device, persisted by the broker per device.
struct SoloBaseline {
  // The parameters the numbers hold for; a launch with other parameters is not compared.
  uint32_t sm_count = 0;
  uint64_t sm_budget_ns = 0;
  uint32_t sm_work_per_step = 0;
  uint64_t mem_budget_ns = 0;
  // SM probe (0: not calibrated).
  double sm_steps_per_us = 0;
  uint32_t sm_distinct = 0;
  double sm_resident_fraction = 0;
  double sm_cycles_per_step = 0;
  double sm_cycles_per_ns = 0;
  // Memory probe (0: not calibrated).
  double mem_bytes_per_us = 0;
  // Launch-to-start latency (negative: unknown) and the timer tick.
  double latency_p95_ns = -1;
  uint64_t tick_ns = 0;
  uint32_t launches = 0;  // how many launches the numbers come from

  bool hasSm() const { return sm_steps_per_us > 0 && sm_cycles_per_step > 0; }
  bool hasMem() const { return mem_bytes_per_us > 0; }
  bool hasLatency() const { return latency_p95_ns >= 0; }
};

// Text form ("format 1", one "key value" a line), strict: every key known, every value checked.
std::string formatSoloBaseline(const SoloBaseline& b);
bool parseSoloBaseline(std::string_view text, SoloBaseline* out, std::string* err);

// Calibration: launches made while nothing else runs on the device (the broker's own context,
// tenants' gates closed or no tenant with work). Medians of the rates (robust to one slow launch),
// the 95th percentile of the rounds' start latencies.
inline constexpr uint32_t kMinCalibrationLaunches = 5;
class BaselineCalibration {
 public:
  void add(const LaunchNumbers& n);  // rates and tick; no latency
  // A calibration round's earliest start after its instant (the minimum of its launches'
  // start_latency_ns): the same statistic the window compares with (ShareAggregator).
  void addRoundStart(double latency_ns);
  // False with *err when fewer than kMinCalibrationLaunches SM launches (or, when any were added,
  // memory or latency samples) were added, or the launches disagree on their parameters.
  bool build(uint32_t sm_count, SoloBaseline* out, std::string* err) const;

 private:
  std::vector<LaunchNumbers> sm_, mem_;
  std::vector<double> latency_;
  uint64_t tick_ = 0;
};

// Rolling maximum, for devices that are never idle long enough to calibrate: the best any probe
// did over the last `capacity` observations. A round that found the device otherwise idle equals
// solo, so the maximum converges to solo from below; a calibrated value is never lowered.
// Latency: a percentile (the 95th unless told) of each round's fastest start (under exclusive
// turns or time slices the resident tenant's probe starts without waiting, so the fastest start of
// a round is a solo start).
class RollingBaseline {
 public:
  explicit RollingBaseline(size_t capacity = 256, double latencyPercentile = 0.95);
  void observe(const LaunchNumbers& n);  // any numbers of a launch with the baseline's parameters
  void observeRoundFastestStart(double latency_ns);
  // base with every rate raised (cycles per step lowered) to the best seen; base's parameters kept.
  SoloBaseline merged(const SoloBaseline& base) const;

 private:
  size_t capacity_;
  double latencyPercentile_;
  std::vector<LaunchNumbers> sm_, mem_;
  std::vector<double> fastest_;
  size_t sm_next_ = 0, mem_next_ = 0, fastest_next_ = 0;
};

// The SM probe's factors against its solo baseline (docs/probe-analysis.md, "SM probe").
struct SmFactors {
  double spatial = 0;   // distinct SMs reached / SMs of the device
  double temporal = 0;  // resident fraction / solo's
  double intra = 0;     // solo cycles per step / cycles per step (own stacked blocks divided out)
  double clock = 0;     // cycles per ns / solo's
  double rate = 0;      // steps per us / solo's: the product of the four, up to rounding
  // What the launch says its tenant's work receives of the device (clock excluded: a slower
  // clock slows every tenant alike), clamped to [0, 1].
  double share() const;
};
bool smFactors(const LaunchNumbers& n, const SoloBaseline& b, SmFactors* out, std::string* err);
// Bytes per us / solo's.
bool bandwidthRatio(const LaunchNumbers& n, const SoloBaseline& b, double* out, std::string* err);

}  // namespace cushare::probe
