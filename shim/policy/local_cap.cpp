// A process's own lower cap and priority on each device (docs/compute.md, "Lowering from the
// environment"): CUSHARE_THREAD_PERCENTAGE below 100, or CUSHARE_PRIORITY below its tenant's while
// a higher priority is active among the other tenants. The pacer keeps the budget (its pass calls
// updateLocal per device, under gPacerMutex); the launch path reads the local gate and tight bit.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "policy/pacer.h"
#include "runtime/mps_env.h"
#include "runtime/state.h"

namespace cushare::shim {

namespace {
// Budgets refill over this period; unused credit never exceeds one period's share.
constexpr uint64_t kLocalPeriodNs = 100'000'000;
}  // namespace

constinit LocalCap gLocal[kMaxDevices];
constinit std::atomic<uint32_t> gLocalAny{0};

// The local cap of a device, from the environment and the broker's words: the environment's cap
// when below 100 %; when CUSHARE_PRIORITY is below the tenant's and the broker publishes that a
// higher priority than the process's own is active among the other tenants, the floor too, with
// one launch in flight (what the broker does to a lower-priority tenant). None for an MPS client
// (its server enforces the same settings as its share of the SMs; a time budget on top would
// apply them twice, even where its tenant is paced because of a sibling outside MPS) or where the
// device is not metered (nothing measured).
uint64_t updateLocal(int dev, const LedgerComputeDevice* c, uint64_t now) noexcept {
  LocalCap& lc = gLocal[dev];
  const ShimConfig& cfg = state().config;
  const uint32_t mode = c->mode.load(std::memory_order_acquire);
  uint32_t cap = kComputeNoCap;
  bool tight = false;
  if ((mode & kComputeModeMask) != 0 && !mpsClient()) {
    if (cfg.threadPercentage && *cfg.threadPercentage < 100) cap = static_cast<uint32_t>(*cfg.threadPercentage) * 100;
    const uint32_t own = cfg.priority == Priority::kHigh ? 0 : cfg.priority == Priority::kLow ? 2 : 1;
    const uint32_t others = c->others.load(std::memory_order_relaxed);
    const uint32_t tenantBand = c->priority.load(std::memory_order_relaxed);
    // The broker's heartbeat moves gate_epoch every 500 ms: standing still for kBrokerGoneNs, the
    // broker is gone and what it published about the others is stale (not yielded to).
    const uint32_t epoch = c->gate_epoch.load(std::memory_order_relaxed);
    if (epoch != lc.epoch || lc.epochSince == 0) {
      lc.epoch = epoch;
      lc.epochSince = now;
    }
    const bool brokerAlive = now - lc.epochSince < kBrokerGoneNs;
    if (brokerAlive && (others & kOthersValid) != 0 && own > tenantBand && (others & 3u) < own) {
      const uint32_t floor = std::max(1u, std::min(100u, (others >> 8) & 0xFFu)) * 100;
      cap = std::min(cap, floor);
      tight = true;
    }
  }
  const bool on = cap < kComputeNoCap || tight;
  const int64_t quantum = static_cast<int64_t>(kLocalPeriodNs * cap / kComputeNoCap);
  if (!on) {
    lc.cap = kComputeNoCap;
    lc.used.store(0, std::memory_order_relaxed);
    lc.on.store(0, std::memory_order_relaxed);
    lc.tight.store(0, std::memory_order_relaxed);
    if (lc.gate.exchange(kGateOpen, std::memory_order_seq_cst) != kGateOpen) futexWake(&lc.gate, false);
    return 0;
  }
  if (lc.cap == kComputeNoCap || lc.last == 0) {  // just in force: a full period's budget
    lc.credit = quantum;
    lc.last = now;
    lc.used.store(0, std::memory_order_relaxed);
  }
  lc.cap = cap;
  // Refill at the cap's rate, charge what ran; debt carries over, unused credit does not pile up.
  lc.credit += static_cast<int64_t>((now - lc.last) * cap / kComputeNoCap);
  lc.last = now;
  lc.credit -= static_cast<int64_t>(lc.used.exchange(0, std::memory_order_relaxed));
  lc.credit = std::min(lc.credit, quantum);
  lc.tight.store(tight ? 1 : 0, std::memory_order_relaxed);
  lc.on.store(1, std::memory_order_release);
  const uint32_t want = lc.credit > 0 ? kGateOpen : kGateClosed;
  if (lc.gate.exchange(want, std::memory_order_seq_cst) != want && want == kGateOpen) futexWake(&lc.gate, false);
  return lc.credit > 0 ? 0 : static_cast<uint64_t>(-lc.credit) * kComputeNoCap / cap + 1;
}

void resetLocalAfterFork() noexcept {
  for (LocalCap& lc : gLocal) {  // the child starts its own budget (its pacer sets it)
    lc.cap = kComputeNoCap;
    lc.last = 0;
    lc.on.store(0);
    lc.tight.store(0);
    lc.gate.store(kGateOpen);
  }
  gLocalAny.store(0);
}

}  // namespace cushare::shim
