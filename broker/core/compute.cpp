// The compute scheduler (docs/compute.md): metering of every tenant's GPU busy and throttled time,
// and, on each device where some tenant is capped below 100 %, exclusive turns by deficit round
// robin: one tenant's gate open at a time, the next opened only once the previous one's in-flight
// work has drained, so the busy time metered during a turn is the holder's own. Budgets are
// cap x period per period, charged with the metered busy time; a turn's overrun is carried as
// debt; a tenant without work passes its turn at once; uncapped tenants take what caps leave.
//
// Everything read from a ledger's compute region was written by the tenant's processes: counters
// are clamped (an increase counts at most the wall time since the last look plus a slack; a
// decrease starts a new owner's count), in-flight counts above a sanity bound count as "no work",
// and a turn whose in-flight never drains ends after kDrainLimit. All ledger memory is touched
// inside guarded() (SIGBUS on a truncated file drops that tenant), under the broker's mutex.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/log.h"

namespace cushare::broker {

namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kDrainLimit = 100 * kMs;     // a turn's in-flight work must drain within this
constexpr uint64_t kIdlePass = 1 * kMs;         // no work for this long: the turn passes
constexpr uint64_t kCounterSlack = 200 * kMs;   // a counter may run ahead of the broker's ticks
constexpr uint32_t kInFlightSane = 1u << 20;    // more than this in flight: a scribble
constexpr uint64_t kHeartbeat = 500 * kMs;      // gate_epoch moves at least this often
constexpr uint64_t kBlockedStale = 20 * kMs;    // a waiter that does not go through an open gate
constexpr int64_t kUncapped = INT64_MAX / 4;
// Priorities: a tenant is active while it had work within kPriorityActive; lower-priority tenants
// are then capped at the floor, kept to one launch in flight, and only take a turn once every
// higher-priority tenant has had no work for kPriorityYield.
constexpr uint64_t kPriorityActive = 500 * kMs;
constexpr uint64_t kPriorityYield = 20 * kMs;

uint64_t monoNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

void wakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

uint32_t priorityWord(Priority p) { return p == Priority::kHigh ? 0 : p == Priority::kLow ? 2 : 1; }

}  // namespace

struct Broker::ComputeState {
  struct Slot {
    uint64_t busy = 0, throttled = 0;  // last seen
    // A count of launches in flight that outlived a drain (kDrainLimit) unchanged: taken for
    // stuck (a stopped process, a scribble) and not counted as work while it stays the same.
    uint32_t stuck = 0;
    // Since when (monotonic ns) the slot shows a launch waiting while its tenant's gate is open,
    // with activity_ns (which a live waiter moves whenever it wakes) standing still: past
    // kBlockedStale the waiter is not running (stopped) and the bit is not counted as work until
    // it clears or activity_ns moves.
    uint64_t blockedOpen = 0, activity = 0;
    bool ignoreBlocked = false;
  };
  struct TenantDevice {
    bool seen = false;
    uint64_t busyTotal = 0, throttledTotal = 0;  // monotone, since the broker started
    std::array<Slot, kLedgerMaxSlots> slots{};
    int64_t credit = 0;  // ns of device time left this period (negative: debt)
    uint64_t busyStep = 0;  // busy time metered in this step
    bool work = false;
    bool inflight = false;
    bool localCap = false;  // a process keeps a lower cap of its own (its busy time must be its own)
    bool open = false;      // its gate, as the last step set it
    uint64_t lastWork = 0;  // monotonic ns of the last step that saw work
    bool paced = false;
  };
  struct Device {
    std::string holder;  // the tenant whose gate is open; empty: none
    bool draining = false;
    uint64_t turnStart = 0, drainStart = 0, idleSince = 0, periodStart = 0;
    uint64_t lastBeat = 0;  // the last heartbeat (gate_epoch moved for every member)
    uint64_t turnBusy = 0, turnCharged = 0;  // this turn: busy metered, charged so far
    size_t next = 0;  // round robin position
  };
  std::map<std::string, std::vector<TenantDevice>> tenants;
  std::vector<Device> devices;
  uint64_t lastTick = 0;
};

