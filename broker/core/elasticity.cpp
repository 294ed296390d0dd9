// Memory elasticity's per-tick work in the broker (docs/memory-elasticity.md): what the tenants'
// bursts hold that the device would evict, published to every tenant of the device so that the
// free memory in each tenant's view counts it (a guaranteed tenant sees the room it was promised,
// not only what the device's free figure shows while bursts fill it).
//
// The same figures say how much of the bursts is on host memory (the bursts less what the device
// holds for them): per tenant, in proportion to its bursts, a gauge, and its rises summed into a
// counter (cushare_tenant_reclaimed_bytes_total). The driver evicts within the allocation that
// needs the room, so there is no reclaim time to measure here (perf/managed_evict_probe measures
// the allocation's). A rise its burst's own growth since the last tick explains (an allocation
// not yet prefetched, or one that found no room) is on host memory but not counted as reclaimed.
//
// The estimate per memory group (a GPU, or a GPU instance whose MIG devices share its memory):
// the smaller of what the bursting tenants' ledgers hold above their guarantees (managed memory,
// resident or already evicted) and what the device holds that no process's NVML figure shows
// (NVML's per-process figures leave managed memory out: resident managed memory is there, with
// whatever else the device holds for no process). Stale by up to a tick; it can over-state the
// room for that long after bursts were evicted, never for longer.
#include <algorithm>
#include <map>

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
  // The thrashing guard's room per group: the device's free memory and what it holds for no
  // process (resident managed memory among it); unknown where the device was not read.
  thrash_.resize(n);
  for (ThrashGroup& tg : thrash_) tg.room = kNoLimit;
  for (size_t d = 0; d < n; ++d) {
    if (unreadLocked(d) || d >= deviceUsed.size()) continue;
    const size_t grp = std::min(devices_[d].group(d), n - 1);
    const uint64_t free = devices_[d].totalBytes > deviceUsed[d] ? devices_[d].totalBytes - deviceUsed[d] : 0;
    thrash_[grp].room = addSaturated(free, unshown[grp]);
  }
  // Each bursting tenant's part of its group's bursts on host memory.
  std::vector<uint64_t> onHost(n, 0);
  for (size_t g = 0; g < n; ++g) onHost[g] = bursts[g] - std::min(bursts[g], unshown[g]);
  for (auto& [name, t] : tenants_) {
    t->managedBurst.assign(n, 0);
    t->burstHost.resize(n, 0);
    t->reclaimed.resize(n, 0);
    t->burstHostSaid.resize(n, 0);
    t->burstBefore.resize(n, 0);
    for (size_t d = 0; d < n; ++d) {
      const uint64_t g = d < t->burstAbove.size() ? t->burstAbove[d] : kNoLimit;
      const size_t grp = std::min(devices_[d].group(d), n - 1);
      uint64_t mine = 0, burst = 0;
      if (g != kNoLimit && t->ledger && t->entry.size() == n && t->entry[d] >= 0 && !unreadLocked(d) && bursts[grp] > 0) {
        uint64_t used = 0;
        guarded([&] { used = t->ledger->used(t->entry[d]); });
        used = std::min(used, expectedLocked(*t, d));
        burst = used > g ? used - g : 0;
        // Managed for certain only above what its processes may hold as ordinary memory (a
        // guarantee lowered under them leaves ordinary memory above it: hidden_memory.cpp).
        const uint64_t ordinary =
            d < t->ordinaryCeiling.size() && t->ordinaryCeiling[d] != kNoLimit ? std::max(g, t->ordinaryCeiling[d]) : g;
        t->managedBurst[d] = used > ordinary ? used - ordinary : 0;
        mine = static_cast<uint64_t>(static_cast<unsigned __int128>(onHost[grp]) * burst / bursts[grp]);
      } else if (unreadLocked(d)) {
        continue;  // kept as it was
      }
      const uint64_t grew = burst > t->burstBefore[d] ? burst - t->burstBefore[d] : 0;
      if (mine > addSaturated(t->burstHost[d], grew))
        t->reclaimed[d] = addSaturated(t->reclaimed[d], mine - t->burstHost[d] - grew);
      t->burstHost[d] = mine;
      t->burstBefore[d] = burst;
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
// want_ns: refreshed every 10 ms while it waits, at most elasticity.reclaim_wait_ms) and retries.
// Each tick:
// - a wait is believed only while fresh (three ticks), only from a tenant with a guarantee (its
//   limit if it does not burst; none without a limit) that holds no more than it, up to the least
//   of what it asks, its guarantee and what it holds (its waiting reservation is in what it holds),
//   and only while the device's own count (NVML) shows the memory group with less free than it
//   asks: a tenant cannot make others give back for its own bursts, nor while there is room;
// - while there is a need, each plain burster of the group (tenant and device) gets a target in its
//   limits file (reclaim_target, reclaim_seq moving): what it held when it joined the reclaim less
//   its share of the need, in proportion to the bursts, never below its guarantee, and never raised
//   within a reclaim; its shims wake whoever polls cushare_reclaim_fd;
// - reclaim_deadline_ms after it joined, a burster still above its target is held to its guarantee
//   (its published limit: its allocations above it are refused; nothing it holds is taken);
// - two ticks without a need end the reclaim: targets and clamps are lifted, what each burster gave
//   back above its guarantee is counted (cushare_tenant_reclaimed_bytes_total) and logged with the
//   time it took to reach its target (cushare_tenant_reclaim_seconds; 0 if it never did).
void Broker::reclaimLocked(const std::vector<uint64_t>& deviceUsed) {
  const size_t n = devices_.size();
  reclaim_.resize(n);
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  const uint64_t now = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  constexpr uint64_t kFreshNs = 150000000ull;  // three ticks; waiters refresh every 10 ms
  const uint64_t deadlineNs = static_cast<uint64_t>(config_.elasticity.reclaimDeadlineMs) * 1000000ull;
  auto groupOf = [&](size_t d) { return std::min(devices_[d].group(d), n - 1); };
  // The device's own free memory per group (NVML); unknown: nobody's wait is believed.
  std::vector<uint64_t> groupFree(n, 0);
  std::vector<uint8_t> groupRead(n, 0);
  for (size_t d = 0; d < n && deviceUsed.size() == n; ++d) {
    if (unreadLocked(d)) continue;
    const size_t grp = groupOf(d);
    groupFree[grp] = devices_[d].totalBytes > deviceUsed[d] ? devices_[d].totalBytes - deviceUsed[d] : 0;
    groupRead[grp] = 1;
  }
  struct Burster {
    TenantState* t;
    size_t d;
    uint64_t used;
  };
  std::vector<uint64_t> need(n, 0), plainBursts(n, 0);
  std::vector<std::string> askers(n);
  std::vector<std::vector<Burster>> bursters(n);
  std::map<TenantState*, std::vector<uint64_t>> usedOf;  // per tenant, per device (0 where none)
  for (auto& [name, t] : tenants_) {
    t->reclaimFrom.resize(n, 0);
    t->reclaimTarget.resize(n, kNoLimit);
    t->reclaimReachedNs.resize(n, 0);
    t->reclaimClamp.resize(n, kNoLimit);
    t->reclaimSeconds.resize(n, 0);
    t->reclaimJoinNs.resize(n, 0);
    if (!t->ledger || t->entry.size() != n) continue;
    std::vector<uint64_t>& used = usedOf[t.get()];
    used.assign(n, 0);
    for (size_t d = 0; d < n; ++d) {
      const int e = t->entry[d];
      if (e < 0) continue;
      const size_t grp = groupOf(d);
      uint64_t want = 0, wantNs = 0;
      if (!guarded([&] {
            used[d] = t->ledger->used(e);
            want = t->ledger->wantBytes(e);
            wantNs = t->ledger->wantNs(e);
          }))
        continue;
      const bool bursts = d < t->guaranteeOf.size() && t->guaranteeOf[d] != kNoLimit;
      const uint64_t g = bursts ? t->guaranteeOf[d] : expectedLocked(*t, d);
      if (want != 0 && g != kNoLimit && wantNs <= now && now - wantNs <= kFreshNs && used[d] <= g &&
          groupRead[grp] && groupFree[grp] < want) {
        need[grp] = addSaturated(need[grp], std::min({want, g, used[d]}));
        askers[grp] += (askers[grp].empty() ? "" : ", ") + name;
      }
      if (bursts && t->config.burst == BurstMode::kPlain) {
        plainBursts[grp] = addSaturated(plainBursts[grp], used[d] > g ? used[d] - g : 0);
        bursters[grp].push_back({t.get(), d, used[d]});
      }
    }
  }
  // Every tenant within its guarantee is told where others' plain bursts may be waited for (a
  // tenant above its guarantee is never believed: it would only wait in vain), and how long.
  for (auto& [name, t] : tenants_) {
    if (!t->ledger || t->entry.size() != n) continue;
    LimitsFile* limits = t->ledger->limitsFile();
    if (limits == nullptr) continue;
    uint64_t mask = 0;
    for (size_t d = 0; d < n; ++d) {
      const int e = t->entry[d];
      if (e < 0) continue;
      const size_t grp = groupOf(d);
      const bool bursts = d < t->guaranteeOf.size() && t->guaranteeOf[d] != kNoLimit;
      const uint64_t g = bursts ? t->guaranteeOf[d] : expectedLocked(*t, d);
      const uint64_t mine = usedOf.count(t.get()) ? usedOf[t.get()][d] : 0;
      uint64_t others = plainBursts[grp];
      if (bursts && t->config.burst == BurstMode::kPlain) others -= std::min(others, mine > g ? mine - g : 0);
      if (others > 0 && g != kNoLimit && mine <= g) mask |= uint64_t{1} << e;
    }
    limits->setPlainMask(mask, config_.elasticity.reclaimWaitMs);
  }
  for (size_t grp = 0; grp < n; ++grp) {
    ReclaimEpisode& ep = reclaim_[grp];
    if (need[grp] > 0 && plainBursts[grp] > 0) {
      ep.quiet = 0;
      ep.needGoneNs = 0;
      if (!ep.active) {
        ep = ReclaimEpisode{};
        ep.active = true;
        ep.startNs = now;
      }
      ep.need = need[grp];
      ep.askers = askers[grp];
      for (Burster& b : bursters[grp])
        if (b.t->reclaimJoinNs[b.d] == 0) {  // joins now: what it holds is where it starts from
          b.t->reclaimJoinNs[b.d] = now;
          b.t->reclaimFrom[b.d] = b.used;
          b.t->reclaimReachedNs[b.d] = 0;
        }
      uint64_t from = 0;  // the bursts when each joined
      for (const Burster& b : bursters[grp]) {
        const uint64_t g = b.t->guaranteeOf[b.d];
        if (b.t->reclaimFrom[b.d] > g) from = addSaturated(from, b.t->reclaimFrom[b.d] - g);
      }
      for (const Burster& b : bursters[grp]) {
        TenantState* t = b.t;
        const size_t d = b.d;
        const uint64_t g = t->guaranteeOf[d];
        const uint64_t mine = t->reclaimFrom[d] > g ? t->reclaimFrom[d] - g : 0;
        // Its share of the need, rounded up (the shares cover it), never below its guarantee, and
        // never raised within a reclaim (a burster is not sent up and down).
        const uint64_t share =
            from == 0 ? 0 : static_cast<uint64_t>((static_cast<unsigned __int128>(ep.need) * mine + from - 1) / from);
        const uint64_t target =
            std::min(t->reclaimTarget[d], std::max(g, t->reclaimFrom[d] > share ? t->reclaimFrom[d] - share : 0));
        if (target != t->reclaimTarget[d]) {
          t->reclaimTarget[d] = target;
          t->reclaimReachedNs[d] = 0;
          if (LimitsFile* f = t->ledger->limitsFile()) f->setReclaimTarget(t->entry[d], target);
          CUSHARE_BLOG(info,
                       "tenant {} device {}: asked to give back plain bursts down to {} (it holds {}): guaranteed "
                       "allocations of {} wait for {}",
                       t->name, devices_[d].name(), formatSize(target), formatSize(b.used), ep.askers,
                       formatSize(ep.need));
        }
        if (b.used <= target && t->reclaimReachedNs[d] == 0) t->reclaimReachedNs[d] = now;
        if (b.used > target && t->reclaimClamp[d] == kNoLimit && now - t->reclaimJoinNs[d] >= deadlineNs) {
          t->reclaimClamp[d] = g;
          CUSHARE_BLOG(warn,
                       "tenant {} device {}: did not give back its plain bursts within {} ms ({} held, asked for {}): "
                       "its allocations above its guarantee ({}) are refused until the reclaim is over; nothing it "
                       "holds is taken",
                       t->name, devices_[d].name(), config_.elasticity.reclaimDeadlineMs, formatSize(b.used),
                       formatSize(target), formatSize(g));
          applyLimitsLocked(t, /*watchdog=*/false);
        }
      }
      continue;
    }
    if (ep.active && ep.needGoneNs == 0) ep.needGoneNs = now;
    if (!ep.active || ++ep.quiet < 2) continue;
    // Over: lift targets and clamps, count and say what was given back.
    for (auto& [name, t] : tenants_) {
      for (size_t d = 0; d < n; ++d) {
        if (groupOf(d) != grp || d >= t->reclaimJoinNs.size() || t->reclaimJoinNs[d] == 0) continue;
        const uint64_t used = usedOf.count(t.get()) ? usedOf[t.get()][d] : 0;
        const uint64_t g = d < t->guaranteeOf.size() && t->guaranteeOf[d] != kNoLimit ? t->guaranteeOf[d] : 0;
        // What it gave back of its bursts (frees below its guarantee are its own business).
        const uint64_t floor = std::max(used, g);
        const uint64_t gave = t->reclaimFrom[d] > floor ? t->reclaimFrom[d] - floor : 0;
        if (d < t->reclaimed.size()) t->reclaimed[d] = addSaturated(t->reclaimed[d], gave);
        // Reached at the tick that saw it, or (given back between two ticks, the waiting allocation
        // granted at once) by the tick that found nobody waiting any more.
        if (t->reclaimReachedNs[d] == 0 && t->reclaimTarget[d] != kNoLimit && used <= t->reclaimTarget[d])
          t->reclaimReachedNs[d] = ep.needGoneNs;
        const bool reached = t->reclaimReachedNs[d] != 0;
        t->reclaimSeconds[d] =
            reached ? static_cast<double>(t->reclaimReachedNs[d] - std::min(t->reclaimReachedNs[d], t->reclaimJoinNs[d])) / 1e9
                    : 0;
        CUSHARE_BLOG(info, "tenant {} device {}: reclaim over: gave back {}{}", t->name, devices_[d].name(),
                     formatSize(gave),
                     reached ? fmt::format(", its target reached within {} ms", static_cast<uint64_t>(t->reclaimSeconds[d] * 1000))
                             : std::string(", its target never reached"));
        t->reclaimTarget[d] = kNoLimit;
        t->reclaimJoinNs[d] = 0;
        t->reclaimFrom[d] = 0;
        t->reclaimReachedNs[d] = 0;
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
