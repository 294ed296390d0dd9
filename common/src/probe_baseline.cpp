// Solo baselines of the probes (common/include/cushare/probe_analysis.h): calibration on an idle
// device (medians, p95 latency), a rolling maximum for devices that never idle, and the text form
// the broker persists. Parsing is strict: a damaged file is an error, never a baseline of zeros.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cushare/probe_analysis.h"

namespace cushare::probe {
namespace {

bool fail(std::string* err, std::string msg) {
  if (err) *err = std::move(msg);
  return false;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

template <class F>
double medianOf(const std::vector<LaunchNumbers>& v, F f) {
  std::vector<double> x;
  for (const LaunchNumbers& n : v) x.push_back(double(f(n)));
  return median(std::move(x));
}


template <class T>
void ringPush(std::vector<T>* ring, size_t* next, size_t capacity, const T& v) {
  if (ring->size() < capacity) {
    ring->push_back(v);
  } else {
    (*ring)[*next] = v;
    *next = (*next + 1) % capacity;
  }
}

constexpr const char* kFormatLine = "format 1";

}  // namespace

double nearestRankPercentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t rank = size_t(std::ceil(p * double(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

// --- calibration ---------------------------------------------------------------------------

void BaselineCalibration::add(const LaunchNumbers& n) {
  if (n.ran == 0) return;  // a missing sample says nothing about solo
  if (n.kind == kProbeSm) sm_.push_back(n);
  if (n.kind == kProbeMem) mem_.push_back(n);
  if (n.tick_ns && (tick_ == 0 || n.tick_ns < tick_)) tick_ = n.tick_ns;
}

void BaselineCalibration::addRoundStart(double latency_ns) {
  if (latency_ns >= 0) latency_.push_back(latency_ns);
}

bool BaselineCalibration::build(uint32_t sm_count, SoloBaseline* out, std::string* err) const {
  const std::string need = std::to_string(kMinCalibrationLaunches);
  if (sm_.size() < kMinCalibrationLaunches)
    return fail(err, "probe calibration: " + std::to_string(sm_.size()) +
                         " SM probe launches ran, at least " + need + " are needed");
  for (const LaunchNumbers& n : sm_)
    if (n.work_per_step != sm_[0].work_per_step || n.budget_ns != sm_[0].budget_ns ||
        n.sm_count != sm_count)
      return fail(err,
                  "probe calibration: SM probe launches with different parameters "
                  "(work_per_step, budget or SM count)");
  for (const LaunchNumbers& n : mem_)
    if (n.budget_ns != mem_[0].budget_ns)
      return fail(err, "probe calibration: memory probe launches with different budgets");
  if (!mem_.empty() && mem_.size() < kMinCalibrationLaunches)
    return fail(err, "probe calibration: " + std::to_string(mem_.size()) +
                         " memory probe launches ran, at least " + need + " are needed");
  if (!latency_.empty() && latency_.size() < kMinCalibrationLaunches)
    return fail(err, "probe calibration: " + std::to_string(latency_.size()) +
                         " start latencies, at least " + need + " are needed");
  SoloBaseline b;
  b.sm_count = sm_count;
  b.sm_budget_ns = sm_[0].budget_ns;
  b.sm_work_per_step = sm_[0].work_per_step;
  b.sm_steps_per_us = medianOf(sm_, [](const LaunchNumbers& n) { return n.steps_per_us; });
  b.sm_distinct = uint32_t(medianOf(sm_, [](const LaunchNumbers& n) { return n.distinct_sms; }));
  b.sm_resident_fraction =
      medianOf(sm_, [](const LaunchNumbers& n) { return n.resident_fraction; });
  b.sm_cycles_per_step = medianOf(sm_, [](const LaunchNumbers& n) { return n.cycles_per_step; });
  b.sm_cycles_per_ns = medianOf(sm_, [](const LaunchNumbers& n) { return n.cycles_per_ns; });
  if (!mem_.empty()) {
    b.mem_budget_ns = mem_[0].budget_ns;
    b.mem_bytes_per_us = medianOf(mem_, [](const LaunchNumbers& n) { return n.bytes_per_us; });
  }
  if (!latency_.empty()) b.latency_p95_ns = nearestRankPercentile(latency_, 0.95);
  b.tick_ns = tick_;
  b.launches = uint32_t(sm_.size() + mem_.size());
  *out = b;
  return true;
}

// --- rolling maximum ------------------------------------------------------------------------

RollingBaseline::RollingBaseline(size_t capacity, double latencyPercentile)
    : capacity_(std::max<size_t>(capacity, 1)), latencyPercentile_(latencyPercentile) {}

void RollingBaseline::observe(const LaunchNumbers& n) {
  if (n.ran == 0) return;
  if (n.kind == kProbeSm) ringPush(&sm_, &sm_next_, capacity_, n);
  if (n.kind == kProbeMem) ringPush(&mem_, &mem_next_, capacity_, n);
}

void RollingBaseline::observeRoundFastestStart(double latency_ns) {
  if (latency_ns >= 0) ringPush(&fastest_, &fastest_next_, capacity_, latency_ns);
}

SoloBaseline RollingBaseline::merged(const SoloBaseline& base) const {
  SoloBaseline b = base;
  // Parameters: the base's; an uncalibrated base adopts those of the latest SM observation.
  if (b.sm_work_per_step == 0 && !sm_.empty()) {
    const LaunchNumbers& latest =
        sm_[sm_.size() < capacity_ ? sm_.size() - 1 : (sm_next_ + capacity_ - 1) % capacity_];
    b.sm_work_per_step = latest.work_per_step;
    b.sm_budget_ns = latest.budget_ns;
    b.sm_count = latest.sm_count;
  }
  for (const LaunchNumbers& n : sm_) {
    // Per-SM numbers from every launch with the baseline's work per step; the device-wide rate
    // scaled to the baseline's SM count, the distinct SMs only from launches on that count.
    if (n.work_per_step != b.sm_work_per_step || n.sm_count == 0) continue;
    b.sm_steps_per_us = std::max(b.sm_steps_per_us, n.steps_per_us * double(b.sm_count) / double(n.sm_count));
    if (n.sm_count == b.sm_count) b.sm_distinct = std::max(b.sm_distinct, n.distinct_sms);
    b.sm_resident_fraction = std::max(b.sm_resident_fraction, n.resident_fraction);
    b.sm_cycles_per_ns = std::max(b.sm_cycles_per_ns, n.cycles_per_ns);
    // Cycles per step only from launches whose blocks each had an SM to themselves: stacked
    // blocks each count the SM's cycles, and the analysis divides their sum by the depth, so a
    // stacked launch whose blocks do not slow each other (a latency-bound FMA chain: four warps
    // per block, one FMA in flight each) reads 1/depth of the solo value. Taken as the best, it
    // made every unstacked launch after it read an intra-SM factor of 1/depth (0.83 on simgpu's
    // MPS, whose probe blocks stack behind a client's own).
    if (n.max_stack <= 1 && (b.sm_cycles_per_step == 0 || n.cycles_per_step < b.sm_cycles_per_step))
      b.sm_cycles_per_step = n.cycles_per_step;
  }
  for (const LaunchNumbers& n : mem_) {
    if (b.mem_budget_ns == 0) b.mem_budget_ns = n.budget_ns;
    b.mem_bytes_per_us = std::max(b.mem_bytes_per_us, n.bytes_per_us);
  }
  if (!b.hasLatency() && fastest_.size() >= kMinCalibrationLaunches)
    b.latency_p95_ns = nearestRankPercentile(fastest_, latencyPercentile_);
  return b;
}

// --- text form -----------------------------------------------------------------------------

std::string formatSoloBaseline(const SoloBaseline& b) {
  char buf[1024];
  snprintf(buf, sizeof buf,
           "%s\nsm_count %u\nsm_budget_ns %llu\nsm_work_per_step %u\nmem_budget_ns %llu\n"
           "sm_steps_per_us %.17g\nsm_distinct %u\nsm_resident_fraction %.17g\n"
           "sm_cycles_per_step %.17g\nsm_cycles_per_ns %.17g\nmem_bytes_per_us %.17g\n"
           "latency_p95_ns %.17g\ntick_ns %llu\nlaunches %u\n",
           kFormatLine, b.sm_count, (unsigned long long)b.sm_budget_ns, b.sm_work_per_step,
           (unsigned long long)b.mem_budget_ns, b.sm_steps_per_us, b.sm_distinct,
           b.sm_resident_fraction, b.sm_cycles_per_step, b.sm_cycles_per_ns, b.mem_bytes_per_us,
           b.latency_p95_ns, (unsigned long long)b.tick_ns, b.launches);
  return buf;
}

bool parseSoloBaseline(std::string_view text, SoloBaseline* out, std::string* err) {
  SoloBaseline b;
  struct Field {
    const char* key;
    double* real;
    uint64_t* u64;
    uint32_t* u32;
    double min, max;
    bool seen;
  };
  Field fields[] = {
      {"sm_count", nullptr, nullptr, &b.sm_count, 0, kMaxSmId, false},
      {"sm_budget_ns", nullptr, &b.sm_budget_ns, nullptr, 0, kMaxBudgetNs, false},
      {"sm_work_per_step", nullptr, nullptr, &b.sm_work_per_step, 0, 4294967295.0, false},
      {"mem_budget_ns", nullptr, &b.mem_budget_ns, nullptr, 0, kMaxBudgetNs, false},
      {"sm_steps_per_us", &b.sm_steps_per_us, nullptr, nullptr, 0, 1e15, false},
      {"sm_distinct", nullptr, nullptr, &b.sm_distinct, 0, kMaxSmId, false},
      {"sm_resident_fraction", &b.sm_resident_fraction, nullptr, nullptr, 0, 1.0, false},
      {"sm_cycles_per_step", &b.sm_cycles_per_step, nullptr, nullptr, 0, 1e12, false},
      {"sm_cycles_per_ns", &b.sm_cycles_per_ns, nullptr, nullptr, 0, kMaxCyclesPerNs, false},
      {"mem_bytes_per_us", &b.mem_bytes_per_us, nullptr, nullptr, 0, kMaxBytesPerNs * 1000, false},
      {"latency_p95_ns", &b.latency_p95_ns, nullptr, nullptr, -1, 1e12, false},
      {"tick_ns", nullptr, &b.tick_ns, nullptr, 0, kMaxBudgetNs, false},
      {"launches", nullptr, nullptr, &b.launches, 0, 4294967295.0, false},
  };
  size_t line_no = 0;
  bool format_seen = false;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    const std::string where = "probe baseline line " + std::to_string(line_no) + ": ";
    if (line.empty() || line[0] == '#') continue;
    if (!format_seen) {
      if (line != kFormatLine) return fail(err, where + "expected \"" + kFormatLine + "\" first");
      format_seen = true;
      continue;
    }
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos) return fail(err, where + "expected \"key value\"");
    const std::string_view key = line.substr(0, sp);
    const std::string value(line.substr(sp + 1));
    Field* f = nullptr;
    for (Field& c : fields)
      if (key == c.key) f = &c;
    if (!f) return fail(err, where + "unknown key \"" + std::string(key) + "\"");
    if (f->seen) return fail(err, where + "\"" + std::string(key) + "\" given twice");
    f->seen = true;
    char* end = nullptr;
    errno = 0;
    double v;
    if (f->real) {
      v = strtod(value.c_str(), &end);
    } else {
      if (value.empty() || value[0] == '-' || value[0] == '+')
        return fail(err, where + std::string(key) + ": \"" + value + "\" is not a count");
      v = double(strtoull(value.c_str(), &end, 10));
    }
    if (value.empty() || end != value.c_str() + value.size() || errno != 0 || !std::isfinite(v))
      return fail(err, where + std::string(key) + ": \"" + value + "\" is not a number");
    if (v < f->min || v > f->max)
      return fail(err, where + std::string(key) + ": " + value + " is out of range");
    if (f->real) *f->real = v;
    if (f->u64) *f->u64 = uint64_t(strtoull(value.c_str(), nullptr, 10));
    if (f->u32) *f->u32 = uint32_t(v);
  }
  if (!format_seen) return fail(err, "probe baseline: empty (no \"format 1\" line)");
  for (const Field& f : fields)
    if (!f.seen) return fail(err, std::string("probe baseline: \"") + f.key + "\" missing");
  if (b.latency_p95_ns < 0 && b.latency_p95_ns != -1)
    return fail(err, "probe baseline: latency_p95_ns is negative (only -1 means unknown)");
  if (b.hasSm() && (b.sm_count == 0 || b.sm_work_per_step == 0 || b.sm_distinct == 0 ||
                    b.sm_distinct > b.sm_count))
    return fail(err,
                "probe baseline: SM numbers without a consistent SM count, work_per_step "
                "and distinct SMs");
  *out = b;
  return true;
}

}  // namespace cushare::probe
