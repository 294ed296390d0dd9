// A tenant's GPU busy time checked against the device's own count.
//
// The busy time that caps, priorities and chargeback run on is measured inside the tenant's
// processes (the shim's events or CUPTI, docs/compute.md), and a tenant controls its processes: a
// stand-in libcupti that never delivers a record, or a process that writes its compute slot,
// meters nothing while its kernels run. The device cannot be fooled: every tick the broker reads
// NVML's per-process utilization (ProcessBusyReader, devices.h: the percent of each sampling
// period during which a kernel of the process ran) and adds each process's busy time to the
// tenant it is attributed to (attributeLocked: the tenant whose ledger it maps). The scheduler
// then bills and charges the larger of what the processes metered and what the device counted
// (compute.cpp, TenantDevice::busyTotal), so a cap holds and chargeback is right whatever the
// tenant's metering says.
//
// Honest metering is never below the device's count for long: events time a stream from the
// launch to the completion marker, CUPTI times each kernel, and both are counted when the work
// completes, so a long kernel is metered at its end while the device counts it as it runs (billing
// the larger of the two cumulative totals counts it once). A tenant whose processes meter less
// than half of what the device counted (and at least kBusyFlagNs) over kBusyWindows windows of
// kBusyWindowNs in a row is flagged: one warning, cushare_tenant_tamper_total{kind="busy"};
// a window that agrees again clears it (one info line). A single kernel longer than those windows
// (3 s) is flagged too; it is billed right either way.
#include <algorithm>
#include <chrono>

#include "core/broker.h"
#include "core/log.h"

namespace cushare::broker {
namespace {

constexpr uint64_t kBusyWindowNs = 1'000'000'000;  // ticks come every 50 ms and at process exits
constexpr int kBusyWindows = 3;                 // windows in a row before a tenant is flagged
constexpr uint64_t kBusyFlagNs = 100'000'000;   // the least device time per window that can flag

double seconds(uint64_t ns) { return static_cast<double>(ns) / 1e9; }

uint64_t monotonicNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

void Broker::checkBusyLocked(const std::vector<std::map<int, uint64_t>>& busy) {
  const size_t n = devices_.size();
  for (auto& [name, t] : tenants_) t->deviceBusy.resize(n, 0);
  deviceBusyNs_.resize(n, 0);
  for (size_t d = 0; d < busy.size() && d < n; ++d)
    for (const auto& [pid, ns] : busy[d]) {
      deviceBusyNs_[d] = addSaturated(deviceBusyNs_[d], ns);  // the device's, whoever's process
      const auto p = deviceProcesses_.find(pid);
      if (p == deviceProcesses_.end() || p->second.tenant.empty()) continue;
      const auto t = tenants_.find(p->second.tenant);
      if (t != tenants_.end()) t->second->deviceBusy[d] += ns;
    }
  // Each tenant's metering against the device's count, window by window (the scheduler's totals).
  const uint64_t nowNs = monotonicNs();
  for (auto& [name, tp] : tenants_) {
    TenantState& t = *tp;
    t.busyWindows.resize(n);
    for (size_t d = 0; d < n; ++d) {
      TenantDeviceSnapshot now;
      computeSnapshotLocked(name, d, &now);
      TenantState::BusyWindow& w = t.busyWindows[d];
      // Nothing is metered where metering is off and the tenant is not paced: nothing to judge.
      const bool metering = config_.compute.metering || now.paced;
      if (!metering || w.startNs == 0 || now.meteredBusyNs < w.metered || now.deviceBusyNs < w.device) {
        w = TenantState::BusyWindow{nowNs, now.meteredBusyNs, now.deviceBusyNs, 0, w.flagged};
        continue;
      }
      if (nowNs - w.startNs < kBusyWindowNs) continue;
      const uint64_t metered = now.meteredBusyNs - w.metered, device = now.deviceBusyNs - w.device;
      const double windowS = seconds(nowNs - w.startNs);
      const bool low = device >= kBusyFlagNs && metered < device / 2;
      w.short_ = low ? w.short_ + 1 : 0;
      if (low && w.short_ >= kBusyWindows && !w.flagged) {
        w.flagged = true;
        tamperLocked(&t, "busy");
        CUSHARE_BLOG(warn,
                     "tenant {} device {}: its processes metered {:.3f} s of GPU time in the last {:.1f} s "
                     "where the device counted {:.3f} s for them; the device's count is charged and billed "
                     "(a metering source that does not see the work: a stand-in CUPTI library, written slots)",
                     name, devices_[d].name(), seconds(metered), windowS, seconds(device));
      } else if (!low && w.flagged) {
        w.flagged = false;
        CUSHARE_BLOG(info, "tenant {} device {}: its metering agrees with the device's count again", name,
                     devices_[d].name());
      }
      w = TenantState::BusyWindow{nowNs, now.meteredBusyNs, now.deviceBusyNs, w.short_, w.flagged};
    }
  }
}

}  // namespace cushare::broker
