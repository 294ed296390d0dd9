// simgpu's native twins of the probe kernels (src/probe_twin.h): the records the engine's block
// events give, on the virtual clock (the test moves time; nothing sleeps).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "engine.h"
#include "probe_twin.h"

namespace simgpu {
namespace {

using namespace cushare::probe;
constexpr uint64_t kUs = 1000, kMs = 1000 * kUs;

struct Rig {
  Engine e;
  std::map<uint64_t, std::vector<BlockEvent>> ev;
  std::map<uint64_t, uint64_t> end;
  explicit Rig(uint32_t sms, uint64_t sliceNs = 2 * kMs, uint64_t switchNs = 100 * kUs)
      : e(params(sms, sliceNs, switchNs), [this](uint64_t id, uint64_t t) { end[id] = t; }) {
    e.setBlockObserver([this](const BlockEvent& b) { ev[b.kernel].push_back(b); });
  }
  static EngineParams params(uint32_t sms, uint64_t sliceNs, uint64_t switchNs) {
    EngineParams p;
    p.sms = sms;
    p.sliceNs = sliceNs;
    p.switchNs = switchNs;
    return p;
  }
  void run() {
    while (!e.idle()) e.advanceTo(e.nextEventTime());
  }
};

KernelShape probe(uint64_t blocks, uint32_t threads, uint64_t boxNs) {
  KernelShape s;
  s.blocks = blocks;
  s.threadsPerBlock = threads;
  s.blockNs = kProbeLateBlockNs;
  s.timeBoxNs = boxNs;
  s.traceBlocks = true;
  return s;
}

ProbeArgs args(ProbeKind kind, uint64_t budget, uint32_t count) {
  ProbeArgs a{};
  a.abi_version = kProbeAbiVersion;
  a.kind = kind;
  a.budget_ns = budget;
  a.t0 = 0x1000;
  a.records = 0x2000;
  a.record_count = count;
  a.work_per_step = 256;
  a.buffer = 0x4000;
  a.buffer_bytes = 1 << 20;
  return a;
}

TEST(SimgpuProbeTwin, ATickProbeSlicedOutSeesTheHogsSliceAsItsGap) {
  Rig r(2);
  const int mine = r.e.addContext(1), hog = r.e.addContext(2);
  r.e.advanceTo(500);  // starts off the timer's tick: its start reads 0
  const uint64_t id = r.e.submit(mine, 0, probe(1, 32, 3 * kMs));
  r.e.submit(hog, 0, [] {
    KernelShape s;
    s.blocks = 2;
    s.threadsPerBlock = 1024;
    s.blockNs = 10 * kMs;
    return s;
  }());
  r.e.advanceTo(30 * kMs);
  ASSERT_TRUE(r.end.count(id));
  std::vector<BlockTrace> t;
  foldBlockEvents(r.ev[id], 1, &t);
  ASSERT_EQ(t.size(), 1u);
  // Ran [0.5 us, 2000.5 us), saved while the hog held the device, resumed at 4200.5 us past its
  // deadline (3000.5 us) only to finish its 1 us exit.
  EXPECT_EQ(t[0].startNs, 500u);
  EXPECT_EQ(t[0].endNs, 4'201'500u);
  EXPECT_EQ(t[0].residentNs, 2'001'000u);
  EXPECT_EQ(t[0].started, 2u);
  EXPECT_EQ(t[0].gapSumNs, 2'200'000u);
  EXPECT_EQ(t[0].gapMaxNs, 2'200'000u);
  // The engine's own accounting agrees.
  EXPECT_EQ(r.e.stats(mine).busyNs, t[0].residentNs);
  std::vector<BlockRecord> rec;
  uint64_t t0 = 1;
  probeRecords(args(kProbeTick, 3 * kMs, 1), kProbeTick, 32, t, {}, 2, &rec, &t0);
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(t0, 0u);
  EXPECT_EQ(rec[0].flags, kProbeRan);
  EXPECT_EQ(rec[0].start_ns, 0u);
  EXPECT_EQ(rec[0].end_ns, 4'201'000u);
  EXPECT_EQ(rec[0].gap_ns, 2'200'000u);
  EXPECT_EQ(rec[0].max_gap_ns, 2'200'000u);
  EXPECT_EQ(rec[0].tick_ns, kProbeTimerTickNs);
  EXPECT_EQ(rec[0].cycles, 2'001'000u * 198 / 100);
  EXPECT_EQ(rec[0].work, 2'001'000u / kProbeTimerReadNs);
}

TEST(SimgpuProbeTwin, LateBlocksDoNoWorkAndBandwidthIsSplitAmongTheSmsBlocks) {
  Rig r(1);
  const int c = r.e.addContext(1);
  // One SM, 256-thread blocks: 8 fit; 10 blocks: 2 start at the deadline.
  const uint64_t id = r.e.submit(c, 0, probe(10, 256, 100 * kUs));
  r.run();
  std::vector<BlockTrace> t;
  foldBlockEvents(r.ev[id], 10, &t);
  std::vector<BlockRecord> rec;
  uint64_t t0 = 0;
  probeRecords(args(kProbeMem, 100 * kUs, 10), kProbeMem, 256, t, {}, 1, &rec, &t0);
  int late = 0;
  for (const BlockRecord& b : rec) {
    if (b.flags & kProbeLate) {
      ++late;
      EXPECT_EQ(b.work, 0u);
      EXPECT_EQ(b.start_ns, 100 * kUs);
      EXPECT_EQ(b.end_ns, 101 * kUs);
    } else {
      EXPECT_EQ(b.flags, kProbeRan);
      // 100 us x 4.8 TB/s on the one SM, split among the 8 blocks that ran on it, in 32 KiB steps.
      EXPECT_EQ(b.work, 480'000'000ull / 8 / 32768 * 32768);
    }
  }
  EXPECT_EQ(late, 2);
}

TEST(SimgpuProbeTwin, ArgumentsAreCheckedAsTheKernelChecksThem) {
  const unsigned grid[3] = {4, 1, 1}, block[3] = {64, 1, 1};
  EXPECT_TRUE(probeArgsValid(args(kProbeSm, kMs, 4), kProbeSm, grid, block));
  EXPECT_FALSE(probeArgsValid(args(kProbeSm, kMs, 4), kProbeMem, grid, block));  // the other kernel's kind
  EXPECT_FALSE(probeArgsValid(args(kProbeSm, kMs, 3), kProbeSm, grid, block));   // fewer records than blocks
  ProbeArgs v = args(kProbeSm, kMs, 4);
  v.abi_version = 2;
  EXPECT_FALSE(probeArgsValid(v, kProbeSm, grid, block));
  ProbeArgs w = args(kProbeSm, kMs, 4);
  w.work_per_step = 0;
  EXPECT_FALSE(probeArgsValid(w, kProbeSm, grid, block));
  ProbeArgs m = args(kProbeMem, kMs, 4);
  m.buffer_bytes = 24;  // not a multiple of 16
  EXPECT_FALSE(probeArgsValid(m, kProbeMem, grid, block));
  const unsigned partial[3] = {48, 1, 1}, twoD[3] = {4, 2, 1};
  EXPECT_FALSE(probeArgsValid(args(kProbeSm, kMs, 8), kProbeSm, grid, partial));
  EXPECT_FALSE(probeArgsValid(args(kProbeSm, kMs, 8), kProbeSm, twoD, block));
}

TEST(SimgpuProbeTwin, VirtualSmIdsAreAPermutationPerClient) {
  const std::vector<uint32_t> a = virtualSmIds(132, 1), b = virtualSmIds(132, 2);
  EXPECT_EQ(a, virtualSmIds(132, 1));
  EXPECT_NE(a, b);
  std::vector<uint32_t> s = a;
  std::sort(s.begin(), s.end());
  for (uint32_t i = 0; i < 132; ++i) EXPECT_EQ(s[i], i);
}

}  // namespace
}  // namespace simgpu
