// The probe kernels on whatever driver the loader finds (perf/gpu_check.sh runs it on a real GPU,
// alone and next to a hog, and on simgpu): what simgpu's twins guess (docs/simgpu.md, "Probe
// kernels") measured, so the guesses can be fitted.
//
//   usage: probe_check <probes.fatbin> [rounds] [label]
//   prints, per round, one line per probe:
//     <label> round=<i> probe=<sm|mem|tick> blocks=<n> ran=<n> late=<n> distinct_sms=<n>
//       start_spread_us=<last start - first start> dur_us=<min>/<median>/<max> (end - start)
//       resident_us=<median of end - start - gap> gap_us=<max gap_ns>/<max max_gap_ns>
//       work_per_us=<median work / resident us> cycles_per_ns=<median> tick_ns=<tick probe>
//       launch_to_start_us=<first start - launch>, against CLOCK_REALTIME (rt) and CLOCK_MONOTONIC
//       (mono): %globaltimer's epoch is not documented; one of the two is meaningful (on simgpu,
//       mono: device time is CLOCK_MONOTONIC / SIMGPU_TIME_SCALE)
//   and a line "<label> cost_us=<round cost>": roundCostUs (the sum over the blocks that ran or
//   were late of their resident time, over the SMs).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <vector>

#include "probe_runner.h"

using namespace cushare::probe;

namespace {

template <typename T>
T median(std::vector<T> v) {
  if (v.empty()) return T{};
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

const char* kindName(ProbeKind k) { return k == kProbeSm ? "sm" : k == kProbeMem ? "mem" : "tick"; }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: probe_check <probes.fatbin> [rounds] [label]\n");
    return 2;
  }
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const char* label = argc > 3 ? argv[3] : "probe";
  CUdevice dev;
  CUcontext ctx;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::fprintf(stderr, "probe_check: no CUDA device\n");
    return 1;
  }
  std::unique_ptr<ProbeRunner> runner;
  if (ProbeError e = ProbeRunner::load(argv[1], RunnerOptions{}, &runner)) {
    std::fprintf(stderr, "probe_check: %s\n", e.message().c_str());
    return 1;
  }
  CUstream stream;
  if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return 1;
  const uint32_t sms = runner->smCount();
  std::printf("%s sms=%u\n", label, sms);
  for (int i = 0; i < rounds; ++i) {
    RoundRecords r;
    if (ProbeError e = runner->runRound(stream, kRunAll, ProbeBudgets{}, &r)) {
      std::fprintf(stderr, "probe_check: %s\n", e.message().c_str());
      return 1;
    }
    for (const ProbeRun* p : {&r.tick, &r.sm, &r.mem}) {
      std::vector<uint64_t> dur, res;
      std::vector<double> rate, clk;
      std::set<uint32_t> smsSeen;
      uint64_t first = UINT64_MAX, last = 0, gap = 0, maxGap = 0, tick = 0;
      uint32_t ran = 0, late = 0;
      for (const BlockRecord& b : p->records) {
        if (!(b.flags & (kProbeRan | kProbeLate))) continue;
        first = std::min(first, b.start_ns);
        last = std::max(last, b.start_ns);
        smsSeen.insert(b.sm_start);
        if (b.flags & kProbeLate) {
          ++late;
          continue;
        }
        ++ran;
        const uint64_t d = b.end_ns - b.start_ns, in = d - std::min(d, b.gap_ns);
        dur.push_back(d);
        res.push_back(in);
        if (in) rate.push_back(static_cast<double>(b.work) * 1000.0 / static_cast<double>(in));
        if (in) clk.push_back(static_cast<double>(b.cycles) / static_cast<double>(in));
        gap = std::max(gap, b.gap_ns);
        maxGap = std::max(maxGap, b.max_gap_ns);
        tick = std::max(tick, b.tick_ns);
      }
      std::sort(dur.begin(), dur.end());
      auto us = [](uint64_t ns) { return static_cast<double>(ns) / 1000.0; };
      auto latency = [&](uint64_t launch) { return first == UINT64_MAX ? 0.0 : (static_cast<double>(first) - static_cast<double>(launch)) / 1000.0; };
      std::printf("%s round=%d probe=%s blocks=%u ran=%u late=%u distinct_sms=%zu start_spread_us=%.1f dur_us=%.1f/%.1f/%.1f "
                  "resident_us=%.1f gap_us=%.1f/%.1f work_per_us=%.2f cycles_per_ns=%.3f tick_ns=%llu "
                  "launch_to_start_us=rt:%.1f,mono:%.1f\n",
                  label, i, kindName(p->kind), p->blocks, ran, late, smsSeen.size(), first == UINT64_MAX ? 0.0 : us(last - first),
                  dur.empty() ? 0.0 : us(dur.front()), us(median(dur)), dur.empty() ? 0.0 : us(dur.back()), us(median(res)),
                  us(gap), us(maxGap), median(rate), median(clk), static_cast<unsigned long long>(tick),
                  latency(p->launchRealtimeNs), latency(p->launchMonotonicNs));
    }
    std::printf("%s round=%d cost_us=%.1f\n", label, i, roundCostUs(r, sms));
  }
  return 0;
}
