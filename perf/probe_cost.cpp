// What a probe round costs the GPU (issue 12: "probe GPU cost per round measured in a
// benchmark"), on simgpu, judged by the device's own accounting: the SM-time simgpu's engine
// counted for this process while it ran the rounds (busy SM-ns, an SM counted while it holds at
// least one of the process's blocks), divided by the device's SMs and the rounds. That is
// whole-device time, as if each probe block held a whole SM (it holds 128 of 2048 threads), the
// same measure docs/probes.md gives the budget in. Run by perf/probe_cost.sh, which sets up a
// simgpu state directory and the hog's cost table.
//
//   BM_ProbeRound/<what>/<hog>   what: 0 tick + sm (the broker's default kinds), 1 tick + sm + mem
//                                hog:  0 alone, 1 next to a saturating process (time slices)
//   BM_EmptyRound/<hog>          the baseline, in the same run: one tick probe with a 1 us box
//                                (a launch, one warp, the copy back and the synchronisation)
// Counters (per round): device_us (the device's count), records_us (the same from the records),
// of_1ms (device_us / the 1 ms bound: under 1), at_1hz (device_us / 1 s: the fraction of
// the device at the default rate), wall_per_empty (the round's host time, launch to records back,
// over BM_EmptyRound's in this run: what a round keeps the probe thread waiting).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "probe_runner.h"
#include "simgpu_hog.h"
#include "timeslice_board.h"

using namespace cushare::probe;

namespace {

constexpr uint64_t kUs = 1000;

// This process's counters on simgpu's time-slice board (device 0).
simgpu::ProcessDeviceStats mine() {
  static simgpu::Board* board = [] {
    std::string err;
    simgpu::Board* b = simgpu::openBoard(std::getenv("SIMGPU_STATE_DIR"), 0, &err);
    if (!b) std::fprintf(stderr, "probe_cost: simgpu's board: %s\n", err.c_str());
    return b;
  }();
  simgpu::ProcessDeviceStats me;
  if (board) simgpu::forEachProcess(*board, [&](const simgpu::ProcessDeviceStats& p) {
    if (p.pid == getpid()) me = p;
  });
  return me;
}


struct Probes {
  CUcontext ctx = nullptr;
  std::unique_ptr<ProbeRunner> runner;
  std::string error;
  Probes() {
    CUdevice dev;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
      error = "no CUDA device";
      return;
    }
    RunnerOptions o;
    o.memBufferBytes = 16 << 20;  // simgpu's device memory is host memory
    if (ProbeError e = ProbeRunner::load(PROBES_FATBIN, o, &runner)) error = e.message();
  }
};

Probes& probes() {
  static Probes p;
  return p;
}

double gEmptyWallUs[2] = {0, 0};  // BM_EmptyRound's host us per round, alone and with the hog

// Runs rounds of `what` with `budget` for the benchmark's iterations; the device's own count and
// the records' per round as counters.
void runRounds(benchmark::State& state, uint32_t what, const ProbeBudgets& budget, bool hog, double* wallOut) {
  Probes& p = probes();
  if (!p.error.empty()) {
    state.SkipWithError(p.error.c_str());
    return;
  }
  cushare::simhog::Hog h;  // a saturating plain process: time slices
  if (hog && !h.start(HOG_BIN, p.runner->smCount())) {
    state.SkipWithError("the hog process did not start");
    return;
  }
  const uint32_t sms = p.runner->smCount();
  const simgpu::ProcessDeviceStats before = mine();
  double records = 0;
  uint64_t rounds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    RoundRecords r;
    if (ProbeError e = p.runner->runRound(nullptr, what, budget, &r)) {
      state.SkipWithError(e.message().c_str());
      return;
    }
    records += roundCostUs(r, sms);
    ++rounds;
  }
  const double wall =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
      double(rounds ? rounds : 1);
  const simgpu::ProcessDeviceStats after = mine();
  if (rounds == 0 || after.updatedNs == 0) {
    state.SkipWithError("no counters on simgpu's board");
    return;
  }
  const double device = static_cast<double>(after.busySmNs - before.busySmNs) / sms / 1000.0 / double(rounds);
  state.counters["device_us"] = device;
  state.counters["records_us"] = records / double(rounds);
  state.counters["of_1ms"] = device / 1000.0;
  state.counters["at_1hz"] = device / 1e6;
  if (wallOut) *wallOut = wall;
  const double empty = gEmptyWallUs[hog ? 1 : 0];
  if (empty > 0) state.counters["wall_per_empty"] = wall / empty;
}

void BM_EmptyRound(benchmark::State& state) {
  const bool hog = state.range(0) != 0;
  runRounds(state, kRunTick, ProbeBudgets{1, 1, 1 * kUs}, hog, &gEmptyWallUs[hog ? 1 : 0]);
}
BENCHMARK(BM_EmptyRound)->ArgName("hog")->Arg(0)->Arg(1)->Iterations(20)->UseRealTime()->Unit(benchmark::kMicrosecond);

void BM_ProbeRound(benchmark::State& state) {
  const uint32_t what = state.range(0) == 0 ? (kRunTick | kRunSm) : kRunAll;
  runRounds(state, what, ProbeBudgets{}, state.range(1) != 0, nullptr);
}
BENCHMARK(BM_ProbeRound)
    ->ArgNames({"mem", "hog"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Iterations(20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
