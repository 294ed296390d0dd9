// The probe kernels' ABI: what cuda_kernels/probes.cu takes and writes, what simgpu's native
// twins of those kernels write, and what the host-side analysis (probe analysis library) reads.
//
// Fixed layout, little-endian, no pointers but device addresses (uint64_t). Every kernel takes
// exactly one parameter, a ProbeArgs by value. A change to any struct here is a new
// kProbeAbiVersion; kernels check args.abi_version and write nothing (every record flagged
// kProbeBadArgs in the first record only) on a mismatch.
//
// Time-boxing: the first block of a probe to start stores its %globaltimer into *t0 (atomic
// compare-and-swap from 0; the host zeroes it before the launch). Every block stops working at
// *t0 + budget_ns. A block that starts after that deadline writes its record with kProbeLate and
// does no work. So one probe launch costs at most about budget_ns of each SM it occupies, however
// contended the device is, and a probe that could not run in its window is a missing sample,
// never a share of zero.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cushare::probe {

inline constexpr uint32_t kProbeAbiVersion = 1;
// The SM probe's dependent FMAs per progress step that the shim's runner uses (RunnerOptions):
// the broker's solo baseline is for this value, whatever a tenant's records claim.
inline constexpr uint32_t kProbeWorkPerStep = 256;

// Kernel names (extern "C", so the same in the fatbin, in simgpu's table and in cuModuleGetFunction).
inline constexpr const char* kSmProbeName = "cushare_probe_sm";      // SM share
inline constexpr const char* kMemProbeName = "cushare_probe_mem";    // memory-bandwidth share
inline constexpr const char* kTickProbeName = "cushare_probe_tick";  // timer tick, residency gaps

enum ProbeKind : uint32_t { kProbeSm = 1, kProbeMem = 2, kProbeTick = 3 };

// Record flags.
inline constexpr uint32_t kProbeRan = 1u << 0;      // the block ran and its fields are valid
inline constexpr uint32_t kProbeLate = 1u << 1;     // started after t0 + budget: did no work
inline constexpr uint32_t kProbeBadArgs = 1u << 2;  // args rejected (version, sizes): nothing measured
inline constexpr uint32_t kProbeMigrated = 1u << 3; // sm_end != sm_start (preempted and moved)

struct ProbeArgs {
  uint32_t abi_version;    // kProbeAbiVersion
  uint32_t kind;           // ProbeKind, must match the kernel launched
  uint64_t budget_ns;      // time box, from *t0
  uint64_t t0;             // device address of one uint64_t, zero before the launch
  uint64_t records;        // device address of BlockRecord[record_count]
  uint32_t record_count;   // >= gridDim.x (one record per block); fewer: kProbeBadArgs
  uint32_t work_per_step;  // SM probe: dependent FMAs per progress step; tick: unused
  uint64_t buffer;         // memory probe: device address of the streamed buffer
  uint64_t buffer_bytes;   // memory probe: its size (multiple of 16 bytes)
  uint64_t reserved[2];    // zero
};
static_assert(sizeof(ProbeArgs) == 72, "ProbeArgs is a fixed ABI");

// One record per block, written by thread 0 of the block.
struct BlockRecord {
  uint64_t start_ns;    // %globaltimer at the block's entry
  uint64_t end_ns;      // %globaltimer at its exit
  uint32_t sm_start;    // %smid at entry (virtual per MPS client: compare only within one probe)
  uint32_t sm_end;      // %smid at exit
  uint32_t flags;       // kProbe*
  uint32_t reserved0;
  uint64_t cycles;      // clock64() difference, entry to exit
  uint64_t work;        // SM: progress steps done; mem: bytes moved; tick: timer samples taken
  uint64_t max_gap_ns;  // the largest step between two consecutive timer reads (not resident)
  uint64_t gap_ns;      // sum of the steps above gap_threshold (time not resident; tick probe)
  uint64_t tick_ns;     // tick probe: the smallest non-zero step of the timer seen; else 0
};
static_assert(sizeof(BlockRecord) == 72, "BlockRecord is a fixed ABI");
static_assert(offsetof(BlockRecord, cycles) == 32, "BlockRecord is a fixed ABI");

// A step between two timer reads longer than this counts as a gap (the block was not resident).
inline constexpr uint64_t kGapThresholdNs = 4000;

}  // namespace cushare::probe
