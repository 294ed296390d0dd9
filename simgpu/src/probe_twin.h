// The probe kernels' native twins (docs/simgpu.md, "Probe kernels"): when a program launches a
// kernel named as in cushare/probe_abi.h, simgpu runs its blocks in the engine time-boxed
// (KernelShape::timeBoxNs) and traced (BlockObserver), and writes into args.records what the real
// kernel would have measured of what the engine gave each block.
//
// Pure logic, no driver state: events -> per-block traces (BlockTrace, what an MPS server sends
// its client) -> records. The constants below are guesses about real GPUs, marked as such in the
// docs and measured by perf/gpu_check.sh.
//
// Invariants: a block that never started has no kProbeRan; timer values are multiples of the
// tick; a record's end_ns >= start_ns; gaps are counted only from the engine's saves.
#pragma once

#include <cstdint>
#include <vector>

#include "cushare/probe_abi.h"
#include "engine.h"

namespace simgpu {

inline constexpr uint64_t kProbeTimerTickNs = 1000;     // %globaltimer's tick (a guess: 1 us on some GPUs)
inline constexpr uint64_t kProbeLateBlockNs = 1000;     // a late block's life: reads the timer, writes its record
inline constexpr uint64_t kProbeClockKHz = 1'980'000;   // clock64() rate: an H200 loaded (1980 MHz)
inline constexpr uint64_t kProbeFmaPerUs = 495;         // one dependent FMA per 4 cycles at 1980 MHz
inline constexpr uint64_t kProbeDeviceBytesPerUs = 4'800'000;  // H200 HBM3e, 4.8 TB/s, split per SM
inline constexpr uint64_t kProbeTimerReadNs = 32;       // tick probe: one %globaltimer read per loop
inline constexpr uint32_t kProbeMaxTracedBlocks = 2048; // a probe grid simgpu traces (larger: refused)

// What the engine gave one block of a traced kernel.
struct BlockTrace {
  uint64_t startNs = 0;    // first start (0 with started == 0: never ran)
  uint64_t endNs = 0;
  uint64_t residentNs = 0; // time on an SM
  uint64_t gapSumNs = 0;   // sum of the quantised saved-out gaps over kGapThresholdNs
  uint64_t gapMaxNs = 0;   // the largest quantised saved-out gap
  uint32_t smFirst = 0, smLast = 0;
  uint32_t started = 0;    // times it started or resumed
  uint32_t ended = 0;      // 1 once it ended
};
static_assert(sizeof(BlockTrace) == 56, "BlockTrace travels on the MPS wire");

// Folds one kernel's events (in the order the engine reported them) into its blocks' traces.
void foldBlockEvents(const std::vector<BlockEvent>& events, uint64_t blocks, std::vector<BlockTrace>* out);

// The kernel's own argument checks (version, kind, records and t0 present, record_count >= grid,
// a 1-D grid of whole warps, the SM probe's work_per_step, the memory probe's buffer).
bool probeArgsValid(const cushare::probe::ProbeArgs& a, uint32_t kind, const unsigned grid[3], const unsigned block[3]);

// The records the real kernel would write for these traces; *t0 is what it leaves in args.t0.
// smIds: the id each physical SM reads as %smid (virtual per MPS client; empty: the physical id).
void probeRecords(const cushare::probe::ProbeArgs& a, uint32_t kind, uint32_t threads, const std::vector<BlockTrace>& traces,
                  const std::vector<uint32_t>& smIds, uint32_t deviceSms,
                  std::vector<cushare::probe::BlockRecord>* out, uint64_t* t0);

// A permutation of [0, sms) from seed: an MPS client's virtual SM ids.
std::vector<uint32_t> virtualSmIds(uint32_t sms, uint64_t seed);

}  // namespace simgpu
