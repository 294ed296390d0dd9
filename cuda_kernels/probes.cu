// The probe kernels (ABI: common/include/cushare/probe_abi.h; docs/probes.md).
//
// Each kernel takes one ProbeArgs by value and writes one BlockRecord per block, from thread 0,
// after every thread of the block has stopped. Time-boxed: the first block to start stores its
// %globaltimer into *t0 by compare-and-swap from 0; every block works until *t0 + budget_ns; a
// block that enters after that deadline writes a record flagged kProbeLate only (its times
// and SM ids valid, no work: it did not run its probe; kProbeRan and kProbeLate exclude each other) and leaves at once.
//
// Invariants: no kernel writes outside args.records[0, gridDim.x) (and, for the memory probe,
// args.buffer[0, buffer_bytes)); on bad arguments only records[0] is written (kProbeBadArgs),
// and only when records is non-null and record_count >= 1; every warp leaves within one step of
// the deadline (a step is work_per_step dependent FMAs, or kMemUnroll 16-byte loads per thread).
#include <cstdint>

#include "cushare/probe_abi.h"

using namespace cushare::probe;

namespace {

constexpr int kMemUnroll = 4;  // 16-byte elements each thread moves between two timer reads

__device__ __forceinline__ uint64_t globalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t smId() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Per-block state shared by the prologue (thread 0) and the workers.
struct BlockStart {
  uint64_t start;
  uint64_t deadline;
  uint32_t sm;
  bool late;
  bool bad;
};

__device__ bool argsValid(const ProbeArgs& a, ProbeKind kind) {
  if (a.abi_version != kProbeAbiVersion || a.kind != kind) return false;
  if (a.records == 0 || a.t0 == 0 || a.record_count < gridDim.x || gridDim.y != 1 || gridDim.z != 1) return false;
  if (blockDim.x % 32 != 0 || blockDim.y != 1 || blockDim.z != 1) return false;  // whole warps (shuffles)
  if (kind == kProbeSm && a.work_per_step == 0) return false;
  if (kind == kProbeMem && (a.buffer == 0 || a.buffer_bytes < 16 || a.buffer_bytes % 16 != 0)) return false;
  return true;
}

// Thread 0: validates, reads the entry time and SM, takes part in the t0 race. Every thread
// returns with the block's start, deadline and whether it is late or bad.
__device__ void prologue(const ProbeArgs& a, ProbeKind kind, BlockStart* s, uint64_t* cycles0) {
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    *cycles0 = clock64();
    s->start = globalTimer();
    s->sm = smId();
    s->bad = !argsValid(a, kind);
    s->late = false;
    s->deadline = 0;
    if (s->bad) {
      if (blockIdx.x == 0 && a.records != 0 && a.record_count >= 1) {
        BlockRecord* r = reinterpret_cast<BlockRecord*>(a.records);
        BlockRecord rec{};
        rec.flags = kProbeBadArgs;
        *r = rec;
      }
    } else {
      auto* t0 = reinterpret_cast<unsigned long long*>(a.t0);
      const unsigned long long prev = atomicCAS(t0, 0ull, static_cast<unsigned long long>(s->start));
      const uint64_t base = prev == 0 ? s->start : prev;
      s->deadline = a.budget_ns > ~0ull - base ? ~0ull : base + a.budget_ns;  // a box past the end of time: never ends
      s->late = s->start >= s->deadline;
    }
  }
  __syncthreads();
}

// Thread 0, after every thread stopped: the block's record.
__device__ void epilogue(const ProbeArgs& a, const BlockStart& s, uint64_t cycles0, uint64_t work,
                         uint64_t maxGap, uint64_t gaps, uint64_t tick) {
  if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
  BlockRecord rec{};
  rec.start_ns = s.start;
  rec.sm_start = s.sm;
  rec.sm_end = smId();
  rec.flags = (s.late ? kProbeLate : kProbeRan) | (rec.sm_end != rec.sm_start ? kProbeMigrated : 0u);
  rec.work = work;
  rec.max_gap_ns = maxGap;
  rec.gap_ns = gaps;
  rec.tick_ns = tick;
  rec.cycles = static_cast<uint64_t>(clock64() - static_cast<long long>(cycles0));
  rec.end_ns = globalTimer();
  reinterpret_cast<BlockRecord*>(a.records)[blockIdx.x] = rec;
}

