// The shim's process state: configuration, the real driver, the tenant ledger and the devices
// this process sees. Initialised in two phases, each exactly once:
//  - process (at the first hooked call, cuInit or nvmlInit): environment, real driver, ledger;
//  - devices (after the real cuInit succeeded): UUIDs, ledger entries, per-device limits.
// A failure in either is permanent and fails closed: cuInit and every memory hook return
// CUDA_ERROR_NOT_INITIALIZED after one log line; the tenant is never silently unlimited.
// A process that uses NVML before (or without) cuInit (nvidia-smi, pynvml) resolves the devices
// NVML shows it one at a time, by UUID, to the same ledger entries and limits (nvmlDeviceView);
// a failure there is permanent too and makes NVML's memory queries fail (NVML_ERROR_UNKNOWN).
// Everything here is allocated once and never freed (cudart calls in during exit teardown).
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "cushare/host_segment.h"
#include "cushare/ledger.h"
#include "cushare/limits_file.h"
#include "cushare/shim_config.h"

namespace cushare::shim {

inline constexpr int kMaxDevices = 64;

struct DeviceView {
  int ledgerIndex = -1;
  uint64_t envLimit = kUnlimited;  // from CUSHARE_MEMORY_LIMIT; the ledger's limit may be lower
  // The limit in force besides envLimit: under a broker its limits file's word for the entry
  // (cushare/limits_file.h: the tenant cannot write it), standalone the ledger's. Never null once
  // the view is published; detail::gUnpublished while the broker has not published the entry
  // (effectiveLimit then looks again and binds it once it is there).
  std::atomic<const std::atomic<uint64_t>*> limitWord{nullptr};
  char uuid[48] = {};              // "GPU-..." as NVML reports it, "MIG-..." for a MIG device
  // The broker's compute words for this device in the ledger (launch.cpp reads mode and gate).
  LedgerComputeDevice* compute = nullptr;
  // The driver can evict managed memory on this device (CONCURRENT_MANAGED_ACCESS): only then is
  // a bursting tenant's managed memory above its guarantee (docs/memory-elasticity.md).
  bool managedEvictable = false;
};

// The devices an NVML-only process has looked at, by UUID (NVML's numbering is not CUDA's).
// Entries are added under the init lock and published by the release store of nvmlCount.
struct NvmlDevices {
  std::atomic<int> count{0};
  DeviceView devices[kMaxDevices];
};

struct ShimState {
  ShimConfig config;
  Ledger* ledger = nullptr;
  // A broker owns the ledger directory (its host segment is there): the ledger's limits are the
  // broker's, the environment may only lower them.
  bool brokerManaged = false;
  HostInfo host;  // when brokerManaged
  // When brokerManaged, once the broker has published it; set under the init lock, never freed.
  std::atomic<LimitsFile*> limits{nullptr};
  int deviceCount = 0;
  DeviceView devices[kMaxDevices];
  NvmlDevices nvml;  // before cuInit only
};

// Read inline by every hooked call (the accessors below): one acquire load once initialised.
namespace detail {
extern ShimState* gState;               // set once phase 1 succeeded, never freed
extern std::atomic<int> gProcessPhase;  // 0 not run, 1 ok, 2 failed
extern std::atomic<int> gDevicePhase;   // the same for phase 2
CUresult runProcessPhase() noexcept;    // processReady's first call
// DeviceView::limitWord of a device of the host whose entry the broker has not published yet: 0.
extern const std::atomic<uint64_t> gUnpublished;
// Its limit: 0, or the broker's once it has published the entry (then bound for good). Cold.
uint64_t unpublishedLimit(const DeviceView& v) noexcept;
}  // namespace detail

// CUDA_SUCCESS once both phases are done; the failure otherwise (phase 2 not yet run reads as
// CUDA_ERROR_NOT_INITIALIZED, which is also what the real driver answers before cuInit).
inline CUresult devicesReady() noexcept {
  return detail::gDevicePhase.load(std::memory_order_acquire) == 1 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}
// Runs phase 1 if needed; its result.
inline CUresult processReady() noexcept {
  if (detail::gProcessPhase.load(std::memory_order_acquire) == 1) return CUDA_SUCCESS;
  return detail::runProcessPhase();
}
// Before the real cuInit (after phase 1): the MPS client environment set again (mps_env.h), under
// the init lock. CUDA_ERROR_NOT_INITIALIZED (logged) when it cannot be: cuInit fails closed.
CUresult prepareDriverInit() noexcept;
// Runs phase 2 (after the real cuInit succeeded).
CUresult initDevices() noexcept;
inline ShimState& state() noexcept { return *detail::gState; }

// The view of the device with this NVML UUID ("GPU-..."), for a process whose devices are not
// ready (no cuInit yet): found or resolved like a CUDA device (ledger entry, limits). Null after
// the one log line if that fails (and from then on).
const DeviceView* nvmlDeviceView(const char* uuid) noexcept;

// The limit in force for a device of this process: the lower of the environment's and the
// broker's (or, standalone, the ledger's), which a broker may change while the process runs.
inline uint64_t effectiveLimit(const DeviceView& v) noexcept {
  const std::atomic<uint64_t>* word = v.limitWord.load(std::memory_order_acquire);
  const uint64_t limit = word != &detail::gUnpublished ? word->load(std::memory_order_acquire)
                                                       : detail::unpublishedLimit(v);
  return v.envLimit < limit ? v.envLimit : limit;
}
inline uint64_t effectiveLimit(int ordinal) noexcept { return effectiveLimit(state().devices[ordinal]); }

// Bursting (docs/memory-elasticity.md): the most the tenant may hold on the device as memory the
// device cannot evict (its guarantee, read from the broker's limits file for the entry this
// process counts in); kUnlimited where it does not burst. Cold: only allocation paths read it.
inline uint64_t burstAbove(int ordinal) noexcept {
  const ShimState& s = state();
  if (!s.brokerManaged) return kUnlimited;
  const LimitsFile* f = s.limits.load(std::memory_order_acquire);
  const DeviceView& v = s.devices[ordinal];
  if (f == nullptr || v.limitWord.load(std::memory_order_acquire) != f->limitWord(v.ledgerIndex)) return kUnlimited;
  return f->burstAbove(v.ledgerIndex);
}
// Memory other tenants' bursts hold on the device that it would evict for an ordinary allocation
// (the broker's estimate, from the limits file; 0 standalone or before the entry is bound).
inline uint64_t othersEvictable(const DeviceView& v) noexcept {
  const ShimState& s = state();
  if (!s.brokerManaged) return 0;
  const LimitsFile* f = s.limits.load(std::memory_order_acquire);
  if (f == nullptr || v.limitWord.load(std::memory_order_acquire) != f->limitWord(v.ledgerIndex)) return 0;
  return f->evictable(v.ledgerIndex);
}
// The limit for memory the device cannot evict (everything but managed memory): the lower of the
// limit in force and, where the tenant bursts, its guarantee.
inline uint64_t plainLimit(int ordinal) noexcept {
  const uint64_t limit = effectiveLimit(ordinal);
  const uint64_t g = burstAbove(ordinal);
  return g < limit ? g : limit;
}
// The limit for managed memory: the limit in force where the driver can evict it, else plainLimit.
inline uint64_t managedLimit(int ordinal) noexcept {
  return state().devices[ordinal].managedEvictable ? effectiveLimit(ordinal) : plainLimit(ordinal);
}

}  // namespace cushare::shim
