// The tenant's probe file (docs/probes.md, "Rounds"): where a process of the tenant writes the
// records of a probe round the broker asked for (LedgerComputeDevice::probe_*), and the broker
// reads them. `<ledger_dir>/<tenant>.probe`, created by the broker with the ledger's owner, group
// and mode; fixed size (kProbeFileBytes); little-endian.
//
// The writer (the shim) writes an answer's records and launches with pwrite, then its header
// with `seq` last; the reader (the broker) reads the file with pread (never maps it: a tenant that
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
// Answers are kept in kProbeFileAnswers slots (request seq % slots), so that a process that
// answers several requests in a row (its probes waited for the tenant's turn) overwrites none
// the broker has not read.
inline constexpr uint32_t kProbeFileAnswers = 8;
inline constexpr uint32_t kProbeFileMaxRecords = 512;  // per answer: SM 1/SM + memory 2/SM + tick 1

// Why a round did not run (ProbeAnswerHeader::status); 0: it ran.
enum ProbeFileStatus : int32_t {
  kProbeOk = 0,
  kProbeNoFatbin = 1,       // probes.fatbin not found beside the shim
  kProbeLoadFailed = 2,     // the runner could not load or prepare (error says why)
  kProbeRunFailed = 3,      // a launch or copy failed, or the instant was missed (error says why)
  kProbeTooManyRecords = 4  // the device has more SMs than an answer holds records for
};

struct ProbeFileLaunch {
  uint32_t kind;          // ProbeKind; 0: not run this round
  uint32_t blocks;        // records of this launch
  uint32_t threads;       // per block
  uint32_t work_per_step; // SM probe's
  uint64_t budget_ns;
  uint64_t launch_realtime_ns;   // CLOCK_REALTIME just before the launch
  uint64_t launch_monotonic_ns;  // CLOCK_MONOTONIC just before the launch
  uint32_t first_record;  // index of its first record within the answer
  uint32_t reserved;
};
static_assert(sizeof(ProbeFileLaunch) == 48);

// The file's first 64 bytes, written by the broker when it creates the file.
struct ProbeFileHeader {
  uint64_t magic;        // kProbeFileMagic
  uint32_t version;      // kProbeFileVersion
  uint32_t answers;      // kProbeFileAnswers
  uint32_t max_records;  // kProbeFileMaxRecords (per answer)
  uint32_t reserved[11];
};
static_assert(sizeof(ProbeFileHeader) == 64);

// An answer's header; its records follow it.
struct ProbeAnswerHeader {
  uint32_t seq;          // the request (probe_seq) it answers; written last (0: none)
  uint32_t entry;        // the ledger device entry it was asked on
  int32_t status;        // ProbeFileStatus
  uint32_t sm_count;     // multiprocessors of the device
  uint64_t at_ns;        // the instant asked for (CLOCK_REALTIME)
  uint64_t done_ns;      // CLOCK_REALTIME when the records were written
  ProbeFileLaunch launches[3];  // tick, SM, memory (the order they are launched in)
  char error[64];        // status != 0: why, NUL-terminated
  uint32_t flags;        // kAnswer* below
  uint8_t reserved[28];
};
// The probe thread was idle when the instant came (it had answered every earlier request): a
// launch later than the instant is then the host's CPU delay, and the broker judges the probe's
// wait from the launch (docs/probe-analysis.md). Without it (a request queued behind one that
// waited at the tenant's gate) the wait counts from the instant.
inline constexpr uint32_t kAnswerIdleAtInstant = 1;
// The round's first launch waited at the tenant's closed compute gate (the device paced and the
// tenant not holding it), or the round's instant came while the probe thread waited at that gate
// for an earlier round: a wait, however soon the gate opened (docs/probe-analysis.md).
inline constexpr uint32_t kAnswerFirstLaunchWaitedAtGate = 2;
static_assert(sizeof(ProbeAnswerHeader) == 272);

inline constexpr size_t kProbeAnswerBytes = sizeof(ProbeAnswerHeader) + sizeof(BlockRecord) * kProbeFileMaxRecords;
inline constexpr size_t kProbeFileBytes = sizeof(ProbeFileHeader) + kProbeAnswerBytes * kProbeFileAnswers;
// Where request seq's answer goes.
constexpr size_t probeAnswerOffset(uint32_t seq) {
  return sizeof(ProbeFileHeader) + kProbeAnswerBytes * (seq % kProbeFileAnswers);
}

}  // namespace cushare::probe
