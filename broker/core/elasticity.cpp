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

// ---- Reclaim of plain bursts ----
//
// A tenant within its guarantee whose ordinary allocation the driver refuses while other tenants
// hold plain bursts in the memory group posts what it waits for in its ledger (want_bytes,
// want_ns: refreshed while it waits, at most elasticity.reclaim_wait_ms) and retries. Each tick:
// - the need of a group is what its tenants wait for, each believed only while fresh, only up to
//   its guarantee (its limit if it does not burst), and only while it holds no more than that (a
//   tenant cannot ask others to make room for its own bursts);
// - while there is a need, the plain bursters of the group get a target (its limits file's
//   reclaim_target, reclaim_seq moving): what they held when the episode began less their share of
//   the need, in proportion to their bursts, never below their guarantees; their shims wake
//   whoever polls cushare_reclaim_fd;
// - past elasticity.reclaim_deadline_ms, a burster still above its target is held to its guarantee
//   (its published limit: its allocations above it are refused; nothing it holds is taken);
// - two ticks without a need end the episode: targets and clamps are lifted, what each burster
//   gave back is counted (cushare_tenant_reclaimed_bytes_total) and logged with the time it took to
//   reach its target.
void Broker::reclaimLocked() {
  const size_t n = devices_.size();
  reclaim_.resize(n);
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  const uint64_t now = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  const uint64_t fresh = (static_cast<uint64_t>(config_.elasticity.reclaimWaitMs) + 200) * 1000000ull;
  std::vector<uint64_t> need(n, 0), plainBursts(n, 0);
  std::vector<std::vector<TenantState*>> bursters(n);
  for (auto& [name, t] : tenants_) {
    t->reclaimFrom.resize(n, 0);
    t->reclaimTarget.resize(n, kNoLimit);
    t->reclaimReachedNs.resize(n, 0);
    t->reclaimClamp.resize(n, kNoLimit);
    t->reclaimSeconds.resize(n, 0);
    if (!t->ledger || t->entry.size() != n) continue;
    for (size_t d = 0; d < n; ++d) {
      const int e = t->entry[d];
      if (e < 0) continue;
      const size_t grp = std::min(devices_[d].group(d), n - 1);
      uint64_t used = 0, want = 0, wantNs = 0;
      if (!guarded([&] {
            used = t->ledger->used(e);
            want = t->ledger->wantBytes(e);
            wantNs = t->ledger->wantNs(e);
          }))
        continue;
      const uint64_t g = d < t->guaranteeOf.size() && t->guaranteeOf[d] != kNoLimit ? t->guaranteeOf[d] : expectedLocked(*t, d);
      if (want != 0 && wantNs <= now && now - wantNs <= fresh && used <= g) need[grp] = addSaturated(need[grp], std::min(want, g));
      if (t->config.burst == BurstMode::kPlain && t->guaranteeOf.size() == n && t->guaranteeOf[d] != kNoLimit) {
        const uint64_t burst = used > t->guaranteeOf[d] ? used - t->guaranteeOf[d] : 0;
        plainBursts[grp] = addSaturated(plainBursts[grp], burst);
        bursters[grp].push_back(t.get());
      }
    }
  }
  // Every tenant is told where others' plain bursts may be waited for, and for how long.
  for (auto& [name, t] : tenants_) {
    if (!t->ledger || t->entry.size() != n) continue;
    LimitsFile* limits = t->ledger->limitsFile();
    if (limits == nullptr) continue;
    uint64_t mask = 0;
    for (size_t d = 0; d < n; ++d) {
      const int e = t->entry[d];
      if (e < 0) continue;
      const size_t grp = std::min(devices_[d].group(d), n - 1);
      for (TenantState* b : bursters[grp])
        if (b != t.get()) mask |= uint64_t{1} << e;
    }
    limits->setPlainMask(mask, config_.elasticity.reclaimWaitMs);
  }
  for (size_t grp = 0; grp < n; ++grp) {
    ReclaimEpisode& ep = reclaim_[grp];
    // A burster's entries on the group's devices (one per tenant: a tenant has one device of a group).
    auto deviceOf = [&](TenantState* b) -> size_t {
      for (size_t d = 0; d < n; ++d)
        if (std::min(devices_[d].group(d), n - 1) == grp && d < b->entry.size() && b->entry[d] >= 0) return d;
      return n;
    };
    if (need[grp] > 0 && plainBursts[grp] > 0) {
      ep.quiet = 0;
      if (!ep.active) {
        ep = ReclaimEpisode{};
        ep.active = true;
        ep.startNs = now;
        for (TenantState* b : bursters[grp])
          if (const size_t d = deviceOf(b); d < n) {
            guarded([&] { b->reclaimFrom[d] = b->ledger->used(b->entry[d]); });
            b->reclaimReachedNs[d] = 0;
          }
      }
      ep.need = std::max(ep.need, need[grp]);
      uint64_t from = 0;  // the bursts when the episode began
      for (TenantState* b : bursters[grp])
        if (const size_t d = deviceOf(b); d < n && b->reclaimFrom[d] > b->guaranteeOf[d])
          from = addSaturated(from, b->reclaimFrom[d] - b->guaranteeOf[d]);
      for (TenantState* b : bursters[grp]) {
        const size_t d = deviceOf(b);
        if (d >= n) continue;
        const uint64_t g = b->guaranteeOf[d];
        const uint64_t mine = b->reclaimFrom[d] > g ? b->reclaimFrom[d] - g : 0;
        // Its share of the need, rounded up (the shares cover it), never below its guarantee.
        const uint64_t share =
            from == 0 ? 0 : static_cast<uint64_t>((static_cast<unsigned __int128>(ep.need) * mine + from - 1) / from);
        const uint64_t target = std::max(g, b->reclaimFrom[d] > share ? b->reclaimFrom[d] - share : 0);
        if (target != b->reclaimTarget[d]) {
          b->reclaimTarget[d] = target;
          if (LimitsFile* f = b->ledger->limitsFile()) f->setReclaimTarget(b->entry[d], target);
          CUSHARE_BLOG(info,
                       "tenant {} device {}: asked to give back plain bursts down to {} (it holds {}): a guaranteed "
                       "allocation of another tenant waits for {}",
                       b->name, devices_[d].name(), formatSize(target), formatSize(b->reclaimFrom[d]),
                       formatSize(ep.need));
        }
        uint64_t used = 0;
        guarded([&] { used = b->ledger->used(b->entry[d]); });
        if (used <= target && b->reclaimReachedNs[d] == 0) b->reclaimReachedNs[d] = now;
        if (used > target && b->reclaimClamp[d] == kNoLimit &&
            now - ep.startNs >= static_cast<uint64_t>(config_.elasticity.reclaimDeadlineMs) * 1000000ull) {
          b->reclaimClamp[d] = g;
          CUSHARE_BLOG(warn,
                       "tenant {} device {}: did not give back its plain bursts within {} ms ({} held, asked for {}): "
                       "its allocations above its guarantee ({}) are refused until the reclaim is over; nothing it "
                       "holds is taken",
                       b->name, devices_[d].name(), config_.elasticity.reclaimDeadlineMs, formatSize(used),
                       formatSize(target), formatSize(g));
          applyLimitsLocked(b, /*watchdog=*/false);
        }
      }
      continue;
    }
    if (ep.active && ep.needGoneNs == 0) ep.needGoneNs = now;
    if (!ep.active || ++ep.quiet < 2) continue;
    // Over: lift targets and clamps, count and say what was given back.
    for (auto& [name, t] : tenants_) {
      for (size_t d = 0; d < n; ++d) {
        if (std::min(devices_[d].group(d), n - 1) != grp || d >= t->reclaimTarget.size() ||
            t->reclaimTarget[d] == kNoLimit)
          continue;
        uint64_t used = 0;
        if (t->ledger && d < t->entry.size() && t->entry[d] >= 0) guarded([&] { used = t->ledger->used(t->entry[d]); });
        const uint64_t gave = t->reclaimFrom[d] > used ? t->reclaimFrom[d] - used : 0;
        if (d < t->reclaimed.size()) t->reclaimed[d] = addSaturated(t->reclaimed[d], gave);
        // Reached at the tick that saw it, or (given back between two ticks, the waiting allocation
        // granted at once) by the tick that found nobody waiting any more.
        if (t->reclaimReachedNs[d] == 0 && used <= t->reclaimTarget[d]) t->reclaimReachedNs[d] = ep.needGoneNs;
        const bool reached = t->reclaimReachedNs[d] != 0;
        if (reached) t->reclaimSeconds[d] = static_cast<double>(t->reclaimReachedNs[d] - ep.startNs) / 1e9;
        CUSHARE_BLOG(info, "tenant {} device {}: reclaim over: gave back {}{}", t->name, devices_[d].name(),
                     formatSize(gave),
                     reached ? fmt::format(", its target reached within {} ms",
                                           (t->reclaimReachedNs[d] - ep.startNs) / 1000000)
                             : std::string(", its target never reached"));
        t->reclaimTarget[d] = kNoLimit;
        if (t->ledger && d < t->entry.size() && t->entry[d] >= 0)
          if (LimitsFile* f = t->ledger->limitsFile()) f->setReclaimTarget(t->entry[d], kNoLimit);
        if (t->reclaimClamp[d] != kNoLimit) {
          t->reclaimClamp[d] = kNoLimit;
          applyLimitsLocked(t.get(), /*watchdog=*/false);
        }
      }
    }
    ep = ReclaimEpisode{};
  }
}

}  // namespace cushare::broker
