// Memory elasticity's per-tick work in the broker (docs/memory-elasticity.md): what the tenants'
// bursts hold that the device would evict, published to every tenant of the device so that the
// free memory in each tenant's view counts it (a guaranteed tenant sees the room it was promised,
// not only what the device's free figure shows while bursts fill it).
//
// The same figures say how much of the bursts is on host memory (the bursts less what the device
// holds for them): per tenant, in proportion to its bursts, a gauge, and its rises summed into a
// counter (cushare_tenant_reclaimed_bytes_total). The driver evicts within the allocation that
// needs the room, so there is no reclaim time to measure here (perf/managed_evict_probe measures
// the allocation's). A burst that found no room from the start counts the same as one evicted.
//
// The estimate per memory group (a GPU, or a GPU instance whose MIG devices share its memory):
// the smaller of what the bursting tenants' ledgers hold above their guarantees (managed memory,
// resident or already evicted) and what the device holds that no process's NVML figure shows
// (NVML's per-process figures leave managed memory out: resident managed memory is there, with
// whatever else the device holds for no process). Stale by up to a tick; it can over-state the
// room for that long after bursts were evicted, never for longer.
#include <algorithm>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/log.h"
#include "cushare/limits_file.h"
#include "cushare/parse.h"

namespace cushare::broker {

void Broker::publishEvictableLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                                    const std::vector<uint64_t>& deviceUsed) {
  const size_t n = devices_.size();
  std::vector<uint64_t> bursts(n, 0), unshown(n, 0);
  bool anyBurst = false;
  for (auto& [name, t] : tenants_) {
    if (!t->ledger || t->entry.size() != n) continue;
    for (size_t d = 0; d < n; ++d) {
      const uint64_t g = d < t->burstAbove.size() ? t->burstAbove[d] : kNoLimit;
      if (g == kNoLimit || t->entry[d] < 0) continue;
      anyBurst = true;
      const size_t grp = std::min(devices_[d].group(d), n - 1);
      uint64_t used = 0;
      guarded([&] { used = t->ledger->used(t->entry[d]); });
      // Its limit bounds what its processes may hold: a forged row cannot inflate the estimate.
      const uint64_t limit = expectedLocked(*t, d);
      used = std::min(used, limit);
      bursts[grp] = addSaturated(bursts[grp], used > g ? used - g : 0);
    }
  }
  for (size_t d = 0; d < n && anyBurst; ++d) {
    if (unreadLocked(d) || d >= deviceUsed.size() || d >= onDevice.size()) continue;
    uint64_t shown = 0;
    for (const auto& [pid, bytes] : onDevice[d]) shown = addSaturated(shown, bytes);
    const size_t grp = std::min(devices_[d].group(d), n - 1);
    unshown[grp] = std::max(unshown[grp], deviceUsed[d] > shown ? deviceUsed[d] - shown : 0);
  }
  // Each bursting tenant's part of its group's bursts on host memory.
  std::vector<uint64_t> onHost(n, 0);
  for (size_t g = 0; g < n; ++g) onHost[g] = bursts[g] - std::min(bursts[g], unshown[g]);
  for (auto& [name, t] : tenants_) {
    t->burstHost.resize(n, 0);
    t->reclaimed.resize(n, 0);
    t->burstHostSaid.resize(n, 0);
    for (size_t d = 0; d < n; ++d) {
      const uint64_t g = d < t->burstAbove.size() ? t->burstAbove[d] : kNoLimit;
      const size_t grp = std::min(devices_[d].group(d), n - 1);
      uint64_t mine = 0;
      if (g != kNoLimit && t->ledger && t->entry.size() == n && t->entry[d] >= 0 && !unreadLocked(d) && bursts[grp] > 0) {
        uint64_t used = 0;
        guarded([&] { used = t->ledger->used(t->entry[d]); });
        used = std::min(used, expectedLocked(*t, d));
        const uint64_t burst = used > g ? used - g : 0;
        mine = static_cast<uint64_t>(static_cast<unsigned __int128>(onHost[grp]) * burst / bursts[grp]);
      } else if (unreadLocked(d)) {
        continue;  // kept as it was
      }
      if (mine > t->burstHost[d]) t->reclaimed[d] = addSaturated(t->reclaimed[d], mine - t->burstHost[d]);
      t->burstHost[d] = mine;
      if (mine >= (uint64_t{1} << 20) && !t->burstHostSaid[d]) {
        t->burstHostSaid[d] = 1;
        CUSHARE_BLOG(info,
                     "tenant {} device {}: about {} of its bursts are on host memory (the device evicted them for "
                     "allocations that needed the room, or they found none): it runs slower where it touches them",
                     name, devices_[d].name(), formatSize(mine));
      } else if (mine == 0 && t->burstHostSaid[d]) {
        t->burstHostSaid[d] = 0;
        CUSHARE_BLOG(info, "tenant {} device {}: its bursts are all on the device again", name, devices_[d].name());
      }
    }
  }
  for (auto& [name, t] : tenants_) {
    if (!t->ledger || t->entry.size() != n) continue;
    LimitsFile* limits = t->ledger->limitsFile();
    if (limits == nullptr) continue;
    for (size_t d = 0; d < n; ++d) {
      if (t->entry[d] < 0) continue;
      const size_t grp = std::min(devices_[d].group(d), n - 1);
      limits->setEvictable(t->entry[d], std::min(bursts[grp], unshown[grp]));
    }
  }
}

}  // namespace cushare::broker
