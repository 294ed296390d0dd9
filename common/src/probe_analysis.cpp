// One probe launch's records to numbers (common/include/cushare/probe_analysis.h,
// docs/probe-analysis.md). Every record is checked before any number is formed: a launch either
// yields numbers, is a missing sample (no block ran), or is bad with the first reason found.
#include "cushare/probe_analysis.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace cushare::probe {
namespace {

constexpr uint32_t kKnownFlags = kProbeRan | kProbeLate | kProbeBadArgs | kProbeMigrated;

const char* kindName(uint32_t kind) {
  switch (kind) {
    case kProbeSm:
      return "SM probe";
    case kProbeMem:
      return "memory probe";
    case kProbeTick:
      return "tick probe";
    default:
      return "probe";
  }
}

bool fail(std::string* err, std::string msg) {
  if (err) *err = std::move(msg);
  return false;
}

uint64_t le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint32_t le32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

bool checkContext(const LaunchContext& ctx, size_t records, std::string* err) {
  const std::string what = kindName(ctx.kind);
  if (ctx.kind != kProbeSm && ctx.kind != kProbeMem && ctx.kind != kProbeTick)
    return fail(err, "probe launch: unknown kind " + std::to_string(uint32_t(ctx.kind)));
  if (ctx.budget_ns == 0 || ctx.budget_ns > kMaxBudgetNs)
    return fail(err,
                what + ": budget " + std::to_string(ctx.budget_ns) + " ns is outside 1 ns..100 ms");
  if (ctx.grid_blocks == 0 || ctx.grid_blocks > kMaxRecords)
    return fail(err, what + ": grid of " + std::to_string(ctx.grid_blocks) + " blocks");
  if (records != ctx.grid_blocks)
    return fail(err, what + ": " + std::to_string(records) + " records for a grid of " +
                         std::to_string(ctx.grid_blocks) + " blocks (one record per block)");
  if (ctx.kind == kProbeSm) {
    if (ctx.sm_count == 0 || ctx.sm_count > kMaxSmId)
      return fail(err, what + ": device SM count " + std::to_string(ctx.sm_count));
    if (ctx.work_per_step == 0) return fail(err, what + ": work_per_step is 0");
  }
  return true;
}

// Checks one record on its own; "block i: ..." on failure.
bool checkRecord(const BlockRecord& r, size_t i, const LaunchContext& ctx, std::string* err) {
  const std::string where = std::string(kindName(ctx.kind)) + " block " + std::to_string(i) + ": ";
  if (r.flags & kProbeBadArgs)
    return fail(err, where +
                         "the kernel rejected its arguments (kProbeBadArgs: ABI version, kind "
                         "or sizes); nothing was measured");
  if (r.flags & ~kKnownFlags)
    return fail(
        err, where + "unknown flag bits 0x" + [&] {
          char b[16];
          snprintf(b, sizeof b, "%x", r.flags & ~kKnownFlags);
          return std::string(b);
        }());
  const bool ran = r.flags & kProbeRan, late = r.flags & kProbeLate;
  if (ran && late) return fail(err, where + "flagged both ran and late");
  if (!ran && !late) return fail(err, where + "wrote no record (neither ran nor late)");
  if (r.start_ns == 0) return fail(err, where + "start time 0 (not written)");
  if (r.start_ns >= kMaxTimerNs || r.end_ns >= kMaxTimerNs)
    return fail(err, where + "timer value " + std::to_string(std::max(r.start_ns, r.end_ns)) +
                         " ns is absurd (over 146 years)");
  if (r.end_ns < r.start_ns)
    return fail(err, where + "ends (" + std::to_string(r.end_ns) + " ns) before it starts (" +
                         std::to_string(r.start_ns) + " ns)");
  if (r.sm_start >= kMaxSmId || r.sm_end >= kMaxSmId)
    return fail(err,
                where + "SM id " + std::to_string(std::max(r.sm_start, r.sm_end)) + " is absurd");
  if (bool(r.flags & kProbeMigrated) != (r.sm_start != r.sm_end))
    return fail(err, where + "migrated flag disagrees with its SM ids " +
                         std::to_string(r.sm_start) + " -> " + std::to_string(r.sm_end));
  if (late) {
    if (r.work != 0) return fail(err, where + "late but reports work done");
    return true;
  }
  const uint64_t wall = r.end_ns - r.start_ns;
  if (r.gap_ns > wall || r.max_gap_ns > wall)
    return fail(err, where + "gaps (" + std::to_string(std::max(r.gap_ns, r.max_gap_ns)) +
                         " ns) longer than the block ran (" + std::to_string(wall) + " ns)");
  if (ctx.kind == kProbeSm) {
    if (r.work > 0 && r.cycles / r.work < ctx.work_per_step)
      return fail(err, where + std::to_string(r.work) + " steps of " +
                           std::to_string(ctx.work_per_step) + " dependent FMAs in " +
                           std::to_string(r.cycles) + " cycles (under one cycle each)");
    const uint64_t resident = wall - r.gap_ns;
    if (resident >= 1000 && double(r.cycles) / double(resident) > kMaxCyclesPerNs)
      return fail(err, where + std::to_string(r.cycles) + " cycles in " + std::to_string(resident) +
                           " ns (over 10 GHz)");
  }
  if (ctx.kind == kProbeTick && r.tick_ns > ctx.budget_ns)
    return fail(err,
                where + "timer tick " + std::to_string(r.tick_ns) + " ns longer than the budget");
  return true;
}

struct Interval {
  uint64_t start, end;
  size_t index;
};

// SM probe: per SM, the union of its blocks' intervals, the stacking depth and the SM's cycles
// (stacked blocks each count the same SM cycles, so their sum is divided by the mean depth).
bool smNumbers(std::span<const BlockRecord> records, const LaunchContext& ctx, LaunchNumbers* n,
               std::string* err) {
  std::map<uint32_t, std::vector<Interval>> by_sm;
  for (size_t i = 0; i < records.size(); ++i) {
    const BlockRecord& r = records[i];
    if (r.flags & kProbeRan) by_sm[r.sm_start].push_back({r.start_ns, r.end_ns, i});
  }
  if (by_sm.size() > ctx.sm_count)
    return fail(err, "SM probe: " + std::to_string(by_sm.size()) + " distinct SMs on a device of " +
                         std::to_string(ctx.sm_count));
  double resident = 0, cycles = 0, steps = 0, covered = 0, walls = 0;
  uint32_t max_stack = 0;
  for (auto& [sm, blocks] : by_sm) {
    std::sort(blocks.begin(), blocks.end(),
              [](const Interval& a, const Interval& b) { return a.start < b.start; });
    // Union length, and the deepest overlap by a sweep over entries and exits.
    uint64_t union_ns = 0, cur_start = blocks[0].start, cur_end = blocks[0].end;
    std::vector<std::pair<uint64_t, int>> events;
    double sm_wall = 0, sm_resident = 0, sm_cycles = 0;
    for (const Interval& b : blocks) {
      if (b.start > cur_end) {
        union_ns += cur_end - cur_start;
        cur_start = b.start;
        cur_end = b.end;
      } else {
        cur_end = std::max(cur_end, b.end);
      }
      events.push_back({b.start, +1});
      events.push_back({b.end, -1});
      const BlockRecord& r = records[b.index];
      sm_wall += double(r.end_ns - r.start_ns);
      sm_resident += double(r.end_ns - r.start_ns - r.gap_ns);
      sm_cycles += double(r.cycles);
      steps += double(r.work);
    }
    union_ns += cur_end - cur_start;
    std::sort(events.begin(), events.end());  // exits (-1) before entries (+1) at one instant
    int depth = 0;
    for (const auto& e : events) {
      depth += e.second;
      max_stack = std::max<uint32_t>(max_stack, uint32_t(std::max(depth, 0)));
    }
    const double stack = union_ns > 0 ? sm_wall / double(union_ns) : 1.0;
    covered += double(union_ns);
    walls += sm_wall;
    resident += sm_resident / std::max(stack, 1.0);
    cycles += sm_cycles / std::max(stack, 1.0);
  }
  n->distinct_sms = uint32_t(by_sm.size());
  n->max_stack = std::max<uint32_t>(max_stack, 1);
  n->mean_stack = covered > 0 ? walls / covered : 1.0;
  n->resident_fraction = resident / (double(n->distinct_sms) * n->window_ns);
  if (steps <= 0) return fail(err, "SM probe: blocks ran but none made a progress step");
  if (resident <= 0) return fail(err, "SM probe: blocks ran but were never resident");
  n->steps_per_us = steps / n->window_ns * 1000.0;
  n->cycles_per_step = cycles / steps;
  n->cycles_per_ns = cycles / resident;
  return true;
}

}  // namespace

