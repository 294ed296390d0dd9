// The shim's process state: configuration, the real driver, the tenant ledger and the devices
// this process sees. Initialised in two phases, each exactly once:
//  - process (at the first hooked call or cuInit): environment, real driver, ledger;
//  - devices (after the real cuInit succeeded): UUIDs, ledger entries, per-device limits.
// A failure in either is permanent and fails closed: cuInit and every memory hook return
// CUDA_ERROR_NOT_INITIALIZED after one log line; the tenant is never silently unlimited.
// Everything here is allocated once and never freed (cudart calls in during exit teardown).
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "cushare/host_segment.h"
#include "cushare/ledger.h"
#include "cushare/shim_config.h"

namespace cushare::shim {

inline constexpr int kMaxDevices = 64;

struct DeviceView {
  int ledgerIndex = -1;
  uint64_t envLimit = kUnlimited;  // from CUSHARE_MEMORY_LIMIT; the ledger's limit may be lower
  char uuid[48] = {};              // "GPU-..." as NVML reports it
};

struct ShimState {
  ShimConfig config;
  Ledger* ledger = nullptr;
  // A broker owns the ledger directory (its host segment is there): the ledger's limits are the
  // broker's, the environment may only lower them.
  bool brokerManaged = false;
  HostInfo host;  // when brokerManaged
  int deviceCount = 0;
  DeviceView devices[kMaxDevices];
};

// CUDA_SUCCESS once both phases are done; the failure otherwise (phase 2 not yet run reads as
// CUDA_ERROR_NOT_INITIALIZED, which is also what the real driver answers before cuInit).
CUresult devicesReady() noexcept;
// Runs phase 1 if needed; its result.
CUresult processReady() noexcept;
// Runs phase 2 (after the real cuInit succeeded).
CUresult initDevices() noexcept;
ShimState& state() noexcept;

// The limit in force for a device of this process: the lower of the environment's and the
// ledger's (which a broker may change while the process runs).
uint64_t effectiveLimit(int ordinal) noexcept;

}  // namespace cushare::shim
