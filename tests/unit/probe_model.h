// A small explicit model of how tenants share a device, which writes the probe records
// (probe_abi.h) a device would write under it, for the analysis tests (probe_analysis_test.cpp,
// probe_window_test.cpp). Not simgpu: no engine, just the few rules each regime needs.
//
// Device: `sms` SMs at a fixed clock; a probe block alone on an SM does a step in
// `cycles_per_step` cycles; the %globaltimer reads are quantised to `tick_ns`; a launch reaches
// the device `launch_latency_ns` (+ jitter) after the round's instant; blocks start `stagger_ns`
// apart at most.
//
// Exclusive regimes (hardware time slicing between contexts; cushare's turns): a periodic
// schedule of segments, each owned by one context (or by nobody: switch cost, drain). A context's
// probe starts at its launch if the context holds the device then, else at the start of its next
// segment; its blocks run while the context holds the device and stop at t0 + budget (a block
// switched out past its deadline ends when it is switched back in, with a gap). Cycles count only
// while resident.
//
// MPS: every client always resident; a client with cap p gets ceil(p x sms) SMs rounded up to a
// TPC (2 SMs), placed one after the other (wrapping: caps above 100 % in total share SMs). On an
// SM, throughput is split equally among the clients present (every tenant saturates its SMs);
// within a client, the probe's blocks stacked on an SM split that client's part equally. Probe
// blocks beyond `slots` per SM wait for a slot, which frees only at the deadline: they are late.
// Assumption (docs/probe-analysis.md, limits): the probe's blocks are not diluted by the client's
// own blocks on the same SM (the probe takes the next free slots, as from a high-priority stream).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cushare/probe_abi.h"
#include "cushare/probe_analysis.h"
#include "cushare/probe_window.h"

namespace cushare::probe::model {

struct Device {
  uint32_t sms = 132;
  double cycles_per_ns = 1.98;
  double cycles_per_step = 512;  // alone on an SM, work_per_step 128
  uint32_t work_per_step = 128;
  uint64_t tick_ns = 1000;
  double launch_latency_ns = 8000;
  double latency_jitter_ns = 4000;
  double stagger_ns = 2000;
  uint64_t sm_budget_ns = 200'000;
  uint64_t mem_budget_ns = 150'000;
  uint64_t tick_budget_ns = 50'000;
  double mem_bytes_per_ns = 4000;  // solo bandwidth of the memory probe
  uint32_t slots = 3;              // probe blocks one SM holds at once
};

inline uint64_t quantise(const Device& d, double t) { return uint64_t(t) / d.tick_ns * d.tick_ns; }

// --- exclusive schedules ---------------------------------------------------------------------

struct Segment {
  int owner;  // context index; -1: nobody (switch, drain)
  double length_ns;
};

class Schedule {
 public:
  explicit Schedule(std::vector<Segment> segments) : segments_(std::move(segments)) {
    for (const Segment& s : segments_) cycle_ += s.length_ns;
  }
  double cycle() const { return cycle_; }
  // Fraction of the time context c holds the device: the known share.
  double share(int c) const {
    double t = 0;
    for (const Segment& s : segments_)
      if (s.owner == c) t += s.length_ns;
    return t / cycle_;
  }
  bool holds(int c, double t) const { return ownerAt(t) == c; }
  // The earliest instant >= t at which c holds the device.
  double nextHeld(int c, double t) const {
    if (holds(c, t)) return t;
    double base = std::floor(t / cycle_) * cycle_;
    for (int k = 0; k < 3; ++k, base += cycle_) {
      double at = base;
      for (const Segment& s : segments_) {
        if (s.owner == c && at >= t) return at;
        at += s.length_ns;
      }
    }
    return t + 1e18;  // c never holds the device
  }
  // The next instant > t at which the owner changes.
  double nextSwitch(double t) const {
    double at = std::floor(t / cycle_) * cycle_;
    for (int k = 0; k < 3; ++k)
      for (const Segment& s : segments_) {
        at += s.length_ns;
        if (at > t) return at;
      }
    return t + cycle_;
  }