bool decodeRecords(std::span<const uint8_t> bytes, uint32_t expected_count,
                   std::vector<BlockRecord>* out, std::string* err) {
  if (expected_count == 0 || expected_count > kMaxRecords)
    return fail(err, "probe records: expected count " + std::to_string(expected_count));
  if (bytes.size() != size_t(expected_count) * sizeof(BlockRecord))
    return fail(err, "probe records: " + std::to_string(bytes.size()) + " bytes for " +
                         std::to_string(expected_count) + " records of " +
                         std::to_string(sizeof(BlockRecord)) + " bytes");
  out->assign(expected_count, BlockRecord{});
  for (uint32_t i = 0; i < expected_count; ++i) {
    const uint8_t* p = bytes.data() + size_t(i) * sizeof(BlockRecord);
    BlockRecord& r = (*out)[i];
    r.start_ns = le64(p + offsetof(BlockRecord, start_ns));
    r.end_ns = le64(p + offsetof(BlockRecord, end_ns));
    r.sm_start = le32(p + offsetof(BlockRecord, sm_start));
    r.sm_end = le32(p + offsetof(BlockRecord, sm_end));
    r.flags = le32(p + offsetof(BlockRecord, flags));
    r.reserved0 = le32(p + offsetof(BlockRecord, reserved0));
    r.cycles = le64(p + offsetof(BlockRecord, cycles));
    r.work = le64(p + offsetof(BlockRecord, work));
    r.max_gap_ns = le64(p + offsetof(BlockRecord, max_gap_ns));
    r.gap_ns = le64(p + offsetof(BlockRecord, gap_ns));
    r.tick_ns = le64(p + offsetof(BlockRecord, tick_ns));
  }
  return true;
}

