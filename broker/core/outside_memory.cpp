// Memory held on the devices by processes outside cushare (Broker::checkOutsideLocked, broker.h).
//
// A GPU process that maps no tenant's ledger (started without the shim, by any user of the host)
// is no tenant's: no limit counts it, and the device can run out of memory before the tenants
// reach their limits. The broker cannot stop it (only MPS's pinned limit can, for MPS clients), but
// operators must see it: every tick it sums what the device's own accounting (NVML's per-process
// figures) shows for such processes, for `cushare status` and `cushare tenants`, the metric
// cushare_device_memory_outside_bytes and a warning once some has stayed kOutsideTicks ticks in a
// row (a process under the shim is attributed at its first look, so only a process that maps its
// ledger late can pass for outside for a tick or two). The warning is budgeted (any local user can
// start and stop GPU processes at will).
#include <algorithm>

#include "core/broker.h"
#include "core/log.h"
#include "cushare/parse.h"

namespace cushare::broker {
namespace {

constexpr int kOutsideTicks = 5;  // 250 ms

}  // namespace

void Broker::checkOutsideLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                                const std::vector<uint64_t>& deviceUsed) {
  outside_.resize(devices_.size());
  for (size_t d = 0; d < outside_.size(); ++d) {
    OutsideDevice& o = outside_[d];
    std::vector<std::pair<uint64_t, int>> held;  // bytes, host pid
    if (d < onDevice.size())
      for (const auto& [pid, bytes] : onDevice[d]) {
        const auto it = deviceProcesses_.find(pid);
        if (bytes != 0 && (it == deviceProcesses_.end() || it->second.tenant.empty())) held.emplace_back(bytes, pid);
      }
    std::sort(held.begin(), held.end(), std::greater<>());
    o.read = d < deviceUsed.size() && !unreadLocked(d);
    o.deviceUsed = o.read ? deviceUsed[d] : 0;
    o.bytes = 0;
    o.pids.clear();
    for (const auto& [bytes, pid] : held) {
      o.bytes += bytes;
      o.pids.push_back(pid);
    }
    o.ticks = o.bytes == 0 ? 0 : o.ticks + 1;
    if (o.ticks == kOutsideTicks && !o.warned) {
      o.warned = true;
      std::string who, more;
      for (size_t i = 0; i < held.size() && i < 4; ++i)
        who += (i == 0 ? "" : ", ") + std::string("pid ") + std::to_string(held[i].second) + " " +
               formatSize(held[i].first);
      if (held.size() > 4) who += ", ...";
      if (strangersLog_.allow(&more))
        CUSHARE_BLOG(warn,
                     "device {}: {} held by {} process(es) outside cushare ({}): no tenant's limit counts it, "
                     "and the device can run out of memory before the tenants reach their limits{}",
                     devices_[d].name(), formatSize(o.bytes), held.size(), who, more);
    } else if (o.ticks == 0 && o.warned) {
      o.warned = false;
      std::string more;
      if (strangersLog_.allow(&more))
        CUSHARE_BLOG(info, "device {}: no memory held outside cushare any more{}", devices_[d].name(), more);
    }
  }
}

}  // namespace cushare::broker