 private:
  int ownerAt(double t) const {
    double phase = std::fmod(t, cycle_), at = 0;
    for (const Segment& s : segments_) {
      if (phase < at + s.length_ns) return s.owner;
      at += s.length_ns;
    }
    return segments_.back().owner;
  }
  std::vector<Segment> segments_;
  double cycle_ = 0;
};

struct BlockRun {
  double start, end, resident, max_gap;
};

// A block that enters at `start` in context c, stops at `deadline`: runs while c holds the device.
inline BlockRun runExclusive(const Schedule& s, int c, double start, double deadline) {
  BlockRun r{start, start, 0, 0};
  double t = start;
  while (t < deadline) {
    const double until = std::min(s.nextSwitch(t), deadline);
    r.resident += until - t;
    if (until >= deadline) {
      t = deadline;
      break;
    }
    const double back = s.nextHeld(c, until);
    r.max_gap = std::max(r.max_gap, back - until);
    t = back;
  }
  r.end = std::max(t, deadline);
  return r;
}

// --- record writers ------------------------------------------------------------------------

inline BlockRecord ranRecord(const Device& d, double start, double end, double resident,
                             double max_gap, uint32_t sm) {
  BlockRecord r{};
  r.start_ns = quantise(d, start);
  r.end_ns = std::max(quantise(d, end), r.start_ns);
  r.sm_start = r.sm_end = sm;
  r.flags = kProbeRan;
  r.cycles = uint64_t(resident * d.cycles_per_ns);
  const double gap = (end - start) - resident;
  r.gap_ns =
      gap >= double(kGapThresholdNs) ? std::min<uint64_t>(uint64_t(gap), r.end_ns - r.start_ns) : 0;
  r.max_gap_ns = std::min<uint64_t>(uint64_t(max_gap), r.end_ns - r.start_ns);
  return r;
}

inline BlockRecord lateRecord(const Device& d, double at, uint32_t sm) {
  BlockRecord r{};
  r.start_ns = r.end_ns = quantise(d, at);
  r.sm_start = r.sm_end = sm;
  r.flags = kProbeLate;
  return r;
}

inline LaunchContext context(const Device& d, ProbeKind kind, uint32_t grid) {
  LaunchContext c;
  c.kind = kind;
  c.grid_blocks = grid;
  c.sm_count = d.sms;
  c.work_per_step = d.work_per_step;
  c.budget_ns = kind == kProbeSm    ? d.sm_budget_ns
                : kind == kProbeMem ? d.mem_budget_ns
                                    : d.tick_budget_ns;
  return c;
}

// The three probes of one context in one round of an exclusive regime (c: the context's index in
// the schedule). `round` is the round's instant.
// hostDelay: how late after the round's instant the host made the launch call (a probe thread
// kept off the CPU); the launch's stamp (launch_ns) says so.
inline ContextProbes exclusiveProbes(const Device& d, const Schedule& s, int c, double round,
                                     std::mt19937_64& rng, double hostDelay = 0) {
  std::uniform_real_distribution<double> u(0, 1);
  ContextProbes out;
  for (ProbeKind kind : {kProbeTick, kProbeSm, kProbeMem}) {
    const uint32_t grid = kind == kProbeTick ? 1 : kind == kProbeSm ? d.sms : 2 * d.sms;
    ProbeLaunch l{context(d, kind, grid), {}};
    l.ctx.launch_ns = uint64_t(round + hostDelay);
    const double arrive = round + hostDelay + d.launch_latency_ns + u(rng) * d.latency_jitter_ns;
    // A context without slices (a tenant with no work) gets the device when the current slice
    // ends, and its short probe then runs alone.
    const bool idle = s.share(c) == 0;
    const double t0 = idle ? s.nextSwitch(arrive) : s.nextHeld(c, arrive);
    const double deadline = t0 + double(l.ctx.budget_ns);
    for (uint32_t b = 0; b < grid; ++b) {
      if (idle) {
        const double start = t0 + (b ? u(rng) * d.stagger_ns : 0);
        BlockRecord r = ranRecord(d, start, deadline, deadline - start, 0, b % d.sms);
        r.work = kind == kProbeSm    ? uint64_t(double(r.cycles) / d.cycles_per_step)
                 : kind == kProbeMem ? uint64_t((deadline - start) * d.mem_bytes_per_ns / grid)
                                     : uint64_t((deadline - start) / 40.0);
        if (kind == kProbeTick) r.tick_ns = d.tick_ns;
        l.records.push_back(r);
        continue;
      }
      const double start = s.nextHeld(c, t0 + (b ? u(rng) * d.stagger_ns : 0));
      if (start >= deadline) {
        l.records.push_back(lateRecord(d, start, b % d.sms));
        continue;
      }
      const BlockRun run = runExclusive(s, c, start, deadline);
      BlockRecord r = ranRecord(d, run.start, run.end, run.resident, run.max_gap, b % d.sms);
      if (kind == kProbeSm) {
        r.work = uint64_t(double(r.cycles) / d.cycles_per_step);
      } else if (kind == kProbeMem) {
        r.work = uint64_t(run.resident * d.mem_bytes_per_ns / grid * (0.98 + 0.04 * u(rng)));
      } else {
        r.work = uint64_t(run.resident / 40.0);
        r.tick_ns = d.tick_ns;
      }
      l.records.push_back(r);
    }
    out.launches.push_back(std::move(l));
  }
  return out;
}

// --- MPS -----------------------------------------------------------------------------------

struct MpsLayout {
  std::vector<std::vector<uint32_t>> sms;  // per client, its SMs
  std::vector<uint32_t> clients_on;        // per SM, how many clients have it
  // What each client's work receives: sum over its SMs of 1 / clients there, over the SM count.
  double truth(size_t client, uint32_t total) const {
    double t = 0;
    for (uint32_t sm : sms[client]) t += 1.0 / clients_on[sm];
    return t / total;
  }
};

inline MpsLayout mpsLayout(const Device& d, const std::vector<double>& caps) {
  MpsLayout m;
  m.clients_on.assign(d.sms, 0);
  uint32_t next = 0;
  for (double cap : caps) {
    uint32_t k = uint32_t(std::ceil(cap * d.sms - 1e-9));
    k = std::min(d.sms, (k + 1) / 2 * 2);
    std::vector<uint32_t> set;
    for (uint32_t i = 0; i < k; ++i) set.push_back((next + i) % d.sms);
    for (uint32_t sm : set) ++m.clients_on[sm];
    next = (next + k) % d.sms;
    m.sms.push_back(set);
  }
  return m;
}

// A client's probes in one MPS round. all_late: every block of its SM probe found the deadline
// passed (a missing sample). bandwidth: the client's true share of the memory bandwidth.
inline ContextProbes mpsProbes(const Device& d, const MpsLayout& m, size_t client, double round,
                               double bandwidth, bool all_late, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0, 1);
  const std::vector<uint32_t>& mine = m.sms[client];
  // Virtual SM ids per client: a permutation, as MPS gives each client its own numbering.
  std::vector<uint32_t> virt(d.sms);
  for (uint32_t i = 0; i < d.sms; ++i) virt[i] = i;
  std::shuffle(virt.begin(), virt.end(), rng);
  ContextProbes out;
  for (ProbeKind kind : {kProbeTick, kProbeSm, kProbeMem}) {
    const uint32_t grid = kind == kProbeTick ? 1 : kind == kProbeSm ? d.sms : 2 * d.sms;
    ProbeLaunch l{context(d, kind, grid), {}};
    const double t0 = round + d.launch_latency_ns + u(rng) * d.latency_jitter_ns;
    const double deadline = t0 + double(l.ctx.budget_ns);
    const uint32_t running = std::min<uint32_t>(grid, d.slots * uint32_t(mine.size()));
    for (uint32_t b = 0; b < grid; ++b) {
      const uint32_t sm = mine[b % mine.size()];
      if ((kind == kProbeSm && all_late) || b >= running) {
        l.records.push_back(lateRecord(d, deadline + 1000 + u(rng) * 1000, virt[sm]));
        continue;
      }
      const double start = t0 + (b ? u(rng) * d.stagger_ns : 0);
      BlockRecord r = ranRecord(d, start, deadline, deadline - start, 0, virt[sm]);
      if (kind == kProbeSm) {
        // Probe blocks of this client stacked on this SM, and the SM split among its clients.
        const uint32_t stacked =
            running / uint32_t(mine.size()) + ((b % mine.size()) < running % mine.size() ? 1 : 0);
        const double part = 1.0 / m.clients_on[sm] / stacked;
        r.work = uint64_t(double(r.cycles) * part / d.cycles_per_step);
      } else if (kind == kProbeMem) {
        r.work = uint64_t((deadline - start) * d.mem_bytes_per_ns * bandwidth / running *
                          (0.98 + 0.04 * u(rng)));
      } else {
        r.work = uint64_t((deadline - start) / 40.0);
        r.tick_ns = d.tick_ns;
      }
      l.records.push_back(r);
    }
    out.launches.push_back(std::move(l));
  }
  return out;
}

// Solo calibration: the probes alone on the device (one context holding it all the time).
inline SoloBaseline calibrate(const Device& d, std::mt19937_64& rng, int launches = 20) {
  const Schedule alone({{0, 1e9}});
  BaselineCalibration cal;
  double round = 1e9;
  for (int i = 0; i < launches; ++i, round += 1e7) {
    double earliest = 1e18;
    for (const ProbeLaunch& l : exclusiveProbes(d, alone, 0, round, rng).launches) {
      LaunchContext ctx = l.ctx;
      ctx.round_start_ns = uint64_t(round);
      LaunchNumbers n;
      std::string err;
      if (analyzeLaunch(l.records, ctx, &n, &err) != LaunchOutcome::kNumbers) continue;
      cal.add(n);
      earliest = std::min(earliest, n.start_latency_ns);
    }
    cal.addRoundStart(earliest);
  }
  SoloBaseline b;
  std::string err;
  cal.build(d.sms, &b, &err);
  return b;
}

}  // namespace cushare::probe::model