LaunchOutcome analyzeLaunch(std::span<const BlockRecord> records, const LaunchContext& ctx,
                            LaunchNumbers* out, std::string* err) {
  if (!checkContext(ctx, records.size(), err)) return LaunchOutcome::kBad;
  LaunchNumbers n;
  n.kind = ctx.kind;
  n.budget_ns = ctx.budget_ns;
  n.work_per_step = ctx.work_per_step;
  n.sm_count = ctx.sm_count;
  n.blocks = uint32_t(records.size());
  uint64_t first = UINT64_MAX, first_ran = UINT64_MAX, last_end = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const BlockRecord& r = records[i];
    if (!checkRecord(r, i, ctx, err)) return LaunchOutcome::kBad;
    first = std::min(first, r.start_ns);
    if (r.flags & kProbeMigrated) ++n.migrated;
    if (r.flags & kProbeLate) {
      ++n.late;
      continue;
    }
    ++n.ran;
    first_ran = std::min(first_ran, r.start_ns);
    last_end = std::max(last_end, r.end_ns);
    n.gap_ns += r.gap_ns;
    n.max_gap_ns = std::max(n.max_gap_ns, r.max_gap_ns);
    if (r.tick_ns && (n.tick_ns == 0 || r.tick_ns < n.tick_ns)) n.tick_ns = r.tick_ns;
    if (ctx.kind == kProbeTick) n.samples += r.work;
  }
  n.first_start_ns = first;
  if (ctx.round_start_ns) {
    if (first + kMaxClockSkewNs < ctx.round_start_ns) {
      fail(err, std::string(kindName(ctx.kind)) + ": started " +
                    std::to_string(ctx.round_start_ns - first) +
                    " ns before its round's instant (wrong round start or clock relation)");
      return LaunchOutcome::kBad;
    }
    n.has_latency = true;
    const uint64_t arrived = std::max(ctx.round_start_ns, ctx.launch_ns);
    n.start_latency_ns = first >= arrived ? double(first - arrived) : 0.0;
  }
  if (n.ran == 0) {
    *out = n;
    return LaunchOutcome::kMissing;
  }
  for (size_t i = 0; i < records.size(); ++i) {
    const BlockRecord& r = records[i];
    if ((r.flags & kProbeRan) && r.end_ns > first + ctx.budget_ns + kMaxOverrunNs) {
      fail(err, std::string(kindName(ctx.kind)) + " block " + std::to_string(i) + ": ends " +
                    std::to_string(r.end_ns - first) + " ns after the probe's first start, " +
                    "far past its budget of " + std::to_string(ctx.budget_ns) + " ns");
      return LaunchOutcome::kBad;
    }
  }
  n.window_ns = double(last_end - first_ran);
  if (n.window_ns <= 0) {
    fail(err, std::string(kindName(ctx.kind)) + ": the blocks that ran span no time");
    return LaunchOutcome::kBad;
  }
  if (ctx.kind == kProbeSm) {
    if (!smNumbers(records, ctx, &n, err)) return LaunchOutcome::kBad;
  } else if (ctx.kind == kProbeMem) {
    double bytes = 0;
    for (const BlockRecord& r : records)
      if (r.flags & kProbeRan) bytes += double(r.work);
    if (bytes / n.window_ns > kMaxBytesPerNs) {
      fail(err, "memory probe: " + std::to_string(bytes / n.window_ns) +
                    " bytes per ns (over 100 TB/s)");
      return LaunchOutcome::kBad;
    }
    n.bytes_per_us = bytes / n.window_ns * 1000.0;
  }
  *out = n;
  return LaunchOutcome::kNumbers;
}

