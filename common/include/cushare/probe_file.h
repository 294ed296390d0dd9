// The tenant's probe file (docs/probes.md, "Rounds"): where a process of the tenant writes the
// records of a probe round the broker asked for (LedgerComputeDevice::probe_*), and the broker
// reads them. `<ledger_dir>/<tenant>.probe`, created by the broker with the ledger's owner, group
// and mode; fixed size (kProbeFileBytes); little-endian.
//
// The writer (the shim) writes the records and the launches with pwrite, then the header with
// `seq` last; the reader (the broker) reads the file with pread (never maps it: a tenant that
// truncates it makes a short read, not a SIGBUS), checks magic, version, sizes and that `seq` is
// the request's, and analyses the records as untrusted input (cushare/probe_analysis.h). A tenant
// can only falsify its own numbers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cushare/probe_abi.h"

namespace cushare::probe {

inline constexpr uint64_t kProbeFileMagic = 0x424f5250'48535543ull;  // "CUSHPROB"
inline constexpr uint32_t kProbeFileVersion = 1;
inline constexpr uint32_t kProbeFileMaxRecords = 1024;  // SM probe 1/SM + memory 2/SM + tick 1

// Why a round did not run (ProbeFileHeader::status); 0: it ran.
enum ProbeFileStatus : int32_t {
  kProbeOk = 0,
  kProbeNoFatbin = 1,      // probes.fatbin not found beside the shim
  kProbeLoadFailed = 2,    // the runner could not load or prepare (error says why)
  kProbeRunFailed = 3,     // a launch or copy failed (error says why)
  kProbeTooManyRecords = 4 // the device has more SMs than the file holds records for
};

struct ProbeFileLaunch {
  uint32_t kind;          // ProbeKind; 0: not run this round
  uint32_t blocks;        // records of this launch
  uint32_t threads;       // per block
  uint32_t work_per_step; // SM probe's
  uint64_t budget_ns;
  uint64_t launch_realtime_ns;   // CLOCK_REALTIME just before the launch
  uint64_t launch_monotonic_ns;  // CLOCK_MONOTONIC just before the launch
  uint32_t first_record;  // index of its first record
  uint32_t reserved;
};
static_assert(sizeof(ProbeFileLaunch) == 48);

struct ProbeFileHeader {
  uint64_t magic;        // kProbeFileMagic
  uint32_t version;      // kProbeFileVersion
  uint32_t max_records;  // kProbeFileMaxRecords
  uint32_t seq;          // the request (probe_seq) these results answer; written last
  uint32_t entry;        // the ledger device entry it was asked on
  int32_t status;        // ProbeFileStatus
  uint32_t sm_count;     // multiprocessors of the device
  uint64_t at_ns;        // the instant asked for (CLOCK_REALTIME)
  uint64_t done_ns;      // CLOCK_REALTIME when the records were written
  ProbeFileLaunch launches[3];  // tick, SM, memory (the order they are launched in)
  char error[64];        // status != 0: why, NUL-terminated
};
static_assert(sizeof(ProbeFileHeader) == 256);
static_assert(offsetof(ProbeFileHeader, seq) == 16);

inline constexpr size_t kProbeFileRecordsOffset = sizeof(ProbeFileHeader);
inline constexpr size_t kProbeFileBytes = kProbeFileRecordsOffset + sizeof(BlockRecord) * kProbeFileMaxRecords;

}  // namespace cushare::probe
