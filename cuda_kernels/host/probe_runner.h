// ProbeRunner: loads the probe kernels (cuda_kernels/probes.cu, built into probes.fatbin) into
// one CUDA context and runs probe rounds in it (docs/probes.md, "Runner").
//
// Driver API only (no runtime API, no global state, no logging): meant to be called by the shim
// off the application's launch path, on a thread of its own, in the tenant's context.
// - load() reads the fatbin, loads it with cuModuleLoadData into the context current on the
//   calling thread, looks up the three kernels and allocates everything a round needs (device t0
//   words, device and host records, the memory probe's buffer). Nothing is allocated after it.
// - runRound() pushes that context, zeroes the t0 words and records, launches the chosen probes
//   back to back on the given stream, waits for them, copies the records back and pops the
//   context. The records stay valid until the next runRound() or the runner's destruction.
// - Every failure is a ProbeError naming the step and the CUresult (cuGetErrorName); nothing
//   throws. A runner whose load() failed holds nothing.
// Invariants: the runner's device memory and module live exactly as long as the runner; one
// round at a time per runner (the caller serialises); t0 words are zero before every launch.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cushare/probe_abi.h"

namespace cushare::probe {

// Which probes a round runs (bits).
enum ProbeSet : uint32_t { kRunSm = 1u << 0, kRunMem = 1u << 1, kRunTick = 1u << 2, kRunAll = 7u };

struct RunnerOptions {
  uint64_t memBufferBytes = 256ull << 20;  // memory probe buffer; several times the L2 (H200: 60 MiB)
  uint32_t smBlocksPerSm = 1;              // SM probe grid = SMs x this
  uint32_t memBlocksPerSm = 2;             // memory probe grid = SMs x this
  uint32_t smThreads = 128;                // threads per block (whole warps)
  uint32_t memThreads = 256;
  uint32_t workPerStep = kProbeWorkPerStep;  // SM probe: dependent FMAs per progress step
};

struct ProbeBudgets {  // each probe's time box, ns from its first block's start
  uint64_t smNs = 200'000;
  uint64_t memNs = 150'000;
  uint64_t tickNs = 100'000;
};

// A failure: the step that failed and why. result CUDA_SUCCESS and sysErrno 0: no error.
struct ProbeError {
  const char* step = nullptr;  // static text: "cuModuleLoadData", "read fatbin", ...
  CUresult result = CUDA_SUCCESS;
  int sysErrno = 0;            // for file steps
  explicit operator bool() const { return result != CUDA_SUCCESS || sysErrno != 0; }
  // "cuModuleLoadData: CUDA_ERROR_NO_BINARY_FOR_GPU (no kernel image is available ...)"
  std::string message() const;
};

// One probe launch of a round.
struct ProbeRun {
  ProbeKind kind = kProbeSm;
  uint32_t blocks = 0;                  // 0: not run this round
  uint32_t threads = 0;
  uint64_t budgetNs = 0;
  uint64_t launchRealtimeNs = 0;        // CLOCK_REALTIME just before cuLaunchKernel
  uint64_t launchMonotonicNs = 0;       // CLOCK_MONOTONIC just before cuLaunchKernel
  std::span<const BlockRecord> records; // one per block
};

struct RoundRecords {
  ProbeRun tick, sm, mem;  // launched in this order
};

// A round's GPU cost by its records, in us of whole-device time: the sum over every block that ran
// (or wrote a late record) of its resident time (end - start - gaps), over the device's SMs, as if
// each block held a whole SM (docs/probes.md, "Cost of a round").
double roundCostUs(const RoundRecords& r, uint32_t sms);

class ProbeRunner {
 public:
  // Loads the fatbin at fatbinPath into the calling thread's current context (which must be
  // set) and prepares rounds; *out is set only on success.
  static ProbeError load(const char* fatbinPath, const RunnerOptions& opts, std::unique_ptr<ProbeRunner>* out);
  ~ProbeRunner();
  ProbeRunner(const ProbeRunner&) = delete;
  ProbeRunner& operator=(const ProbeRunner&) = delete;

  // Runs the probes in `what` (ProbeSet bits) on `stream` (of the runner's context; 0: its
  // default stream) and waits for them. On success *out describes each probe (blocks == 0 for
  // those not run).
  ProbeError runRound(CUstream stream, uint32_t what, const ProbeBudgets& budget, RoundRecords* out) noexcept;

  // The context was destroyed under the runner (its program released or reset it): every handle
  // died with it; forget them without a driver call (the destructor then makes none).
  void abandon() noexcept;
  // Whether the runner's device memory is still the allocation it made (its buffer id, which the
  // driver never reuses): false once its context was destroyed, even if a new one took its handle.
  bool ownsItsMemory() const noexcept;

  CUcontext context() const { return ctx_; }
  uint32_t smCount() const { return sms_; }  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  const RunnerOptions& options() const { return opts_; }

 private:
  ProbeRunner() = default;
  ProbeError launch(CUstream stream, CUfunction f, ProbeKind kind, uint32_t slot, uint32_t blocks, uint32_t threads,
                    uint64_t budgetNs, uint64_t records, ProbeRun* run) noexcept;
  void release() noexcept;

  RunnerOptions opts_;
  CUcontext ctx_ = nullptr;
  CUmodule module_ = nullptr;
  CUfunction fn_[3] = {};          // sm, mem, tick
  uint32_t sms_ = 0;
  uint32_t smBlocks_ = 0, memBlocks_ = 0, tickBlocks_ = 1;
  CUdeviceptr t0_ = 0;             // three uint64_t words: sm, mem, tick
  unsigned long long t0Id_ = 0;    // t0_'s CU_POINTER_ATTRIBUTE_BUFFER_ID
  CUdeviceptr records_ = 0;        // BlockRecord[smBlocks_ + memBlocks_ + tickBlocks_]
  CUdeviceptr buffer_ = 0;         // memory probe buffer
  std::vector<BlockRecord> host_;  // copies of the records, same layout
};

}  // namespace cushare::probe