// Gap bookkeeping between two consecutive timer reads of one thread.
struct Gaps {
  uint64_t last, maxGap = 0, sum = 0;
  __device__ explicit Gaps(uint64_t t) : last(t) {}
  __device__ void step(uint64_t now) {
    const uint64_t d = now - last;
    last = now;
    if (d > maxGap) maxGap = d;
    if (d > kGapThresholdNs) sum += d;
  }
};

}  // namespace

// SM share: every thread runs a dependent FMA chain, work_per_step FMAs per step, and looks at
// the timer after each step (lane 0 of each warp reads it; the warp follows). work = thread 0's
// steps; max_gap_ns / gap_ns = thread 0's largest step and the sum of its steps over the
// threshold (time its warp did not run).
extern "C" __global__ void cushare_probe_sm(ProbeArgs a) {
  __shared__ BlockStart s;
  __shared__ uint64_t cycles0;
  prologue(a, kProbeSm, &s, &cycles0);
  if (s.bad) return;
  uint64_t steps = 0;
  const unsigned lane = threadIdx.x & 31u;
  Gaps g(s.start);
  if (!s.late) {
    float x = 1.0f + 1e-7f * static_cast<float>(threadIdx.x), m = 0.9999999f, c = 1e-7f;
    for (;;) {
      for (uint32_t i = 0; i < a.work_per_step; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x) : "f"(m), "f"(c));
      ++steps;
      uint64_t now = lane == 0 ? globalTimer() : 0;
      now = __shfl_sync(0xffffffffu, now, 0);
      g.step(now);
      if (now >= s.deadline) break;
    }
    if (x == 0.0f) steps |= 1ull << 63;  // keeps the chain live; x never reaches 0
  }
  __syncthreads();
  epilogue(a, s, cycles0, steps, g.maxGap, g.sum, 0);
}

// Memory-bandwidth share: a grid-stride stream over the buffer in 16-byte vectors, each element
// read and written back changed (so every step moves 32 bytes per element), wrapping around
// until the deadline. work = bytes the block moved.
extern "C" __global__ void cushare_probe_mem(ProbeArgs a) {
  __shared__ BlockStart s;
  __shared__ uint64_t cycles0;
  __shared__ unsigned long long blockBytes;
  if (threadIdx.x == 0) blockBytes = 0;
  prologue(a, kProbeMem, &s, &cycles0);
  if (s.bad) return;
  const unsigned lane = threadIdx.x & 31u;
  Gaps g(s.start);
  uint64_t moved = 0;
  if (!s.late) {
    uint4* buf = reinterpret_cast<uint4*>(a.buffer);
    const uint64_t n = a.buffer_bytes / 16;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint64_t i = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) % n;
    for (;;) {
#pragma unroll
      for (int u = 0; u < kMemUnroll; ++u) {
        uint4 v = buf[i];
        v.x += 1u;
        buf[i] = v;
        i += stride;
        if (i >= n) i %= n;
      }
      moved += 32u * kMemUnroll;
      uint64_t now = lane == 0 ? globalTimer() : 0;
      now = __shfl_sync(0xffffffffu, now, 0);
      g.step(now);
      if (now >= s.deadline) break;
    }
    atomicAdd(&blockBytes, static_cast<unsigned long long>(moved));
  }
  __syncthreads();
  epilogue(a, s, cycles0, blockBytes, g.maxGap, g.sum, 0);
}

// Timer tick and residency: warp 0's lane 0 reads %globaltimer in a loop until the deadline (the
// other threads leave at once). work = samples taken; tick_ns = the smallest non-zero step seen;
// gap_ns = the sum of steps over kGapThresholdNs (time the block was not resident); max_gap_ns =
// the largest step.
extern "C" __global__ void cushare_probe_tick(ProbeArgs a) {
  __shared__ BlockStart s;
  __shared__ uint64_t cycles0;
  prologue(a, kProbeTick, &s, &cycles0);
  if (s.bad) return;
  Gaps g(s.start);
  uint64_t samples = 0, tick = 0;
  if (!s.late && threadIdx.x == 0) {
    uint64_t now = s.start;
    while (now < s.deadline) {
      now = globalTimer();
      const uint64_t d = now - g.last;
      if (d != 0 && (tick == 0 || d < tick)) tick = d;
      g.step(now);
      ++samples;
    }
  }
  epilogue(a, s, cycles0, samples, g.maxGap, g.sum, tick);
}
