// Window estimates from probe rounds (common/include/cushare/probe_window.h): each round gives
// each tenant with work at most one share sample, by the rule of its regime; the window is the
// mean of the samples with its standard error.
#include "cushare/probe_window.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

namespace cushare::probe {
namespace {

Estimate estimate(const std::vector<double>& v, uint32_t min_rounds) {
  Estimate e;
  e.rounds = uint32_t(v.size());
  if (v.empty()) return e;
  e.known = true;
  e.enough = e.rounds >= min_rounds;
  double sum = 0;
  for (double x : v) sum += x;
  e.value = sum / double(v.size());
  if (v.size() > 1) {
    double ss = 0;
    for (double x : v) ss += (x - e.value) * (x - e.value);
    e.stderr_ = std::sqrt(ss / double(v.size() - 1) / double(v.size()));
  }
  return e;
}

bool exclusive(Regime r) { return r == Regime::kTimeSliced || r == Regime::kTurns; }

}  // namespace

uint64_t instantInRecordsClock(uint64_t at_realtime, uint64_t first_start, uint64_t launch_realtime,
                               uint64_t launch_monotonic, uint64_t match_ns) {
  const auto near = [&](uint64_t a, uint64_t b) { return (a > b ? a - b : b - a) < match_ns; };
  if (first_start == 0) return 0;
  if (near(first_start, launch_realtime)) return at_realtime;
  if (near(first_start, launch_monotonic) && launch_realtime >= launch_monotonic &&
      at_realtime > launch_realtime - launch_monotonic)
    return at_realtime - (launch_realtime - launch_monotonic);
  return 0;
}

const char* regimeName(Regime r) {
  switch (r) {
    case Regime::kTimeSliced:
      return "time-sliced";
    case Regime::kTurns:
      return "turns";
    case Regime::kConcurrent:
      return "concurrent";
  }
  return "?";
}

ShareAggregator::ShareAggregator(SoloBaseline baseline, AggregatorOptions options)
    : baseline_(baseline), options_(options) {}

double ShareAggregator::startThreshold() const {
  if (!baseline_.hasLatency()) return options_.default_start_threshold_ns;
  return baseline_.latency_p95_ns +
         std::max(options_.start_epsilon_ns,
                  options_.start_epsilon_fraction * baseline_.latency_p95_ns);
}

std::vector<std::string> ShareAggregator::addRound(const Round& round) {
  std::vector<std::string> lines;
  if (round.start_ns == 0) {
    lines.push_back("probe round without an instant (start_ns 0): not counted");
    return lines;
  }
  double fastest = std::numeric_limits<double>::infinity();
  // Whether some context's first launch went without waiting at its tenant's closed gate. Only
  // then is the round's fastest start (over every launch, so that a tenant holding the device
  // alone among waiters cannot claim a slow start as the round's: the others' waits bound it) a
  // solo-like start: in a round in which every gate was closed (caps leaving the device idle) it
  // is the wait for the next period, and such rounds made the threshold grow until every wait
  // read as a start.
  bool ungatedStart = false;
  std::set<std::string> seen;
  // Exclusive regimes: one tenant holds the device at a time, and each tenant's sample is whether
  // its probe started without waiting once launched: a sample of who held the device at that
  // moment, on its own. (Rounds in which nobody started used to be dropped as missing, for host
  // delays; with late launches judged from their arrival that only biased the shares: it dropped
  // the zeros of a late tenant whose instant fell in its own slice, not its ones.)
  for (const TenantRound& t : round.tenants) {
    if (!seen.insert(t.tenant).second) {
      lines.push_back("tenant " + t.tenant +
                      ": listed twice in one probe round; the second ignored");
      continue;
    }
    Acc& a = acc_[t.tenant];
    // Exclusive and concurrent samples are different statistics (a 0/1 start, an SM fraction):
    // when the tenant's regime changes between them (the broker learnt its processes are MPS
    // clients, or found one outside MPS) its window starts anew. Mixed, the first rounds of an
    // MPS client, taken before the broker had the server's client list, read as exclusive starts
    // of 1 and raised its share. Turns and time slices give the same statistic: a switch between
    // them (fair share starting and stopping as another tenant's work comes and goes) keeps it.
    if (a.rounds > 0 && exclusive(a.regime) != exclusive(t.regime)) a = Acc{};
    ++a.rounds;
    a.regime = t.regime;
    if (t.has_work) ++a.with_work;
    auto bad = [&](const std::string& why) {
      ++a.bad;
      a.last_error = why;
      lines.push_back("tenant " + t.tenant + ": " + why);
    };
    if (!t.error.empty()) {
      bad(t.error);
      continue;
    }
    // The earliest start of any context's first launch (the latency index), and of those that did
    // not wait at the tenant's closed gate (a start; with one, the round gives a fastest start).
    double latency = std::numeric_limits<double>::infinity();
    double ungated = std::numeric_limits<double>::infinity();
    // Per context: its SM factors and memory ratio, or why there is none.
    bool sm_missing = false, mem_missing = false;
    uint32_t sm_contexts = 0, mem_contexts = 0;
    double share_sum = 0, spatial = 0, temporal = 0, intra = 0, bw_sum = 0;
    for (const ContextProbes& c : t.contexts) {
      for (const ProbeLaunch& l : c.launches) {
        LaunchContext ctx = l.ctx;
        if (ctx.round_start_ns == 0) ctx.round_start_ns = round.start_ns;
        LaunchNumbers n;
        std::string err;
        const LaunchOutcome o = analyzeLaunch(l.records, ctx, &n, &err);
        if (o == LaunchOutcome::kBad) {
          bad(err);
          continue;
        }
        // The start latency is the context's first launch's, the one made at the instant: a later
        // launch of the round went after the first had waited (for the tenant's gate or its slice)
        // and run, so its latency from its own launch says nothing about the instant (a tenant
        // sliced out at the instant read as started by its second probe).
        if (n.has_latency && &l == &c.launches.front()) {
          latency = std::min(latency, n.start_latency_ns);
          if (!c.waited_at_gate) ungated = std::min(ungated, n.start_latency_ns);
        }
        if (o == LaunchOutcome::kMissing) {
          if (n.kind == kProbeSm) sm_missing = true;
          if (n.kind == kProbeMem) mem_missing = true;
          continue;
        }
        if ((n.kind == kProbeSm && !baseline_.hasSm()) ||
            (n.kind == kProbeMem && !baseline_.hasMem())) {
          ++a.uncompared;  // not calibrated yet: not the records' fault, no log line
          continue;
        }
        if (n.kind == kProbeSm) {
          SmFactors f;
          if (!smFactors(n, baseline_, &f, &err)) {
            bad(err);
            continue;
          }
          a.clock.push_back(f.clock);
          ++sm_contexts;
          share_sum += f.share();
          spatial += f.spatial;
          temporal += f.temporal;
          intra += f.intra;
        } else if (n.kind == kProbeMem) {
          double ratio;
          if (!bandwidthRatio(n, baseline_, &ratio, &err)) {
            bad(err);
            continue;
          }
          ++mem_contexts;
          bw_sum += ratio;
        }
      }
    }
    if (std::isfinite(latency)) {
      a.latency.push_back(latency);
      fastest = std::min(fastest, latency);
    }
    ungatedStart = ungatedStart || std::isfinite(ungated);
    if (!t.has_work) continue;  // no share sample: an idle tenant leaves the device to others
    if (exclusive(t.regime)) {
      if (!std::isfinite(latency)) continue;  // no launch told when it started
      // Started without waiting once launched: a launch the host made late (a probe thread kept
      // off the CPU) still samples whether the tenant held the device when it came. In turns the
      // holder's probe may wait behind its own running blocks (a self-inflicted wait up to one
      // of its blocks) while the waits that mark another's turn last most of a turn (10 ms and
      // more): the threshold there is at least turns_min_start_threshold_ns.
      const double threshold = t.regime == Regime::kTurns
                                   ? std::max(startThreshold(), options_.turns_min_start_threshold_ns)
                                   : startThreshold();
      const bool started = ungated <= threshold;
      ++a.started_of;
      a.started += started;
      a.share.push_back(started ? 1.0 : 0.0);
      if (mem_contexts && !mem_missing)
        a.bandwidth.push_back(started ? std::min(bw_sum / mem_contexts, 1.0) : 0.0);
      else if (mem_missing)
        ++a.missing;
    } else {
      if (sm_missing || mem_missing) ++a.missing;
      if (sm_contexts && !sm_missing) {
        a.share.push_back(std::min(share_sum, 1.0));
        a.spatial += spatial;
        a.temporal += temporal / sm_contexts;
        a.intra += intra / sm_contexts;
        ++a.concurrent;
      }
      if (mem_contexts && !mem_missing) a.bandwidth.push_back(std::min(bw_sum, 1.0));
    }
  }
  if (ungatedStart && std::isfinite(fastest)) fastest_.push_back(fastest);
  return lines;
}

std::vector<TenantWindow> ShareAggregator::window() const {
  std::vector<TenantWindow> out;
  for (const auto& [name, a] : acc_) {
    TenantWindow w;
    w.tenant = name;
    w.regime = a.regime;
    w.rounds = a.rounds;
    w.rounds_with_work = a.with_work;
    w.missing = a.missing;
    w.bad = a.bad;
    w.uncompared = a.uncompared;
    w.last_error = a.last_error;
    w.compute_share = estimate(a.share, options_.min_rounds);
    w.bandwidth_share = estimate(a.bandwidth, options_.min_rounds);
    if (a.concurrent) {
      w.spatial = a.spatial / a.concurrent;
      w.temporal = a.temporal / a.concurrent;
      w.intra = a.intra / a.concurrent;
    }
    if (!a.clock.empty()) {
      double sum = 0;
      for (double c : a.clock) sum += c;
      w.clock = sum / double(a.clock.size());
    }
    if (a.started_of) w.started_fraction = double(a.started) / double(a.started_of);
    if (w.compute_share.known) {
      const double clock = w.clock > 0 ? std::min(w.clock, 1.0) : 1.0;
      w.compute_index = std::clamp(1.0 - w.compute_share.value * clock, 0.0, 1.0);
    }
    if (w.bandwidth_share.known)
      w.bandwidth_index = std::clamp(1.0 - w.bandwidth_share.value, 0.0, 1.0);
    if (!a.latency.empty()) {
      w.latency_p95_ns = nearestRankPercentile(a.latency, 0.95);
      if (baseline_.hasLatency()) w.latency_index_ns = *w.latency_p95_ns - baseline_.latency_p95_ns;
    }
    out.push_back(std::move(w));
  }
  return out;
}

void ShareAggregator::reset() {
  acc_.clear();
  fastest_.clear();
}

}  // namespace cushare::probe