bool Broker::computeUnderMpsLocked(size_t) const {
  // With the broker's MPS running and answering (docs/mps.md), tenant processes start as MPS
  // clients with their caps, which the server enforces: the device is metered, never gated.
  // While the daemon is down, new processes run outside MPS, so pacing takes over.
  return mps_.active && mps_.up;
}

void Broker::computeSnapshotLocked(const std::string& tenant, size_t device, TenantDeviceSnapshot* out) const {
  if (!compute_) return;
  const auto it = compute_->tenants.find(tenant);
  if (it == compute_->tenants.end() || device >= it->second.size()) return;
  out->busyNs = it->second[device].busyTotal;
  out->throttledNs = it->second[device].throttledTotal;
  out->paced = it->second[device].paced;
}

std::chrono::microseconds Broker::computeTick() {
  std::lock_guard<std::mutex> g(mu_);
  if (!compute_) compute_ = std::make_shared<ComputeState>();
  ComputeState& cs = *compute_;
  const uint64_t now = monoNs();
  const uint64_t sinceLast = cs.lastTick == 0 ? 0 : now - cs.lastTick;
  cs.lastTick = now;
  cs.devices.resize(devices_.size());
  const ComputeConfig& cc = config_.compute;
  const uint64_t period = uint64_t{cc.periodMs} * kMs;
  bool fast = false;

  // 1. Meter: every tenant's slots, clamped; who has work and what is in flight.
  for (auto& [name, tp] : tenants_) {
    TenantState& t = *tp;
    auto& per = cs.tenants[name];
    per.resize(devices_.size());
    if (!t.ledger) continue;
    const bool ok = guarded([&] {
      const uint32_t hwm = t.ledger->slotsInUse();
      for (size_t d = 0; d < devices_.size() && d < t.entry.size(); ++d) {
        const int e = t.entry[d];
        if (e < 0) continue;
        ComputeState::TenantDevice& td = per[d];
        td.work = td.inflight = td.localCap = false;
        const uint64_t busyBefore = td.busyTotal;
        for (uint32_t s = 0; s < hwm; ++s) {
          if (static_cast<int>(s) == t.ledger->chargeSlot()) continue;
          LedgerComputeSlot* c = t.ledger->computeSlotAt(e, static_cast<int>(s));
          const uint64_t busy = c->busy_ns.load(std::memory_order_relaxed);
          const uint64_t thr = c->throttled_ns.load(std::memory_order_relaxed);
          ComputeState::Slot& last = td.slots[s];
          if (td.seen) {
            // At most the time since the last step (+ slack) is credited per step; the rest is
            // carried to the next steps, never dropped: a kernel longer than a step is charged in
            // full (its marker adds its whole time at once). A counter that went down is a new
            // owner's (or a scribble): counted from zero.
            const uint64_t cap = sinceLast + kCounterSlack;
            const auto take = [&](uint64_t cur, uint64_t* prev) {
              if (cur < *prev) *prev = 0;
              const uint64_t x = std::min(cur - *prev, cap);
              *prev += x;
              return x;
            };
            td.busyTotal += take(busy, &last.busy);
            td.throttledTotal += take(thr, &last.throttled);
          } else {
            last.busy = busy;
            last.throttled = thr;
          }
          const uint32_t in = c->inflight.load(std::memory_order_seq_cst);
          const uint32_t act = c->activity.load(std::memory_order_seq_cst);
          if (in != last.stuck) last.stuck = 0;  // it moved: live again
          if (in != 0 && in < kInFlightSane && last.stuck == 0) td.work = td.inflight = true;
          // A launch waiting at a gate that has been open for kBlockedStale is not waiting: its
          // process does not run (stopped). Counted again once the bit clears and comes back.
          const bool open = td.open;  // as the broker set it at the last step
          const uint64_t actNs = c->activity_ns.load(std::memory_order_relaxed);
          const bool moved = actNs != last.activity;
          last.activity = actNs;
          if (!(act & kActivityBlocked) || moved) {
            last.blockedOpen = 0;
            last.ignoreBlocked = false;
          } else if (!open) {
            last.blockedOpen = 0;
          } else if (last.blockedOpen == 0) {
            last.blockedOpen = now;
          } else if (now - last.blockedOpen > kBlockedStale) {
            last.ignoreBlocked = true;
          }
          if ((act & kActivityBlocked) && !last.ignoreBlocked) td.work = true;
          if (act & kActivityLocalCap) td.localCap = true;
        }
        if (td.work) td.lastWork = now;
        td.seen = true;
        td.busyStep = td.busyTotal - busyBefore;
      }
    });
    if (!ok) faultLocked(&t);
  }

  // 2. Per device: who is paced, the compute words, the turns.
  for (size_t d = 0; d < devices_.size(); ++d) {
    ComputeState::Device& dev = cs.devices[d];
    struct Member {
      TenantState* t;
      ComputeState::TenantDevice* td;
      LedgerComputeDevice* words;
      int cap;  // percent; 100: none (the floor, for a tenant below an active higher priority)
      uint32_t band;  // 0 high, 1 normal, 2 low
      bool lower = false;  // a higher-priority tenant is active
    };
    std::vector<Member> members;
    bool capped = false;
    uint32_t topBand = 2;
    for (auto& [name, tp] : tenants_) {
      TenantState& t = *tp;
      if (!t.ledger || d >= t.entry.size() || t.entry[d] < 0) continue;
      const int cap = std::clamp(threadsLocked(t).value_or(100), 1, 100);
      Member m{&t, &cs.tenants[name][d], t.ledger->compute(t.entry[d]), cap, priorityWord(priorityLocked(t))};
      if (m.td->lastWork != 0 && now - m.td->lastWork < kPriorityActive) topBand = std::min(topBand, m.band);
      members.push_back(m);
    }
    bool differ = false;
    for (Member& m : members) {
      m.lower = m.band > topBand && m.td->lastWork != 0 && now - m.td->lastWork < kPriorityActive;
      differ = differ || m.lower;
    }
    for (Member& m : members) {
      if (m.band > topBand) m.cap = std::min<int>(m.cap, std::max<int>(1, static_cast<int>(cc.priorityFloorPercent)));
      // A process's own lower cap (launch.cpp) is kept from the busy time it meters, which is its
      // own only while turns are exclusive: such a device is scheduled like a capped one.
      capped = capped || m.cap < 100 || m.td->localCap;
    }
    // A tenant of the top priority that is alone there and uncapped keeps its gate open while
    // priorities differ: its launches never wait for a step; lower ones yield to its work.
    Member* pinned = nullptr;
    if (differ) {
      int inTop = 0;
      for (Member& m : members)
        if (m.band == topBand) {
          ++inTop;
          pinned = &m;
        }
      if (inTop != 1 || pinned->cap < 100) pinned = nullptr;
    }
    // When a higher priority than a member's had work: now (preempts) or lately (no new turn).
    const auto higherWork = [&](const Member& m, uint64_t within) {
      for (const Member& o : members)
        if (o.band < m.band && o.td->lastWork != 0 && now - o.td->lastWork <= within) return true;
      return false;
    };
    // The highest priority active among the other tenants (kOthersNone: none), published for
    // processes that lower their own priority below their tenant's (launch.cpp, local caps).
    const auto othersTop = [&](const Member& m) {
      uint32_t top = kOthersNone;
      for (const Member& o : members)
        if (&o != &m && o.td->lastWork != 0 && now - o.td->lastWork < kPriorityActive) top = std::min(top, o.band);
      return top;
    };
    const bool schedule = (capped || differ) && !computeUnderMpsLocked(d);
    if (!schedule) {
      dev.holder.clear();
      dev.draining = false;
      dev.periodStart = 0;
    }
    Member* holder = nullptr;
    for (Member& m : members)
      if (m.t->name == dev.holder) holder = &m;
    if (holder == nullptr) {
      dev.holder.clear();
      dev.draining = false;
    }
    // Capped tenants pay for the device time they ran as it is metered, so a period's refill
    // never comes before the charge of the time before it. The holder pays for its turn the lower
    // of the busy time its processes metered and the turn's wall time (open to drained): the
    // turns are exclusive, so the wall time bounds its device time, and the busy time of two
    // processes of the tenant time-slicing on the device counts the slices twice. Others (who
    // should not run) pay what they metered.
    if (schedule)
      for (Member& m : members) {
        if (m.cap >= 100) continue;
        uint64_t pay = std::min<uint64_t>(m.td->busyStep, 4 * period);
        if (&m == holder) {
          dev.turnBusy += m.td->busyStep;
          const uint64_t owed = std::min(dev.turnBusy, now - dev.turnStart);
          pay = owed > dev.turnCharged ? owed - dev.turnCharged : 0;
          dev.turnCharged += pay;
        }
        m.td->credit -= static_cast<int64_t>(pay);
      }
    // Period boundaries: budgets refill (unused credit does not pile up; debt carries over).
    if (schedule) {
      if (dev.periodStart == 0 || now - dev.periodStart > 4 * period) {
        dev.periodStart = now;
        for (Member& m : members) m.td->credit = m.cap < 100 ? static_cast<int64_t>(period * m.cap / 100) : kUncapped;
      }
      while (now - dev.periodStart >= period) {
        dev.periodStart += period;
        for (Member& m : members) {
          const int64_t quantum = m.cap < 100 ? static_cast<int64_t>(period * m.cap / 100) : kUncapped;
          m.td->credit = m.cap < 100 ? std::min(m.td->credit + quantum, quantum) : kUncapped;
        }
      }
    }
    if (schedule && holder != nullptr && !dev.draining) {
      const bool idle = !holder->td->work;
      if (!idle) dev.idleSince = 0;
      else if (dev.idleSince == 0) dev.idleSince = now;
      const int64_t used = static_cast<int64_t>(now - dev.turnStart);
      bool othersWait = false;
      for (Member& m : members)
        if (&m != holder && m.band <= holder->band && m.td->work && m.td->credit > 0) othersWait = true;
      const bool preempted = higherWork(*holder, 0);  // a higher priority has work now
      const bool end = (idle && now - dev.idleSince >= kIdlePass) || (holder->cap < 100 && holder->td->credit <= 0) ||
                       (othersWait && used >= static_cast<int64_t>(period / 2)) || preempted;
      if (end) {
        dev.draining = true;
        dev.drainStart = now;
      }
    }
    if (schedule && holder != nullptr && dev.draining) {
      if (!holder->td->inflight || now - dev.drainStart > kDrainLimit) {
        if (holder->td->inflight) {
          CUSHARE_BLOG(warn, "tenant {} device {}: in-flight work did not drain within {} ms (a stopped process, "
                       "or its ledger written): next turn; the counts are not taken for work until they move",
                       holder->t->name, d, kDrainLimit / kMs);
          // Whatever is still counted in flight is taken for stuck until it changes, so that
          // its turns do not each idle the device for kDrainLimit.
          if (!guarded([&] {
                const uint32_t hwm = holder->t->ledger->slotsInUse();
                for (uint32_t s = 0; s < hwm && s < kLedgerMaxSlots; ++s) {
                  if (static_cast<int>(s) == holder->t->ledger->chargeSlot()) continue;
                  const uint32_t in = holder->t->ledger->computeSlotAt(holder->t->entry[d], static_cast<int>(s))
                                          ->inflight.load(std::memory_order_seq_cst);
                  holder->td->slots[s].stuck = in;
                }
              }))
            faultLocked(holder->t);
        }
        dev.holder.clear();
        dev.draining = false;
        holder = nullptr;
      } else {
        fast = true;
      }
    }
    if (schedule && holder == nullptr && !members.empty()) {
      // The highest priority with work and credit, round robin within it; a lower priority only
      // once the higher ones have had no work for kPriorityYield. The pinned tenant needs no turn.
      uint32_t best = 3;
      for (Member& m : members)
        if (&m != pinned && m.td->work && m.td->credit > 0 && !higherWork(m, kPriorityYield)) best = std::min(best, m.band);
      for (size_t i = 0; i < members.size(); ++i) {
        Member& m = members[(dev.next + i) % members.size()];
        if (&m != pinned && m.band == best && m.td->work && m.td->credit > 0 && !higherWork(m, kPriorityYield)) {
          holder = &m;
          dev.holder = m.t->name;
          dev.turnStart = now;
          dev.turnBusy = dev.turnCharged = 0;
          dev.idleSince = 0;
          dev.next = (dev.next + i + 1) % members.size();
          break;
        }
      }
    }
    // The words: mode, cap, priority, gate (rewritten every step: a tenant may scribble on them).
    // A heartbeat for the shims: gate_epoch moves at least every kHeartbeat whatever the gate, so
    // a process waiting at a gate that stays closed (debt, a higher priority's work) never takes
    // the broker for gone; only a dead broker stops it (launch.cpp, kBrokerGoneNs).
    const bool beat = now - dev.lastBeat >= kHeartbeat;
    if (beat) dev.lastBeat = now;
    for (Member& m : members) {
      if (beat && !guarded([&] { m.words->gate_epoch.fetch_add(1); })) faultLocked(m.t);
      const uint32_t mode = (cc.metering || schedule ? kComputeMetered : 0) | (schedule && &m != pinned ? kComputePaced : 0) |
                            (schedule && m.lower ? kComputeTight : 0);
      const bool open = !schedule || (holder == &m && !dev.draining) || &m == pinned;
      m.td->paced = schedule && &m != pinned;
      m.td->open = open;
      if (!guarded([&] {
            LedgerComputeDevice* w = m.words;
            if (w->mode.load() != mode) w->mode.store(mode, std::memory_order_seq_cst);
            const uint32_t cap = static_cast<uint32_t>(m.cap) * 100;
            if (w->cap.load() != cap) w->cap.store(cap);
            const uint32_t pr = priorityWord(priorityLocked(*m.t));
            if (w->priority.load() != pr) w->priority.store(pr);
            const uint32_t others = othersWord(othersTop(m), cc.priorityFloorPercent);
            if (w->others.load() != others) w->others.store(others);
            const uint32_t want = open ? kGateOpen : kGateClosed;
            if (w->gate.load(std::memory_order_seq_cst) != want) {
              w->gate.store(want, std::memory_order_seq_cst);
              if (open) {
                w->gate_epoch.fetch_add(1);
                wakeAll(&w->gate);
              }
            }
          }))
        faultLocked(m.t);
    }
  }
  // Forget tenants that are gone.
  for (auto it = cs.tenants.begin(); it != cs.tenants.end();)
    it = tenants_.count(it->first) ? std::next(it) : cs.tenants.erase(it);
  bool any = false;
  for (const ComputeState::Device& dev : cs.devices) any = any || dev.periodStart != 0;
  if (fast) return std::chrono::microseconds(100);
  return any ? std::chrono::microseconds(1000) : std::chrono::microseconds(20000);
}

}  // namespace cushare::broker

namespace cushare::broker {

void Broker::computeRelease() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [name, tp] : tenants_) {
    TenantState& t = *tp;
    if (!t.ledger) continue;
    if (!guarded([&] {
          for (size_t d = 0; d < t.entry.size(); ++d) {
            if (t.entry[d] < 0) continue;
            LedgerComputeDevice* w = t.ledger->compute(t.entry[d]);
            w->mode.fetch_and(~kComputePaced, std::memory_order_seq_cst);
            w->others.store(0, std::memory_order_relaxed);  // nothing published any more
            w->gate.store(kGateOpen, std::memory_order_seq_cst);
            w->gate_epoch.fetch_add(1);
            wakeAll(&w->gate);
          }
        }))
      faultLocked(&t);
  }
}

}  // namespace cushare::broker

// ---- the thread (compute_thread.h) ----
#include "core/compute_thread.h"

namespace cushare::broker {

void ComputeThread::start() {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_) {
      l.unlock();
      const std::chrono::microseconds sleep = broker_.computeTick();
      l.lock();
      cv_.wait_for(l, sleep, [this] { return stop_; });
    }
  });
}

void ComputeThread::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace cushare::broker
