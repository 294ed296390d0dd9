// simgpu's device-time engine on the virtual clock (the test moves time; nothing sleeps), and the
// kernel cost table it takes block times from.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <map>
#include <string>
#include <vector>

#include "cost_table.h"
#include "device_runner.h"
#include "engine.h"
#include "mps/mps_protocol.h"

namespace simgpu {
namespace {

constexpr uint64_t kUs = 1000, kMs = 1000 * 1000;

// An engine that records when each kernel completed.
struct Rig {
  std::map<uint64_t, uint64_t> end;
  Engine e;
  explicit Rig(EngineParams p) : e(p, [this](uint64_t id, uint64_t t) { end[id] = t; }) {}
  // Runs until every kernel completed; now() is then the last completion.
  void run() {
    while (!e.idle()) e.advanceTo(e.nextEventTime());
  }
};

EngineParams params(uint32_t sms, uint64_t sliceNs = 2 * kMs, uint64_t switchNs = 100 * kUs) {
  EngineParams p;
  p.sms = sms;
  p.sliceNs = sliceNs;
  p.switchNs = switchNs;
  return p;
}

KernelShape shape(uint64_t blocks, uint32_t threads, uint64_t blockNs) {
  KernelShape k;
  k.blocks = blocks;
  k.threadsPerBlock = threads;
  k.blockNs = blockNs;
  return k;
}

TEST(SimgpuEngine, OccupancyLimitsOfAnH100Sm) {
  const SmLimits l;
  EXPECT_EQ(blocksPerSm(shape(1, 1024, 0), l), 2u);  // threads
  EXPECT_EQ(blocksPerSm(shape(1, 32, 0), l), 32u);   // blocks
  KernelShape regs = shape(1, 256, 0);
  regs.registersPerThread = 64;  // 8 warps x 2048 registers = 16384 per block
  EXPECT_EQ(blocksPerSm(regs, l), 4u);
  regs.registersPerThread = 255;  // 255 -> 8160 per warp, rounded to 8192
  EXPECT_EQ(blocksPerSm(regs, l), 1u);
  KernelShape smem = shape(1, 64, 0);
  smem.sharedPerBlock = 100 * 1024;
  EXPECT_EQ(blocksPerSm(smem, l), 2u);
  smem.sharedPerBlock = 240 * 1024;
  EXPECT_EQ(blocksPerSm(smem, l), 0u);  // can never run
}

TEST(SimgpuEngine, GridLargerThanTheDeviceRunsInWaves) {
  Rig r(params(4));
  const int c = r.e.addContext(1);
  const uint64_t one = r.e.submit(c, 0, shape(8, 1024, 1000));    // 4 SMs x 2 blocks: one wave
  r.run();
  EXPECT_EQ(r.end[one], 1000u);
  const uint64_t two = r.e.submit(c, 0, shape(9, 1024, 1000));    // a ninth block: a second wave
  r.run();
  EXPECT_EQ(r.end[two], 1000u + 2000u);
  const uint64_t four = r.e.submit(c, 0, shape(32, 1024, 500));
  r.run();
  EXPECT_EQ(r.end[four], 3000u + 4 * 500u);
  EXPECT_EQ(r.e.stats(c).blocksRun, 8u + 9u + 32u);
  EXPECT_EQ(r.e.stats(c).kernelsRun, 3u);
}

TEST(SimgpuEngine, BlocksSpreadBreadthFirstAndSmTimeIsCounted) {
  Rig r(params(4));
  const int c = r.e.addContext(1);
  r.e.submit(c, 0, shape(4, 32, 1000));  // 32 could share one SM; they go one per SM
  EXPECT_EQ(r.e.smsInUse(c), 4u);
  r.run();
  EXPECT_EQ(r.e.stats(c).busySmNs, 4000u);
  EXPECT_EQ(r.e.stats(c).busyNs, 1000u);
  EXPECT_EQ(r.e.deviceBusyNs(), 1000u);
}

TEST(SimgpuEngine, StreamsOfOneContextRunConcurrently) {
  Rig r(params(4));
  const int c = r.e.addContext(1);
  const uint64_t a = r.e.submit(c, 0, shape(4, 1024, 1000));
  const uint64_t b = r.e.submit(c, 0, shape(4, 1024, 1000));
  r.run();
  EXPECT_EQ(r.end[a], 1000u);
  EXPECT_EQ(r.end[b], 1000u);
}

TEST(SimgpuEngine, StreamPriorityOrdersWaitingBlocksWithoutPreemption) {
  Rig r(params(1));
  const int c = r.e.addContext(1);
  const uint64_t running = r.e.submit(c, 0, shape(1, 2048, 1000));  // fills the only SM
  const uint64_t low = r.e.submit(c, 0, shape(1, 2048, 1000));
  const uint64_t high = r.e.submit(c, -5, shape(1, 2048, 1000));
  r.run();
  EXPECT_EQ(r.end[running], 1000u);  // not preempted by the higher priority
  EXPECT_EQ(r.end[high], 2000u);     // first when the SM frees
  EXPECT_EQ(r.end[low], 3000u);
}

TEST(SimgpuEngine, ContextsOfDifferentGroupsTakeTurnsInSlices) {
  Rig r(params(2, 2 * kMs, 100 * kUs));
  const int a = r.e.addContext(1), b = r.e.addContext(2);
  const uint64_t ka = r.e.submit(a, 0, shape(2, 1024, 10 * kMs));
  const uint64_t kb = r.e.submit(b, 0, shape(2, 1024, 10 * kMs));
  // Never side by side: sample the whole run.
  for (uint64_t t = 0; t < 25 * kMs; t += 50 * kUs) {
    r.e.advanceTo(t);
    EXPECT_FALSE(r.e.smsInUse(a) && r.e.smsInUse(b)) << "at " << t;
  }
  // a: [0,2] [4.2,6.2] [8.4,10.4] [12.6,14.6] [16.8,18.8]; b one slice + switch later.
  EXPECT_EQ(r.end[ka], 18'800 * kUs);
  EXPECT_EQ(r.end[kb], 20'900 * kUs);
  EXPECT_EQ(r.e.stats(a).busyNs, 10 * kMs);
  EXPECT_EQ(r.e.stats(a).slicedOutNs, 8'800 * kUs);
  EXPECT_EQ(r.e.stats(b).slicedOutNs, 10'900 * kUs);
  EXPECT_EQ(r.e.switches(), 9u);
}

TEST(SimgpuEngine, AnIdleContextYieldsAtOnce) {
  Rig r(params(1, 2 * kMs, 100 * kUs));
  const int a = r.e.addContext(1), b = r.e.addContext(2);
  const uint64_t ka = r.e.submit(a, 0, shape(1, 1024, 1 * kMs));
  const uint64_t kb = r.e.submit(b, 0, shape(1, 1024, 10 * kMs));
  r.run();
  EXPECT_EQ(r.end[ka], 1 * kMs);
  EXPECT_EQ(r.end[kb], 1 * kMs + 100 * kUs + 10 * kMs);  // no wait for a's slice to end
  // Alone on the device, a context is never sliced out.
  const uint64_t alone = r.e.submit(b, 0, shape(1, 1024, 7 * kMs));
  r.run();
  EXPECT_EQ(r.end[alone], r.end[kb] + 7 * kMs);
}

TEST(SimgpuEngine, SmCapBoundsTheSmsAContextHoldsAndGroupMembersShareTheDevice) {
  Rig r(params(8));
  // Two MPS clients of one server: one time-slice group, caps of 2 and 4 SMs.
  const int a = r.e.addContext(7, 2), b = r.e.addContext(7, 4);
  const uint64_t ka = r.e.submit(a, 0, shape(100, 1024, 1000));
  const uint64_t kb = r.e.submit(b, 0, shape(100, 1024, 1000));
  uint32_t mostA = 0, mostB = 0;
  for (uint64_t t = 0; t < 30 * kUs; t += 500) {
    r.e.advanceTo(t);
    mostA = std::max(mostA, r.e.smsInUse(a));
    mostB = std::max(mostB, r.e.smsInUse(b));
    if (t == 500) {
      EXPECT_TRUE(r.e.smsInUse(a) && r.e.smsInUse(b));  // side by side
    }
  }
  EXPECT_EQ(mostA, 2u);
  EXPECT_EQ(mostB, 4u);
  EXPECT_EQ(r.end[ka], 25u * 1000);  // 4 blocks at a time
  EXPECT_EQ(r.end[kb], 13u * 1000);  // 8 at a time
  EXPECT_EQ(r.e.stats(a).slicedOutNs, 0u);
}

TEST(SimgpuEngine, ClientPriorityGoesBeforeStreamPriority) {
  Rig r(params(1));
  const int low = r.e.addContext(7, 0, 1), normal = r.e.addContext(7, 0, 0);
  const uint64_t first = r.e.submit(low, 0, shape(1, 2048, 1000));
  const uint64_t lowNext = r.e.submit(low, -5, shape(1, 2048, 1000));
  const uint64_t normalNext = r.e.submit(normal, 0, shape(1, 2048, 1000));
  r.run();
  EXPECT_EQ(r.end[first], 1000u);
  EXPECT_EQ(r.end[normalNext], 2000u);
  EXPECT_EQ(r.end[lowNext], 3000u);
}

TEST(SimgpuEngine, DroppedContextsWorkNeverCompletesAndFreesTheDevice) {
  Rig r(params(1, 2 * kMs, 0));
  const int a = r.e.addContext(1), b = r.e.addContext(2);
  r.e.submit(a, 0, shape(1, 2048, 1 * kMs));
  const uint64_t queued = r.e.submit(a, 0, shape(5, 2048, 1 * kMs));
  const uint64_t kb = r.e.submit(b, 0, shape(1, 2048, 1 * kMs));
  r.e.advanceTo(500 * kUs);
  r.e.dropContext(a);  // its process died
  r.run();
  EXPECT_EQ(r.end.count(queued), 0u);
  EXPECT_EQ(r.end[kb], 2 * kMs);  // a's running block finished; nothing else of a ran
  EXPECT_TRUE(r.e.idle());
}

TEST(SimgpuEngine, AKernelThatCannotFitCompletesAtOnce) {
  Rig r(params(2));
  const int c = r.e.addContext(1);
  KernelShape k = shape(4, 64, 1000);
  k.sharedPerBlock = 300 * 1024;
  const uint64_t id = r.e.submit(c, 0, k);
  EXPECT_EQ(r.end.at(id), 0u);
  EXPECT_TRUE(r.e.idle());
}

TEST(SimgpuEngine, AClosedWindowSavesRunningBlocksAndCountsAsSlicedOut) {
  Rig r(params(1));
  const int c = r.e.addContext(1);
  r.e.setWindow(0, 1 * kMs);  // another process takes the device at 1 ms...
  const uint64_t k = r.e.submit(c, 0, shape(1, 1024, 3 * kMs));
  r.e.advanceTo(2 * kMs);
  EXPECT_EQ(r.e.smsInUse(c), 0u);
  r.e.setWindow(3 * kMs, 4 * kMs);  // ...and gives it back for [3, 4) ms, then from 5 ms on
  r.e.advanceTo(4500 * kUs);
  EXPECT_EQ(r.end.count(k), 0u);
  r.e.setWindow(5 * kMs, UINT64_MAX);
  r.run();
  EXPECT_EQ(r.end[k], 6 * kMs);  // 1 + 1 + 1 ms of running
  EXPECT_EQ(r.e.stats(c).busyNs, 3 * kMs);
  EXPECT_EQ(r.e.stats(c).slicedOutNs, 3 * kMs);
}

TEST(SimgpuEngine, SavedBlocksAreRestoredBeforeHigherPriorityNewWork) {
  Rig r(params(1));
  const int c = r.e.addContext(1);
  const uint64_t fill = r.e.submit(c, 0, shape(1, 2048, 3 * kMs));
  r.e.setWindow(0, 1 * kMs);
  r.e.advanceTo(1500 * kUs);
  const uint64_t high = r.e.submit(c, -5, shape(1, 2048, 1 * kMs));  // arrives while switched out
  r.e.setWindow(2 * kMs, UINT64_MAX);
  r.run();
  EXPECT_EQ(r.end[fill], 4 * kMs);  // restored at 2 ms with its 2 ms left
  EXPECT_EQ(r.end[high], 5 * kMs);
}

TEST(SimgpuEngine, TotalsCountSharedSmsOnceAndSlicedOutTimeOfTheWholeProcess) {
  Rig r(params(4));
  const int a = r.e.addContext(7), b = r.e.addContext(7);  // one group: side by side (MPS)
  r.e.submit(a, 0, shape(4, 512, 1 * kMs));  // one block of each on every SM
  r.e.submit(b, 0, shape(4, 512, 1 * kMs));
  r.run();
  EXPECT_EQ(r.e.stats(a).busySmNs + r.e.stats(b).busySmNs, 8 * kMs);  // each counts the SMs it held
  EXPECT_EQ(r.e.totals().busySmNs, 4 * kMs);  // the device's SMs, once
  EXPECT_EQ(r.e.totals().busyNs, 1 * kMs);
  EXPECT_EQ(r.e.totals().blocksRun, 8u);
  EXPECT_EQ(r.e.totals().kernelsRun, 2u);
  r.e.setWindow(r.e.now() + 2 * kMs, UINT64_MAX);  // closed for 2 ms: the process is sliced out
  r.e.submit(a, 0, shape(1, 32, 1 * kMs));
  r.run();
  EXPECT_EQ(r.e.totals().slicedOutNs, 2 * kMs);
}

// The block hook: what each block of a traced kernel really got (the probe twins' source).
struct Traced {
  struct Block {
    std::vector<std::pair<uint64_t, uint32_t>> starts;  // (ns, sm)
    std::vector<uint64_t> saves;
    uint64_t end = 0;
    int ends = 0;
  };
  std::map<uint64_t, std::map<uint64_t, Block>> k;  // kernel -> block index -> what happened
  void attach(Engine& e) {
    e.setBlockObserver([this](const BlockEvent& ev) {
      for (uint64_t b = ev.firstBlock; b < ev.firstBlock + ev.count; ++b) {
        Block& x = k[ev.kernel][b];
        if (ev.kind == BlockEvent::kStart) x.starts.emplace_back(ev.ns, ev.sm);
        else if (ev.kind == BlockEvent::kSave) x.saves.push_back(ev.ns);
        else x.end = ev.ns, ++x.ends;
      }
    });
  }
};

KernelShape boxed(uint64_t blocks, uint32_t threads, uint64_t boxNs, uint64_t lateNs = 1 * kUs) {
  KernelShape s = shape(blocks, threads, lateNs);
  s.timeBoxNs = boxNs;
  s.traceBlocks = true;
  return s;
}

TEST(SimgpuEngine, TimeBoxedBlocksEndAtTheBoxAndLateOnesOnlyWriteTheirRecord) {
  Rig r(params(4));
  Traced t;
  t.attach(r.e);
  const int c = r.e.addContext(1);
  r.e.advanceTo(10 * kUs);
  // 4 SMs x 2 blocks of 1024 threads fit at once: the first 8 run until 10 + 100 us, the last 4
  // start at the deadline (late) and take 1 us.
  const uint64_t id = r.e.submit(c, 0, boxed(12, 1024, 100 * kUs));
  r.run();
  EXPECT_EQ(r.end[id], 111 * kUs);
  ASSERT_EQ(t.k[id].size(), 12u);
  std::map<uint32_t, int> perSm;
  for (uint64_t b = 0; b < 12; ++b) {
    const Traced::Block& x = t.k[id][b];
    ASSERT_EQ(x.starts.size(), 1u) << b;
    EXPECT_EQ(x.ends, 1) << b;
    EXPECT_TRUE(x.saves.empty());
    ++perSm[x.starts[0].second];
    if (b < 8) {
      EXPECT_EQ(x.starts[0].first, 10 * kUs);
      EXPECT_EQ(x.end, 110 * kUs);
    } else {
      EXPECT_EQ(x.starts[0].first, 110 * kUs);
      EXPECT_EQ(x.end, 111 * kUs);
    }
  }
  EXPECT_EQ(perSm.size(), 4u);
  for (auto& [sm, n] : perSm) EXPECT_EQ(n, 3) << sm;
  // Probe blocks are blocks like any other in the ground truth.
  EXPECT_EQ(r.e.stats(c).blocksRun, 12u);
  EXPECT_EQ(r.e.stats(c).busyNs, 101 * kUs);
  EXPECT_EQ(r.e.stats(c).busySmNs, 4 * 101 * kUs);
  // An untraced kernel reports nothing.
  const uint64_t plain = r.e.submit(c, 0, shape(4, 32, kUs));
  r.run();
  EXPECT_EQ(t.k.count(plain), 0u);
}

TEST(SimgpuEngine, ABlockSlicedOutReportsTheSaveAndResumesOnlyToFinishAfterTheDeadline) {
  Rig r(params(2, 2 * kMs, 100 * kUs));
  Traced t;
  t.attach(r.e);
  const int probe = r.e.addContext(1), hog = r.e.addContext(2);
  const uint64_t p = r.e.submit(probe, 0, boxed(2, 1024, 3 * kMs));
  r.e.submit(hog, 0, shape(2, 1024, 10 * kMs));
  r.e.advanceTo(30 * kMs);
  // The probe holds [0, 2) ms, the hog [2.1, 4.1), the probe resumes at 4.2 ms, past its 3 ms
  // deadline: it ends after what was left of its 1 us exit.
  for (uint64_t b = 0; b < 2; ++b) {
    const Traced::Block& x = t.k[p][b];
    ASSERT_EQ(x.starts.size(), 2u);
    EXPECT_EQ(x.starts[0].first, 0u);
    EXPECT_EQ(x.starts[1].first, 4'200 * kUs);
    ASSERT_EQ(x.saves.size(), 1u);
    EXPECT_EQ(x.saves[0], 2 * kMs);
    EXPECT_EQ(x.end, 4'201 * kUs);
  }
  EXPECT_EQ(r.end[p], 4'201 * kUs);
  // Ground truth agrees: resident 2 ms + 1 us, sliced out 2.2 ms.
  EXPECT_EQ(r.e.stats(probe).busyNs, 2'001 * kUs);
  EXPECT_EQ(r.e.stats(probe).slicedOutNs, 2'200 * kUs);
}

TEST(SimgpuEngine, TracedBlocksOfACappedContextStayOnItsSms) {
  Rig r(params(8));
  Traced t;
  t.attach(r.e);
  const int c = r.e.addContext(1, 2);  // an MPS client capped at 2 SMs
  const uint64_t id = r.e.submit(c, 0, boxed(8, 128, 50 * kUs));
  r.run();
  std::map<uint32_t, int> sms;
  for (auto& [b, x] : t.k[id]) {
    ASSERT_EQ(x.starts.size(), 1u);
    ++sms[x.starts[0].second];
    EXPECT_EQ(x.end, 50 * kUs);  // 16 blocks of 128 threads fit an SM: all start at once
  }
  EXPECT_EQ(t.k[id].size(), 8u);
  EXPECT_EQ(sms.size(), 2u);
}

TEST(SimgpuMps, PercentageToSmsIsTheCeilingRoundedUpToAPair) {
  EXPECT_EQ(mpsSmCap(250, 132), 34u);   // 33 -> 34
  EXPECT_EQ(mpsSmCap(300, 132), 40u);   // 39.6 -> 40
  EXPECT_EQ(mpsSmCap(700, 132), 94u);   // 92.4 -> 93 -> 94
  EXPECT_EQ(mpsSmCap(100, 132), 14u);   // 13.2 -> 14
  EXPECT_EQ(mpsSmCap(1000, 132), 132u);
  EXPECT_EQ(mpsSmCap(1, 132), 2u);      // 0.1 % -> 1 -> a pair
  EXPECT_EQ(mpsSmCap(1000, 7), 7u);     // never more than the device
  EXPECT_EQ(mpsSmCap(1, 1), 1u);
}

// Two processes' runners on one board, stepped on the virtual clock in turn: they take the device
// by slices, never side by side; an MPS server's runner (its clients in one group) is one slot.
// Two contexts of one process (an application's own and the primary one a probe thread uses)
// take turns; when the process's window on the board closes and the running slice ends while it
// is closed, the engine waits for the next window. It used to take the slice's end, already past,
// as the next event for ever: advanceTo spun at 100 % CPU and the process never ran again (a
// paced process with probes on, under MPS, in BrokerMps.AProcessOutsideMpsIsPacedToItsCapAndClientsAreNot).
TEST(SimgpuEngine, ASliceEndingWhileTheWindowIsClosedWaitsForTheNextWindow) {
  auto* e = new Engine(params(4, 2 * kMs, 100 * kUs), [](uint64_t, uint64_t) {});
  const int a = e->addContext(1), b = e->addContext(2);
  e->submit(a, 0, shape(400, 1024, 1 * kMs));
  e->submit(b, 0, shape(400, 1024, 1 * kMs));
  e->setWindow(0, 3 * kMs);  // a's slice, the switch, then b's slice outlives the window
  std::atomic<bool> done{false};
  std::thread t([e, &done] {
    e->advanceTo(10 * kMs);
    done = true;
  });
  for (int i = 0; i < 500 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!done) {
    t.detach();  // spinning for ever: the engine is left to it
    FAIL() << "advanceTo did not return";
  }
  t.join();
  EXPECT_EQ(e->now(), 10 * kMs);
  EXPECT_EQ(e->smsInUse(a) + e->smsInUse(b), 0u) << "nothing runs while the window is closed";
  const uint64_t busy = e->stats(a).busyNs + e->stats(b).busyNs;
  e->setWindow(10 * kMs, 20 * kMs);  // the next window: work goes on
  e->advanceTo(12 * kMs);
  EXPECT_GT(e->stats(a).busyNs + e->stats(b).busyNs, busy);
  delete e;
}

// A time-slice board of device 0 in a directory of its own, removed at the end.
struct TempBoard {
  char dir[32] = "/tmp/simgpu-runner-XXXXXX";
  Board* b = nullptr;
  std::string err;
  TempBoard() {
    if (mkdtemp(dir)) b = openBoard(dir, 0, &err);
  }
  ~TempBoard() { (void)!system((std::string("rm -rf ") + dir).c_str()); }
};

TEST(SimgpuDeviceRunner, TwoSlotsTakeTurnsAndAServersClientsShareItsWindows) {
  TempBoard tb;
  Board* b = tb.b;
  ASSERT_NE(b, nullptr) << tb.err;
  std::string err;
  const EngineParams p = params(4, 2 * kMs, 100 * kUs);
  std::map<uint64_t, uint64_t> endA, endS;
  DeviceRunner plain(p, [&](uint64_t id, uint64_t t) { endA[id] = t; });
  DeviceRunner server(p, [&](uint64_t id, uint64_t t) { endS[id] = t; });
  ASSERT_TRUE(plain.joinBoard(b, getpid(), false, &err)) << err;
  ASSERT_TRUE(server.joinBoard(b, getpid(), true, &err)) << err;
  EXPECT_NE(plain.slot(), server.slot());
  EXPECT_EQ(b->slot[server.slot()].mpsServer.load(), 1u);
  const uint64_t t0 = 10 * kMs;
  const int a = plain.engine().addContext(0);
  const int c1 = server.engine().addContext(0, 2), c2 = server.engine().addContext(0, 2);  // two clients, 2 SMs each
  plain.submit(a, 0, shape(40, 1024, 1 * kMs), t0);  // 5 ms of the whole device
  server.submit(c1, 0, shape(20, 1024, 1 * kMs), t0);  // 5 ms on its 2 SMs
  server.submit(c2, 0, shape(20, 1024, 1 * kMs), t0);  // side by side with c1
  uint64_t overlap = 0;
  for (uint64_t t = t0; t < t0 + 40 * kMs; t += 50 * kUs) {
    plain.step(t);
    server.step(t);
    if (plain.engine().smsInUse(a) && (server.engine().smsInUse(c1) || server.engine().smsInUse(c2))) overlap += 50 * kUs;
  }
  ASSERT_EQ(endA.size(), 1u);
  ASSERT_EQ(endS.size(), 2u);
  EXPECT_EQ(overlap, 0u) << "never side by side";
  EXPECT_EQ(server.engine().stats(c1).busySmNs, server.engine().stats(c2).busySmNs);
  EXPECT_EQ(server.engine().stats(c1).blocksRun, 20u);
  EXPECT_EQ(server.engine().totals().busySmNs, 20 * kMs) << "4 SMs for 5 ms: the clients shared each window";
  EXPECT_GT(plain.engine().totals().slicedOutNs, 0u);
  EXPECT_GT(server.engine().totals().slicedOutNs, 0u);
  EXPECT_EQ(b->slot[server.slot()].blocksRun.load(), 40u);  // published
  EXPECT_GE(b->switches.load(), 2u);
}

// A process alone on the device whose runner is kept off the CPU for many slices (a loaded host)
// renews its window from the time it runs again: nobody else wanted the device, so the device ran
// on all that time, as a real one would (it used to catch up one slice per step, late).
// A runner alone on a board of its own, given 100 ms of work for the whole device at t0.
struct SoleHolder {
  TempBoard tb;
  DeviceRunner r{params(4, 2 * kMs, 100 * kUs), [](uint64_t, uint64_t) {}};
  int a = -1;
  const uint64_t t0 = 10 * kMs;
  bool start() {
    std::string err;
    if (tb.b == nullptr || !r.joinBoard(tb.b, getpid(), false, &err)) return false;
    a = r.engine().addContext(0);
    r.submit(a, 0, shape(400, 1024, 1 * kMs), t0);
    return true;
  }
};

TEST(SimgpuDeviceRunner, ASoleHolderSteppedLateRunsOnAsADeviceWould) {
  SoleHolder h;
  ASSERT_TRUE(h.start()) << h.tb.err;
  DeviceRunner& r = h.r;
  const int a = h.a;
  const uint64_t t0 = h.t0;
  for (uint64_t t = t0; t < t0 + 4 * kMs; t += 50 * kUs) r.step(t);
  r.step(t0 + 24 * kMs);  // 20 ms (10 slices) without a step
  EXPECT_EQ(r.engine().stats(a).busyNs, 24 * kMs) << "the device ran on while the host was away";
  for (uint64_t t = t0 + 24 * kMs; t < t0 + 30 * kMs; t += 50 * kUs) r.step(t);
  EXPECT_EQ(r.engine().totals().slicedOutNs, 0u);
  EXPECT_EQ(r.engine().stats(a).busyNs, r.engine().now() - t0) << "busy all the time it had work";
}

// A context that gets work while another holds the device (it had it alone for many slices)
// waits at most one slice and the switch, wherever in the holder's slice it arrives: a GPU's time
// slice runs from when its context got the device. The holder used to renew its window half a
// slice before its end, so an arrival just after a renewal waited up to one and a half slices
// (3.1 ms here); a high-priority tenant's kernels next to a saturating low one paid it.
TEST(SimgpuDeviceRunner, AContextThatGetsWorkWaitsAtMostOneSlice) {
  const EngineParams p = params(4, 2 * kMs, 100 * kUs);
  uint64_t most = 0, least = ~0ull;
  for (uint64_t phase = 0; phase < 2 * kMs; phase += 100 * kUs) {
    TempBoard tb;
    Board* b = tb.b;
    ASSERT_NE(b, nullptr) << tb.err;
    std::string err;
    std::map<uint64_t, uint64_t> endB;
    DeviceRunner holder(p, [](uint64_t, uint64_t) {});
    DeviceRunner late(p, [&](uint64_t id, uint64_t t) { endB[id] = t; });
    ASSERT_TRUE(holder.joinBoard(b, getpid(), false, &err)) << err;
    ASSERT_TRUE(late.joinBoard(b, getpid(), false, &err)) << err;
    const int a = holder.engine().addContext(0), c = late.engine().addContext(0);
    const uint64_t t0 = 10 * kMs, arrive = t0 + 10 * kMs + phase;
    holder.submit(a, 0, shape(400, 1024, 1 * kMs), t0);  // 100 ms of the whole device
    bool sent = false;
    for (uint64_t t = t0; t < t0 + 30 * kMs; t += 50 * kUs) {
      if (!sent && t >= arrive) {
        late.submit(c, 0, shape(4, 1024, 100 * kUs), arrive);  // one 100 us wave
        sent = true;
      }
      holder.step(t);
      late.step(t);
    }
    ASSERT_EQ(endB.size(), 1u) << "phase " << phase;
    const uint64_t waited = endB.begin()->second - arrive - 100 * kUs;
    most = std::max(most, waited);
    least = std::min(least, waited);
    EXPECT_LE(waited, p.sliceNs + p.switchNs) << "arrived " << phase / kUs << " us into the 10th ms";
  }
  EXPECT_GE(most, p.sliceNs) << "it does wait for the holder's slice (no preemption on arrival)";
  EXPECT_LE(least, p.switchNs + 100 * kUs) << "arriving at a slice's end, it waits about the switch";
}

// A kernel submitted past the holder's window end before its runner stepped there (a stream's
// worker ran first on a loaded host) does not run the engine through a closed window: a process
// alone is never sliced out (the window is renewed at its end only, so nothing else covers it).
TEST(SimgpuDeviceRunner, ASubmissionPastTheWindowsEndDoesNotSliceOutAProcessAlone) {
  SoleHolder h;
  ASSERT_TRUE(h.start()) << h.tb.err;
  for (uint64_t t = h.t0; t < h.t0 + 3 * kMs; t += 50 * kUs) h.r.step(t);
  // The window ends at t0 + 4 ms; the next submission comes at t0 + 5 ms, before any step there.
  h.r.submit(h.a, 0, shape(4, 1024, 1 * kMs), h.t0 + 5 * kMs);
  for (uint64_t t = h.t0 + 5 * kMs; t < h.t0 + 8 * kMs; t += 50 * kUs) h.r.step(t);
  EXPECT_EQ(h.r.engine().totals().slicedOutNs, 0u);
  EXPECT_EQ(h.r.engine().stats(h.a).busyNs, h.r.engine().now() - h.t0) << "busy all the time it had work";
}

TEST(SimgpuCostTable, SourceNamesDropReturnTypeAndParameters) {
  EXPECT_EQ(kernelSourceName("_Z5heavyPfi"), "heavy");
  EXPECT_EQ(kernelSourceName("_ZN2ns4spinIfEEvPT_x"), "ns::spin<float>");
  EXPECT_EQ(kernelSourceName("plain_c_kernel"), "plain_c_kernel");
}

TEST(SimgpuCostTable, FirstMatchingRuleWinsOnSourceOrMangledName) {
  CostTable t;
  std::string err;
  ASSERT_TRUE(parseCostTable("# costs\n"
                             "ns::spin<*>  block_ns_param=1   # the hog\n"
                             "\n"
                             "_Z5heavy*    block_ns=5000\n"
                             "*            block_ns=7\n"
                             "heavy        block_ns=1\n",
                             &t, &err))
      << err;
  ASSERT_EQ(t.rules.size(), 4u);
  const CostRule* r = t.match("_ZN2ns4spinIfEEvPT_x");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->param, 1);
  r = t.match("_Z5heavyPfi");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->blockNs, 5000u);  // the mangled rule comes first
  EXPECT_EQ(t.match("other")->blockNs, 7u);
  EXPECT_EQ(CostTable{}.match("x"), nullptr);
}

TEST(SimgpuCostTable, MalformedTablesAreRefusedWithTheLine) {
  const char* bad[] = {
      "k block_ns=abc",          "k block_ns=-1",       "k block_ns=1 block_ns_param=0",
      "k",                       "k speed=3",           "k block_ns",
      "block_ns=5",              "k block_ns_param=256", "k block_ns=1 block_ns=2",
  };
  for (const char* text : bad) {
    CostTable t;
    std::string err;
    EXPECT_FALSE(parseCostTable(std::string("# ok\n") + text + "\n", &t, &err)) << text;
    EXPECT_EQ(err.rfind("line 2: ", 0), 0u) << text << " -> " << err;
  }
}

}  // namespace
}  // namespace simgpu