double SmFactors::share() const {
  return std::clamp(spatial * std::min(temporal, 1.0) * std::min(intra, 1.0), 0.0, 1.0);
}

bool smFactors(const LaunchNumbers& n, const SoloBaseline& b, SmFactors* out, std::string* err) {
  if (n.kind != kProbeSm) return fail(err, "SM factors of a launch that is not an SM probe");
  if (!b.hasSm()) return fail(err, "SM factors: the solo baseline has no SM probe numbers");
  // The factors are per SM, so launches on different SM counts compare (an MPS client's count is
  // scaled back from its percentage, within the server's rounding: 132 and 133 on one device).
  if (n.work_per_step != b.sm_work_per_step)
    return fail(err, "SM factors: the launch's work_per_step " + std::to_string(n.work_per_step) +
                         " and the solo baseline's " + std::to_string(b.sm_work_per_step) + " differ");
  if (n.ran == 0 || n.steps_per_us <= 0)
    return fail(err, "SM factors of a missing sample (no block ran)");
  out->spatial = double(n.distinct_sms) / double(n.sm_count);
  out->temporal = b.sm_resident_fraction > 0 ? n.resident_fraction / b.sm_resident_fraction : 1.0;
  out->intra = b.sm_cycles_per_step / n.cycles_per_step;
  out->clock = b.sm_cycles_per_ns > 0 ? n.cycles_per_ns / b.sm_cycles_per_ns : 1.0;
  out->rate = (n.steps_per_us / double(n.sm_count)) / (b.sm_steps_per_us / double(b.sm_count));
  return true;
}

bool bandwidthRatio(const LaunchNumbers& n, const SoloBaseline& b, double* out, std::string* err) {
  if (n.kind != kProbeMem) return fail(err, "bandwidth of a launch that is not a memory probe");
  if (!b.hasMem()) return fail(err, "bandwidth: the solo baseline has no memory probe numbers");
  if (n.ran == 0) return fail(err, "bandwidth of a missing sample (no block ran)");
  *out = n.bytes_per_us / b.mem_bytes_per_us;
  return true;
}

}  // namespace cushare::probe
