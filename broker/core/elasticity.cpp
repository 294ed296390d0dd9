// Memory elasticity's per-tick work in the broker (docs/memory-elasticity.md): what the tenants'
// bursts hold that the device would evict, published to every tenant of the device so that the
// free memory in each tenant's view counts it (a guaranteed tenant sees the room it was promised,
// not only what the device's free figure shows while bursts fill it).
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
