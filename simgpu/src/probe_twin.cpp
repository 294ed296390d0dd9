// The probe kernels' native twins (see probe_twin.h).
#include "probe_twin.h"

#include <algorithm>
#include <map>

namespace simgpu {
namespace {

using namespace cushare::probe;

constexpr uint64_t kMemBytesPerThreadStep = 32 * 4;  // probes.cu: kMemUnroll 16-byte elements, read + written

uint64_t quantise(uint64_t ns) { return ns - ns % kProbeTimerTickNs; }
uint64_t roundUpToTick(uint64_t ns) { return (ns + kProbeTimerTickNs - 1) / kProbeTimerTickNs * kProbeTimerTickNs; }

uint64_t splitmix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

void foldBlockEvents(const std::vector<BlockEvent>& events, uint64_t blocks, std::vector<BlockTrace>* out) {
  out->assign(blocks, BlockTrace{});
  std::vector<uint64_t> since(blocks, 0), savedAt(blocks, 0);  // resident since / saved at
  for (const BlockEvent& e : events) {
    for (uint64_t b = e.firstBlock; b < e.firstBlock + e.count && b < blocks; ++b) {
      BlockTrace& t = (*out)[b];
      switch (e.kind) {
        case BlockEvent::kStart:
          if (t.started == 0) {
            t.startNs = e.ns;
            t.smFirst = e.sm;
          } else {
            // The step a timer loop sees across the time it was out of the device.
            const uint64_t gap = quantise(e.ns) - quantise(savedAt[b]);
            if (gap > kGapThresholdNs) t.gapSumNs += gap;
            t.gapMaxNs = std::max(t.gapMaxNs, gap);
          }
          ++t.started;
          t.smLast = e.sm;
          since[b] = e.ns;
          break;
        case BlockEvent::kSave:
          t.residentNs += e.ns - since[b];
          savedAt[b] = e.ns;
          break;
        case BlockEvent::kEnd:
          t.residentNs += e.ns - since[b];
          t.endNs = e.ns;
          t.ended = 1;
          t.smLast = e.sm;
          break;
      }
    }
  }
}

bool probeArgsValid(const ProbeArgs& a, uint32_t kind, const unsigned grid[3], const unsigned block[3]) {
  if (a.abi_version != kProbeAbiVersion || a.kind != kind) return false;
  if (a.records == 0 || a.t0 == 0 || a.record_count < grid[0] || grid[1] != 1 || grid[2] != 1) return false;
  if (block[0] % 32 != 0 || block[1] != 1 || block[2] != 1) return false;
  if (kind == kProbeSm && a.work_per_step == 0) return false;
  if (kind == kProbeMem && (a.buffer == 0 || a.buffer_bytes < 16 || a.buffer_bytes % 16 != 0)) return false;
  return true;
}

void probeRecords(const ProbeArgs& a, uint32_t kind, uint32_t threads, const std::vector<BlockTrace>& traces,
                  const std::vector<uint32_t>& smIds, uint32_t deviceSms, std::vector<BlockRecord>* out, uint64_t* t0) {
  out->assign(traces.size(), BlockRecord{});
  uint64_t first = UINT64_MAX;
  for (const BlockTrace& t : traces)
    if (t.ended && t.started) first = std::min(first, t.startNs);
  *t0 = 0;
  if (first == UINT64_MAX) return;  // no block ran
  *t0 = quantise(first);
  const uint64_t deadline = a.budget_ns > UINT64_MAX - *t0 ? UINT64_MAX : *t0 + a.budget_ns;
  // Memory probe: each SM's share of the device's bandwidth, split among the probe's blocks that
  // started on it in time (late ones move nothing).
  std::map<uint32_t, uint32_t> onSm;
  for (const BlockTrace& t : traces)
    if (t.ended && t.started && quantise(t.startNs) < deadline) ++onSm[t.smFirst];
  const double smBytesPerNs = static_cast<double>(kProbeDeviceBytesPerUs) / 1000.0 / std::max(1u, deviceSms);
  const uint64_t memStep = kMemBytesPerThreadStep * std::max(1u, threads);
  auto smId = [&](uint32_t sm) { return sm < smIds.size() ? smIds[sm] : sm; };
  for (size_t i = 0; i < traces.size(); ++i) {
    const BlockTrace& t = traces[i];
    BlockRecord& r = (*out)[i];
    if (!t.ended || !t.started) continue;
    r.start_ns = quantise(t.startNs);
    r.end_ns = quantise(t.endNs);
    r.sm_start = smId(t.smFirst);
    r.sm_end = smId(t.smLast);
    const bool late = r.start_ns >= deadline;
    r.flags = (late ? kProbeLate : kProbeRan) | (r.sm_end != r.sm_start ? kProbeMigrated : 0u);
    r.cycles = t.residentNs * kProbeClockKHz / 1'000'000;
    if (late) continue;  // no work, no timer steps
    uint64_t step = kProbeTimerTickNs;  // the largest step between two timer reads while resident
    if (kind == kProbeSm) {
      const uint64_t wps = std::max<uint32_t>(1, a.work_per_step);
      r.work = std::max<uint64_t>(1, t.residentNs * kProbeFmaPerUs / 1000 / wps);
      step = roundUpToTick(wps * 1000 / kProbeFmaPerUs);
    } else if (kind == kProbeMem) {
      const double memBytesPerNs = smBytesPerNs / std::max(1u, onSm[t.smFirst]);
      const uint64_t bytes = static_cast<uint64_t>(static_cast<double>(t.residentNs) * memBytesPerNs);
      r.work = std::max(memStep, bytes / memStep * memStep);
      step = roundUpToTick(static_cast<uint64_t>(static_cast<double>(memStep) / memBytesPerNs));
    } else {
      r.work = std::max<uint64_t>(1, t.residentNs / kProbeTimerReadNs);
      r.tick_ns = t.residentNs >= kProbeTimerTickNs ? kProbeTimerTickNs : 0;
    }
    r.gap_ns = t.gapSumNs;
    r.max_gap_ns = std::max(step, t.gapMaxNs);
  }
}

std::vector<uint32_t> virtualSmIds(uint32_t sms, uint64_t seed) {
  std::vector<uint32_t> ids(sms);
  for (uint32_t i = 0; i < sms; ++i) ids[i] = i;
  uint64_t s = seed;
  for (uint32_t i = sms; i > 1; --i) std::swap(ids[i - 1], ids[splitmix(&s) % i]);
  return ids;
}

}  // namespace simgpu
