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
#include <set>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/mps_turns.h"
#include "core/probes.h"
#include "core/log.h"
#include "cushare/parse.h"

namespace cushare::broker {

namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kDrainLimit = 100 * kMs;     // a turn's in-flight work must drain within this
// A tenant whose drain timed out without its busy time moving is *suspect* (counts that move but
// mean nothing, or a stopped process) until its busy time moves again: its turns end after
// kSuspectIdle without busy time metered in them, and its drains after kSuspectDrain.
constexpr uint64_t kSuspectIdle = 5 * kMs;
constexpr uint64_t kSuspectDrain = 2 * kMs;
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
constexpr uint64_t kFloorAfter = 20 * kMs;  // a higher priority busy this long: floor turns start
// Fair share (weights): a tenant contends on a device while it had work there within kFairActive;
// with two or more contending (outside MPS, or under MPS where they reach the same SMs) the
// device is scheduled in weighted turns. The
// controller corrects each contender's quantum every kFairControl.
constexpr uint64_t kFairActive = 100 * kMs;
// A contender with work and more of its quantum left than the holder (in proportion, by
// kFairCutMargin) takes over once the holder has had kFairSlice: a tenant with little work waits
// about that long for the device, not for everyone's whole quantum.
constexpr uint64_t kFairSlice = 10 * kMs;
constexpr double kFairCutMargin = 0.25;
// Busy time metered within this of a tenant's turn's end is its turn's (paid up to the allowance).
constexpr uint64_t kLateGrace = 20 * kMs;
constexpr uint64_t kFairControl = 500 * kMs;
constexpr double kFairDeadband = 0.01;  // share points the controller leaves alone
constexpr double kFairKp = 0.5, kFairKi = 0.25;
constexpr double kFairMin = 0.5, kFairMax = 2.0;  // bounds of the correction factor
// Under MPS: a process of a tenant missing from the server's client list for this long is
// reported (it is paced from the start).
constexpr uint64_t kMpsClientGrace = 3000 * kMs;
// A tenant alone on a device (nobody else had work there for this long) is charged its metered
// busy time scaled by what the device counted for it over the last window (docs/compute.md,
// "Charging a tenant alone"); the window is trued up at its end.
constexpr uint64_t kAloneWindow = 1000 * kMs;
constexpr uint64_t kAloneMinMetered = 20 * kMs;  // less metered in a window: no scale from it
constexpr double kAloneMinScale = 0.02;
constexpr double kAloneScaleFrom = 0.9;  // a window's device/metered ratio above this: no scale

// The thrashing guard (docs/memory-elasticity.md, "Thrashing"): a managed burster with work within
// kThrashActive contends for the room its burst needs; a holder without work for kThrashIdlePass
// passes its turn to one that has; the guard ends once the bursters with work have fitted in the
// room (or fewer than two have had work) for kThrashCalm.
constexpr uint64_t kThrashActive = 200 * kMs;
constexpr uint64_t kThrashIdlePass = 100 * kMs;
constexpr uint64_t kThrashCalm = 1000 * kMs;
// A holder whose busy time (metered, or counted by the device: NVML, read every tick) has not moved
// for the stall window while its gate was open and it claims work ends its turn (through the drain)
// and becomes suspect: still gated, it gets a turn only when nobody else has work, and no longer
// keeps others waiting, until its busy time moves (a kernel of it completes). The window is half a
// quantum, within [kThrashStallMin, kThrashStallMax]: a real turn starts by faulting its working set
// back in, which can take hundreds of ms before a kernel completes; a suspect's own turns stall after
// kThrashSuspectStall. So counts that claim work without running any cost the device one window.
constexpr uint64_t kThrashStallMin = 250 * kMs;
constexpr uint64_t kThrashStallMax = 1000 * kMs;
constexpr uint64_t kThrashSuspectStall = 50 * kMs;

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
    uint64_t lastMove = 0;  // the last step its busy time moved or it had work (fair share counts processes)
    bool ignoreBlocked = false;
  };
  struct TenantDevice {
    bool seen = false;
    // Busy time, monotone since the broker started: what the tenant's processes metered (their
    // slots, clamped), what the device itself counted for them (NVML's per-process utilization,
    // the tick's cross-check: busy_check.cpp), and what the tenant is charged and billed, the
    // larger of the two (a tenant cannot meter its way below the device's count).
    uint64_t metered = 0, device = 0, deviceBase = 0;
    uint64_t busyTotal = 0, throttledTotal = 0;
    std::array<Slot, kLedgerMaxSlots> slots{};
    int64_t credit = 0;  // ns of device time left this period (negative: debt)
    uint64_t busyStep = 0;  // busy time metered in this step
    bool work = false;
    bool inflight = false;
    bool open = false;      // its gate, as the last step set it
    bool suspect = false;   // see kSuspectIdle
    uint64_t suspectBusy = 0;  // busyTotal when it became suspect
    uint64_t lastWork = 0;  // monotonic ns of the last step that saw work
    uint64_t workSince = 0;  // the first step of its current run of steps with work (0: none now)
    bool paced = false;
    // Left to MPS beside other clients with work whose percentages and its own sum over 100: they
    // share SMs, and its probe share reads the SMs it reaches, not its part of them (said with
    // the share: docs/probes.md).
    bool sharedSms = false;
    bool mpsTurns = false;  // an MPS client taken into weighted turns at the last step
    uint64_t turnEnd = 0, allowance = 0;  // its last turn's end, and the wall time not charged
    // Fair share: weighted deficit round robin (credit in ns, refilled by quantum when every
    // contender with work has spent it) and the controller's correction of the quantum.
    int64_t fair = 0;
    bool contending = false;
    double correction = 1.0, integral = 0.0;
    uint32_t rounds = 0, spent = 0;  // refills in the controller's window, and those it had spent
    uint64_t charged = 0;  // device time paid for in turns (fair share on), monotone
    uint64_t fairBusyMark = 0, fairThrottledMark = 0;  // charged and throttled at the controller's last step
    double target = 0.0, achieved = 0.0;              // the controller's last view (0: none)
    // Alone on the device: the window's start (0: not alone), metered and device-counted busy
    // time and the credit charged at its start and since, and the scale of the metered time.
    uint64_t aloneStart = 0, aloneMetered = 0, aloneDevice = 0, aloneCharged = 0;
    double scale = 1.0;
    // Device share (docs/compute.md): ns, monotone; the fraction of an ns not yet counted.
    uint64_t share = 0;
    double shareCarry = 0.0;
  };
  struct Device {
    std::string holder;  // the tenant whose gate is open; empty: none
    bool draining = false;
    uint64_t turnStart = 0, drainStart = 0, idleSince = 0, periodStart = 0;
    uint64_t lastBeat = 0;  // the last heartbeat (gate_epoch moved for every member)
    uint64_t turnBusy = 0, turnCharged = 0;  // this turn: busy metered, charged so far
    uint64_t turnFairCharged = 0;            // this turn: wall time charged to fair credit
    uint64_t turnBusyStart = 0;              // the holder's busyTotal when its turn began
    size_t next = 0;  // round robin position
    bool fair = false;        // weighted turns in force (two or more contenders, fair_share on)
    MpsTurnsHold mpsTurns;    // MPS clients take the weighted turns (docs/compute.md, "Weights under MPS")
    uint64_t fairStep = 0;    // the controller's last step (monotonic ns)
  };
  std::map<std::string, std::vector<TenantDevice>> tenants;
  std::vector<Device> devices;
  uint64_t lastTick = 0;
};

bool Broker::computeUnderMpsLocked(const TenantState& t, size_t device) const {
  // With the broker's MPS running and answering (docs/mps.md), a tenant whose processes on the
  // device are all MPS clients has its cap enforced by the server: metered, never gated. While
  // the daemon is down, or while any process of the tenant there is not a client (it escaped MPS,
  // or it started after the last health check), pacing holds the tenant to its cap.
  return mps_.active && mpsUpOnLocked(device) && device < t.mpsClientsOnly.size() && t.mpsClientsOnly[device] != 0;
}

bool Broker::mpsUpOnLocked(size_t device) const {
  // Per device where the daemons are one per MIG device: one daemon down leaves the others' up.
  return mps_.deviceUp.empty() ? mps_.up : device < mps_.deviceUp.size() && mps_.deviceUp[device] != 0;
}

void Broker::mpsClientsLocked() {
  // Devices whose daemon answers (one per MIG device, or the whole GPUs' one): a process there that
  // is not in a server's client list escaped MPS; one on a device whose daemon is down cannot be a
  // client and is only paced.
  uint64_t upMask = 0;
  for (size_t d = 0; d < devices_.size() && d < 64; ++d)
    if (mpsUpOnLocked(d)) upMask |= uint64_t{1} << d;
  const bool mps = mps_.active && upMask != 0;
  std::set<int> clients;  // host pids: the daemon runs in the broker's pid namespace
  if (mps)
    for (const MpsServerSnapshot& s : mps_.servers) clients.insert(s.clients.begin(), s.clients.end());
  const uint64_t now = monoNs();
  for (auto& [name, tp] : tenants_) {
    TenantState& t = *tp;
    t.mpsClientsOnly.assign(devices_.size(), 0);
    if (!mps || !t.ledger) {
      t.notMpsClients.clear();
      continue;
    }
    // Its live processes (host pids) with the devices they use: a slot's holder may use any
    // device (its slot is claimed before the driver starts); NVML names the devices of the
    // processes it lists, a process that left its slot (or never took one) included.
    std::map<int, uint64_t> procs;
    if (!guarded([&] {
          for (const Ledger::SlotUsage& u : t.ledger->slots())
            if (const int h = t.ledger->slotHolderPid(u.slot); u.pid != 0 && h > 0) procs[h] = ~uint64_t{0};
        })) {
      faultLocked(&t);
      continue;
    }
    for (const auto& [pid, p] : deviceProcesses_)
      if (p.tenant == name) procs[pid] |= p.devices;
    uint64_t outside = 0;  // devices where a process of the tenant is not a client
    std::map<int, std::pair<uint64_t, bool>> still;
    for (const auto& [pid, devices] : procs) {
      if (clients.count(pid)) continue;
      outside |= devices;
      if ((devices & upMask) == 0) continue;  // only where no daemon answers: nothing escaped
      auto seen = t.notMpsClients.find(pid);
      std::pair<uint64_t, bool> s = seen == t.notMpsClients.end() ? std::make_pair(now, false) : seen->second;
      // A new client shows in the server's list at the next health check (about a second): one
      // that is still missing after kMpsClientGrace is not a client.
      if (!s.second && now - s.first >= kMpsClientGrace) {
        s.second = true;
        tamperLocked(&t, "not-mps-client");
        CUSHARE_BLOG(warn, "tenant {}: process {} uses the device but is not a client of the broker's MPS server "
                     "(its MPS settings were defeated, or it reached the driver around the shim): the tenant is "
                     "paced on its devices as without MPS while it runs", name, pid);
      }
      still[pid] = s;
    }
    t.notMpsClients = std::move(still);
    for (size_t d = 0; d < devices_.size(); ++d) t.mpsClientsOnly[d] = d < 64 && !(outside >> d & 1) ? 1 : 0;
  }
}

void Broker::computeSnapshotLocked(const std::string& tenant, size_t device, TenantDeviceSnapshot* out) const {
  if (!compute_) return;
  const auto it = compute_->tenants.find(tenant);
  if (it == compute_->tenants.end() || device >= it->second.size()) return;
  out->busyNs = it->second[device].busyTotal;
  out->meteredBusyNs = it->second[device].metered;
  out->deviceBusyNs = it->second[device].device;
  out->shareNs = it->second[device].share;
  out->throttledNs = it->second[device].throttledTotal;
  out->paced = it->second[device].paced;
  out->contending = it->second[device].contending;
  out->fairTarget = it->second[device].target;
  out->fairAchieved = it->second[device].achieved;
  if (!probes_) return;
  if (const std::optional<ProbeView> v = probes_->view(tenant, device); v && v->known) {
    const probe::TenantWindow& w = v->window;
    TenantDeviceSnapshot::Probe& p = out->probe;
    p.known = true;
    p.complete = v->complete;
    p.enough = w.compute_share.enough;
    p.share = w.compute_share.value;
    p.shareError = w.compute_share.stderr_;
    p.rounds = w.rounds;
    p.roundsWithWork = w.rounds_with_work;
    p.missing = w.missing;
    p.bad = w.bad;
    p.regime = probe::regimeName(w.regime);
    p.startedFraction = w.started_fraction;
    if (w.regime == probe::Regime::kConcurrent && (w.spatial > 0 || w.temporal > 0 || w.intra > 0)) {
      p.spatial = w.spatial;
      p.temporal = w.temporal;
      p.intra = w.intra;
    }
    if (w.bandwidth_share.known) p.bandwidthShare = w.bandwidth_share.value;
    p.computeIndex = w.compute_index;
    p.bandwidthIndex = w.bandwidth_index;
    p.latencyIndexNs = w.latency_index_ns;
    p.latencyP95Ns = w.latency_p95_ns;
    p.windowSeconds = static_cast<double>(v->windowNs) / 1e9;
    p.lastError = w.last_error;
    if (it->second[device].sharedSms && w.regime == probe::Regime::kConcurrent)
      p.caveat = "shares SMs with other MPS clients (their percentages and its own sum over 100 %): the share is "
                 "the SMs it reaches, not its part of them";
  }
}

std::chrono::microseconds Broker::computeTick() {
  std::lock_guard<std::mutex> g(mu_);
  if (!compute_) compute_ = std::make_shared<ComputeState>();
  if (!probes_) probes_ = std::make_unique<ProbeScheduler>(config_.probes, ledgerDir_, devices_.size());
  probes_->configure(config_.probes);
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
        td.work = td.inflight = false;
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
            const uint64_t moved = take(busy, &last.busy);
            td.metered += moved;
            td.throttledTotal += take(thr, &last.throttled);
            if (moved != 0) last.lastMove = now;
          } else {
            last.busy = busy;
            last.throttled = thr;
          }
          const uint32_t in = c->inflight.load(std::memory_order_seq_cst);
          const uint32_t act = c->activity.load(std::memory_order_seq_cst);
          if (in != last.stuck) last.stuck = 0;  // it moved: live again
          if (in != 0 && in < kInFlightSane && last.stuck == 0) {
            td.work = td.inflight = true;
            last.lastMove = now;
          }
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
        }
        if (td.work) {
          if (td.lastWork == 0 || td.workSince == 0) td.workSince = now;
          td.lastWork = now;
        } else {
          td.workSince = 0;
        }
        // The device's own count (from the tick), from the step the tenant was first seen on.
        const uint64_t counted = d < t.deviceBusy.size() ? t.deviceBusy[d] : 0;
        if (!td.seen) td.deviceBase = counted;
        td.device = counted - std::min(counted, td.deviceBase);
        // Billed: the larger of the two totals. (Bounding what was metered beyond the device's
        // count was tried and dropped: metered time includes waits behind other contexts' slices,
        // which pacing and priorities charge on purpose; bounded, a low priority tenant left its
        // floor and a process outside MPS its cap. So a tenant can still bank metered time ahead
        // of the device: docs/security.md.)
        td.busyTotal = std::max({td.busyTotal, td.metered, td.device});
        if (td.suspect && td.busyTotal > td.suspectBusy) td.suspect = false;  // it ran: believed again
        td.seen = true;
        td.busyStep = td.busyTotal - busyBefore;
      }
    });
    if (!ok) faultLocked(&t);
  }

  // The thrashing guard's turns between managed bursters, from this step's work.
  thrashStepLocked(cs, now);

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
      bool mps = false;    // left to MPS: all its processes here are clients (never paced)
      bool mpsTurns = false;  // all its processes here are clients, and it takes weighted turns
      int word = 100;         // the cap published in its words (its percentage, also under MPS)
      uint32_t weight = 1;
      bool thrash = false;    // takes the thrashing guard's turns here (gated whatever else holds)
      bool held = false;      // ... and it is not its turn: its gate stays closed
    };
    std::vector<Member> members;
    // Held back by the thrashing guard (not their turn): out of the scheduler's reckoning entirely
    // (their waiting launches are no work, no priority, no contention, no turn), gated closed.
    std::vector<Member> held;
    bool capped = false;
    uint32_t topBand = 2;
    for (auto& [name, tp] : tenants_) {
      TenantState& t = *tp;
      if (!t.ledger || d >= t.entry.size() || t.entry[d] < 0) continue;
      const int cap = std::clamp(threadsLocked(t).value_or(100), 1, 100);
      Member m{&t, &cs.tenants[name][d], t.ledger->compute(t.entry[d]), cap, priorityWord(priorityLocked(t))};
      m.mps = computeUnderMpsLocked(t, d);
      bool draining = false;
      m.held = thrashHeldLocked(name, d, &m.thrash, &draining);
      m.word = cap;
      m.weight = std::max<uint32_t>(1, t.config.weight);
      // The guard's holder while its turn drains stays in the reckoning (gated: its work in flight
      // is charged and ends its scheduler turn through the scheduler's own drain); the others held
      // are out of it.
      if (m.held && !draining) {
        m.td->contending = m.td->mpsTurns = m.td->sharedSms = false;
        m.td->target = m.td->achieved = 0.0;
        held.push_back(m);
        continue;
      }
      if (m.td->lastWork != 0 && now - m.td->lastWork < kPriorityActive) topBand = std::min(topBand, m.band);
      members.push_back(m);
    }
    bool differ = false;
    // A tenant left to MPS counts for the priorities of the others (its work holds lower ones
    // back), but takes no turn and is never gated (unless weights take it into turns, below).
    for (Member& m : members) {
      m.lower = m.band > topBand && m.td->lastWork != 0 && now - m.td->lastWork < kPriorityActive;
      differ = differ || (m.lower && !m.mps);
    }
    // Weights under MPS (docs/compute.md, "Weights under MPS"; compute.mps_weights, off by
    // default: gating binds cooperating processes only, where the server binds every client).
    // Clients side by side share the SMs they both reach by the hardware's dispatch, not by
    // weight. The MPS tenants among the would-be contenders take the weighted turns like any
    // other (gated, the server still bounding their SMs, so no time cap of their own) where their
    // weights per process differ and turns idle no SM that side by side would fill: one client
    // beside tenants outside MPS (which time-slice against the server), or clients that all reach
    // every SM; and only where every client with work here is among them (a lower-priority or
    // suspect client left side by side would take the SMs of every turn). Once in force it holds
    // for kFairControl after a contender's work or process count no longer calls for it, so that
    // their flickering does not gate and ungate the clients every step; what rules it out (the
    // setting off, a client left out, percentages overlapping in part) ends it at once.
    const auto recentWork = [&](const Member& m) { return m.td->lastWork != 0 && now - m.td->lastWork < kFairActive; };
    const auto wouldContend = [&](const Member& m) {
      return cc.fairShare && !m.td->suspect && !m.lower && recentWork(m);
    };
    // Whether the members `in` selects have different weights per process running here
    // (different weights, or one tenant with more processes than another of the same weight).
    const auto weightsDiffer = [&](const auto& in) {
      const auto processes = [&](const Member& m) {
        uint64_t n = 0;
        for (const ComputeState::Slot& sl : m.td->slots) n += sl.lastMove != 0 && now - sl.lastMove < kFairActive;
        return std::max<uint64_t>(n, 1);
      };
      const Member* first = nullptr;
      for (const Member& m : members) {
        if (!in(m)) continue;
        if (first == nullptr) first = &m;
        else if (uint64_t{m.weight} * processes(*first) != uint64_t{first->weight} * processes(m)) return true;
      }
      return false;
    };
    {
      int n = 0, clients = 0;
      bool partial = false, leftOut = false;
      for (Member& m : members) {
        if (m.mps && recentWork(m) && !wouldContend(m)) leftOut = true;
        if (!wouldContend(m)) continue;
        ++n;
        if (m.mps) {
          ++clients;
          partial = partial || m.cap < 100;
        }
      }
      // What rules turns out ends them at once; what only flickers (a contender's work, process
      // count) ends them after the hold, which keeps in turns only the clients already in them.
      const bool barred = !cc.mpsWeights || leftOut || (clients > 1 && partial);
      const bool want = !barred && clients > 0 && n >= 2 && weightsDiffer(wouldContend);
      dev.mpsTurns.step(want, barred, now, kFairControl);
      for (Member& m : members) {
        m.mpsTurns = dev.mpsTurns.member(m.mps, wouldContend(m), m.td->mpsTurns);
        m.td->mpsTurns = m.mpsTurns;
        if (m.mpsTurns) {
          m.mps = false;
          m.cap = 100;  // its percentage is the server's bound on its SMs, not a time budget
        }
      }
      int sideBySide = 0;
      for (Member& m : members)
        if (m.mps && recentWork(m)) sideBySide += m.cap;
      for (Member& m : members) m.td->sharedSms = m.mps && recentWork(m) && sideBySide > 100;
    }
    // When a higher priority than a member's had work: now (preempts) or lately (no new turn).
    const auto higherWork = [&](const Member& m, uint64_t within) {
      for (const Member& o : members)
        if (o.band < m.band && o.td->lastWork != 0 && now - o.td->lastWork <= within) return true;
      return false;
    };
    // Work-conserving priorities: a lower priority is held to the floor only while a higher one
    // has work here, or had within the guard (compute.priority_guard_ms); otherwise it keeps its
    // own cap, still one launch in flight while the higher one is active (tight), so that the
    // higher one's next kernel waits for at most one of its kernels. Held to the floor, its credit
    // is the floor's (what it banked without the floor does not carry over).
    const uint64_t guard = uint64_t{cc.priorityGuardMs} * kMs;
    const int64_t floorPeriod = static_cast<int64_t>(period * std::max<uint32_t>(1, cc.priorityFloorPercent) / 100);
    for (Member& m : members) {
      if (m.band > topBand && higherWork(m, guard)) {
        m.cap = std::min<int>(m.cap, std::max<int>(1, static_cast<int>(cc.priorityFloorPercent)));
        m.td->credit = std::min(m.td->credit, floorPeriod);
      }
      capped = capped || (m.cap < 100 && !m.mps);
    }
    // A tenant of the top priority that is alone there and uncapped keeps its gate open while
    // priorities differ: its launches never wait for a step; lower ones yield to its work.
    Member* pinned = nullptr;
    if (differ) {
      int inTop = 0;
      for (Member& m : members)
        if (m.band == topBand && !m.mps) {
          ++inTop;
          pinned = &m;
        }
      if (inTop != 1 || pinned->cap < 100) pinned = nullptr;
    }
    // The highest priority active among the other tenants (kOthersNone: none), published for
    // processes that lower their own priority below their tenant's (launch.cpp, local caps).
    const auto othersTop = [&](const Member& m) {
      uint32_t top = kOthersNone;
      for (const Member& o : members)
        if (&o != &m && o.td->lastWork != 0 && now - o.td->lastWork < kPriorityActive) top = std::min(top, o.band);
      return top;
    };
    // Fair share: two or more tenants (outside MPS, or clients taken into the turns above) with
    // work lately share the device by weight.
    int contenders = 0;
    for (Member& m : members) {
      const bool was = m.td->contending;
      // A suspect tenant (counts that move without busy time: docs/compute.md) claims no share.
      m.td->contending = cc.fairShare && !m.mps && !m.td->suspect && m.td->lastWork != 0 &&
                         now - m.td->lastWork < kFairActive;
      if (m.td->contending && !was) {
        // Joining: no banked credit, no stale correction; its window starts now.
        m.td->fair = 0;
        m.td->correction = 1.0;
        m.td->integral = 0.0;
        m.td->fairBusyMark = m.td->charged;
        m.td->fairThrottledMark = m.td->throttledTotal;
      }
      if (!m.td->contending) m.td->target = m.td->achieved = 0.0;
      contenders += m.td->contending;
    }
    // The hardware already slices time alike between contexts: fair share takes over only where
    // that would not give shares in proportion to weights, i.e. where the contenders' weights
    // per process running there differ (different weights, or one tenant with more processes).
    // Turns cost a little at each switch (more on a loaded host), so equal tenants are left to
    // the hardware.
    const bool fairOn = contenders >= 2 && weightsDiffer([](const Member& m) { return m.td->contending; });
    if (fairOn != dev.fair) {
      dev.fair = fairOn;
      dev.fairStep = now;
      // A turn under way is charged fair time only from now: its wall time before (an uncapped
      // holder alone for seconds next to an idle capped tenant) was not fair share's, and charged
      // it would starve the holder until repaid a quantum per round.
      dev.turnFairCharged = now - dev.turnStart;
      for (Member& m : members) {
        m.td->fair = 0;
        m.td->fairBusyMark = m.td->charged;
        m.td->fairThrottledMark = m.td->throttledTotal;
      }
    }
    // A contender's quantum: its weight, corrected by the controller, of one period.
    double weights = 0;
    for (Member& m : members)
      if (m.td->contending) weights += m.weight * m.td->correction;
    const auto quantum = [&](const Member& m) {
      return static_cast<int64_t>(static_cast<double>(period) * m.weight * m.td->correction / std::max(weights, 1e-9));
    };
    const bool schedule = capped || differ || fairOn;
    // Probe rounds (probes.cpp): every tenant with its device entry here, the regime it runs in.
    {
      std::vector<ProbeTenant> pt;
      for (Member& m : members) {
        ProbeTenant x;
        x.name = m.t->name;
        x.ledger = m.t->ledger.get();
        x.entry = m.t->entry[d];
        x.work = m.td->lastWork != 0 && now - m.td->lastWork < kFairActive;
        x.regime = m.mps ? probe::Regime::kConcurrent
                         : schedule && m.td->paced ? probe::Regime::kTurns : probe::Regime::kTimeSliced;
        x.owner = m.t->owner;
        x.gid = m.t->config.gid ? static_cast<int>(*m.t->config.gid) : -1;
        x.mode = m.t->config.gid ? 0660 : 0600;
        pt.push_back(std::move(x));
      }
      for (Member& m : held) {  // no work while held: no rounds
        ProbeTenant x;
        x.name = m.t->name;
        x.ledger = m.t->ledger.get();
        x.entry = m.t->entry[d];
        x.regime = probe::Regime::kTurns;
        x.owner = m.t->owner;
        x.gid = m.t->config.gid ? static_cast<int>(*m.t->config.gid) : -1;
        x.mode = m.t->config.gid ? 0660 : 0600;
        pt.push_back(std::move(x));
      }
      probes_->step(d, now, pt, [&](const std::function<void()>& f) { return guarded(f); });
    }
    if (!schedule) {
      dev.holder.clear();
      dev.draining = false;
      dev.periodStart = 0;
    }
    Member* holder = nullptr;
    for (Member& m : members)
      if (m.t->name == dev.holder && !m.mps) holder = &m;
    if (holder == nullptr) {
      dev.holder.clear();
      dev.draining = false;
    }
    // Capped tenants pay for the device time they ran as it is metered, so a period's refill
    // never comes before the charge of the time before it. The holder pays for its turn the lower
    // of the busy time its processes metered and the turn's wall time (open to drained): the
    // turns are exclusive, so the wall time bounds its device time, and the busy time of two
    // processes of the tenant time-slicing on the device counts the slices twice. Others (who
    // should not run) pay what they metered, except just after a turn: busy time of the turn's
    // last kernels that the pacers meter after the drain (their markers are polled every 0.1 to
    // 2 ms) is paid up to the turn's wall time that was not charged (its allowance), since it is
    // the turn's; the slices of several processes of the tenant counted more than once are not
    // (before, they were: a tenant of three processes got a third of its fair share).
    // Charging a tenant alone (docs/compute.md): event metering times a stream from its launch to
    // its marker's completion, seen at the pacer's passes (0.1 ms), so a launch-bound stream of
    // short kernels (the device idle between launches) meters nearly all of its wall time. While
    // nobody else has work on the device there is nobody its work waited behind, and the device's
    // own count (NVML, busy_check.cpp) is the truth: the metered time is scaled by the device's
    // count over the metered time of the last window (at most 1), and at each window's end a
    // tenant charged less than the device counted pays the difference. Where others have work,
    // or the device gives no count, the scale is 1.
    for (Member& m : members) {
      ComputeState::TenantDevice& td = *m.td;
      bool alone = !m.mps;
      for (const Member& o : members)
        if (&o != &m && o.td->lastWork != 0 && now - o.td->lastWork < kFairActive) alone = false;
      if (!alone) {
        td.aloneStart = 0;
        td.scale = 1.0;
        continue;
      }
      if (td.aloneStart != 0 && now - td.aloneStart >= kAloneWindow) {
        const uint64_t metered = td.metered - td.aloneMetered, counted = td.device - td.aloneDevice;
        // A window charged at a scale pays at least what the device counted in it. (Unscaled, the
        // metered time is at least the device's count, up to NVML's lag, which must not be
        // charged twice.)
        if (td.scale < 1.0 && counted > td.aloneCharged && m.cap < 100)
          td.credit -= static_cast<int64_t>(counted - td.aloneCharged);
        // Only a clear over-count is scaled (a device-bound tenant meters what the device counts,
        // up to NVML's sampling lag, and keeps its exact charge).
        const double ratio =
            metered >= kAloneMinMetered && counted > 0 ? static_cast<double>(counted) / static_cast<double>(metered) : 1.0;
        td.scale = ratio < kAloneScaleFrom ? std::max(ratio, kAloneMinScale) : 1.0;
        td.aloneStart = 0;
      }
      if (td.aloneStart == 0) {
        td.aloneStart = now;
        td.aloneMetered = td.metered;
        td.aloneDevice = td.device;
        td.aloneCharged = 0;
      }
    }
    const auto scaled = [](const Member& m, uint64_t ns) {
      return m.td->scale >= 1.0 ? ns : static_cast<uint64_t>(static_cast<double>(ns) * m.td->scale);
    };
    // Device share (docs/compute.md, "Device share"): each tenant's busy time this step (scaled
    // as charged, alone) times the fraction of the SMs it could use (its MPS percentage; all of
    // them outside MPS), the sum over the device's tenants held to the step's wall time (busy
    // times of time-slicing tenants each include the others' slices; the device ran one).
    if (sinceLast != 0) {
      const auto wants = [&](const Member& m) {
        return static_cast<double>(scaled(m, m.td->busyStep)) * (m.mps || m.mpsTurns ? m.word / 100.0 : 1.0);
      };
      double want = 0;
      for (const Member& m : members) want += wants(m);
      const double fit = want > static_cast<double>(sinceLast) ? static_cast<double>(sinceLast) / want : 1.0;
      for (Member& m : members) {
        const double part = wants(m) * fit + m.td->shareCarry;
        const uint64_t whole = static_cast<uint64_t>(part);
        m.td->share += whole;
        m.td->shareCarry = part - static_cast<double>(whole);
      }
    }
    if (schedule)
      for (Member& m : members) {
        if (m.mps || (m.cap >= 100 && !fairOn)) continue;
        uint64_t pay = std::min<uint64_t>(scaled(m, m.td->busyStep), 4 * period);
        // Fair credit: the holder pays its turn's wall time (the device was its alone, used or
        // not: a tenant whose work is not metered, or whose counts lie, pays for its turns all
        // the same); others pay what they metered, nothing just after their turn (its wall time
        // covered those kernels).
        uint64_t fairPay = pay;
        const bool late = m.td->turnEnd != 0 && now - m.td->turnEnd < kLateGrace;
        if (&m != holder && late) {
          pay = std::min(pay, m.td->allowance);
          m.td->allowance -= pay;
          fairPay = 0;
        }
        if (&m == holder) {
          dev.turnBusy += scaled(m, m.td->busyStep);
          const uint64_t owed = std::min(dev.turnBusy, now - dev.turnStart);
          pay = owed > dev.turnCharged ? owed - dev.turnCharged : 0;
          dev.turnCharged += pay;
          fairPay = now - dev.turnStart - dev.turnFairCharged;
          dev.turnFairCharged += fairPay;
        }
        if (m.cap < 100) m.td->credit -= static_cast<int64_t>(pay);
        if (m.td->aloneStart != 0) m.td->aloneCharged += pay;
        if (fairOn) {
          m.td->fair -= static_cast<int64_t>(fairPay);
          m.td->charged += fairPay;
        }
      }
    // Weighted deficit round robin: once no contender with work has fair credit left (each had
    // its weight's share of the round), every contender gets its quantum again. A contender
    // without work keeps at most one quantum, so the device goes to those with work: work
    // conserving, and in proportion to weights among the ones that saturate.
    if (fairOn) {
      bool waiting = false, credit = false;
      for (Member& m : members) {
        if (!m.td->contending || !m.td->work || (m.cap < 100 && m.td->credit <= 0)) continue;
        waiting = true;
        credit = credit || m.td->fair > 0;
      }
      if (waiting && !credit)
        for (Member& m : members)
          if (m.td->contending) {
            ++m.td->rounds;
            m.td->spent += m.td->fair <= 0;
            m.td->fair = std::min(m.td->fair + quantum(m), quantum(m));
          }
    }
    // The controller (PI, every kFairControl): the shares contenders achieved (the device time
    // they paid for, of all the contenders' in the window: their turns bound it by wall time,
    // where raw busy time counts the slices of a tenant's several processes more than once)
    // against weight-proportional targets.
    // A contender that left most of its quanta unspent has less work than its weight would give
    // it: it keeps what it used and the others share the rest by weight (its target is what it
    // got; no correction). The correction scales a quantum within [kFairMin, kFairMax], with a
    // deadband so that noise does not move it, and the integral only where a quantum was spent
    // (no wind-up while a tenant is short of work).
    // While priorities differ the shares are the priorities' (floors, yields), not the weights':
    // the controller stands still and starts again from no correction.
    if (fairOn && differ) {
      dev.fairStep = now;
      for (Member& m : members) {
        m.td->correction = 1.0;
        m.td->integral = 0.0;
        m.td->rounds = m.td->spent = 0;
        m.td->target = m.td->achieved = 0.0;
        m.td->fairBusyMark = m.td->charged;
      }
    }
    if (fairOn && now - dev.fairStep >= kFairControl) {
      dev.fairStep = now;
      double total = 0, usedByLight = 0, heavyWeights = 0;
      for (Member& m : members) {
        if (!m.td->contending) continue;
        total += static_cast<double>(m.td->charged - m.td->fairBusyMark);
      }
      for (Member& m : members) {
        if (!m.td->contending) continue;
        ComputeState::TenantDevice& td = *m.td;
        td.achieved = total > 0 ? static_cast<double>(td.charged - td.fairBusyMark) / total : 0.0;
        const bool light = td.rounds > 0 && 2 * td.spent < td.rounds;
        if (light) usedByLight += td.achieved;
        else heavyWeights += m.weight;
      }
      for (Member& m : members) {
        if (!m.td->contending) continue;
        ComputeState::TenantDevice& td = *m.td;
        const bool light = td.rounds > 0 && 2 * td.spent < td.rounds;
        if (light || total <= 0 || heavyWeights <= 0) {
          td.target = td.achieved;
          td.integral *= 0.5;
        } else {
          td.target = std::max(0.0, 1.0 - usedByLight) * m.weight / heavyWeights;
          double e = td.target - td.achieved;
          if (std::abs(e) < kFairDeadband) e = 0;
          const double rel = td.target > 0 ? e / td.target : 0.0;
          td.integral = std::clamp(td.integral + rel, -2.0, 2.0);
          td.correction = std::clamp(1.0 + kFairKp * rel + kFairKi * td.integral, kFairMin, kFairMax);
        }
        if (light) td.correction = 1.0 + (td.correction - 1.0) * 0.5;
        CUSHARE_BLOG(debug, "fair device {} tenant {}: achieved {:.3f} target {:.3f} correction {:.3f} rounds {} spent {}",
                     d, m.t->name, td.achieved, td.target, td.correction, td.rounds, td.spent);
        td.rounds = td.spent = 0;
        td.fairBusyMark = td.charged;
        td.fairThrottledMark = td.throttledTotal;
      }
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
        if (&m != holder && !m.mps && !m.held && m.band <= holder->band && m.td->work && m.td->credit > 0)
          othersWait = true;
      bool cutIn = false;
      if (fairOn && used >= static_cast<int64_t>(kFairSlice)) {
        const auto left = [&](const Member& m) {
          const int64_t q = std::max<int64_t>(quantum(m), 1);
          return static_cast<double>(m.td->fair) / static_cast<double>(q);
        };
        for (Member& m : members)
          if (&m != holder && m.td->contending && m.band <= holder->band && m.td->work && m.td->credit > 0 &&
              m.td->fair > 0 && left(m) > left(*holder) + kFairCutMargin)
            cutIn = true;
      }
      const bool preempted = higherWork(*holder, 0);  // a higher priority has work now
      const bool emptySuspect = holder->td->suspect && holder->td->busyTotal == dev.turnBusyStart &&
                                now - dev.turnStart >= kSuspectIdle;
      // An idle holder keeps its turn while nobody else has work (outside fair share, where the
      // turn's wall time is its price): its next launch then finds the gate open instead of
      // waiting for a step to give it a turn again (docs/compute.md, "The scheduler").
      bool anotherWants = false;
      for (Member& m : members)
        if (&m != holder && !m.mps && !m.held && m.td->work) anotherWants = true;
      const bool idleEnd = idle && now - dev.idleSince >= kIdlePass && (fairOn || anotherWants);
      const bool end = idleEnd || holder->held || (holder->cap < 100 && holder->td->credit <= 0) ||
                       (fairOn && holder->td->fair <= 0 && othersWait) || cutIn ||
                       (othersWait && used >= static_cast<int64_t>(period / 2)) || preempted || emptySuspect;
      if (end) {
        dev.draining = true;
        dev.drainStart = now;
      }
    }
    if (schedule && holder != nullptr && dev.draining) {
      const uint64_t limit = holder->td->suspect ? kSuspectDrain : kDrainLimit;
      if (!holder->td->inflight || now - dev.drainStart > limit) {
        if (holder->td->inflight) {
          if (!holder->td->suspect)
            CUSHARE_BLOG(warn, "tenant {} device {}: in-flight work did not drain within {} ms (a stopped process, "
                         "or its ledger written): next turn; the counts are not taken for work until they move",
                         holder->t->name, devices_[d].name(), kDrainLimit / kMs);
          // No busy time in the whole turn: its counts are not believed (short turns and drains)
          // until its busy time moves.
          if (holder->td->busyTotal == dev.turnBusyStart) {
            holder->td->suspect = true;
            holder->td->suspectBusy = holder->td->busyTotal;
          }
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
        holder->td->turnEnd = now;
        const uint64_t wall = now - dev.turnStart;
        holder->td->allowance = wall > dev.turnCharged ? wall - dev.turnCharged : 0;
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
      // A lower priority keeps its floor: while the higher ones' work leaves it no turn of its
      // own (the higher one pinned, or out of credit), it takes turns on its floor credit, each
      // preempted at the next step (one kernel, tight), so the higher one waits at most one.
      // A higher priority that has had work for kFloorAfter without a break saturates the device:
      // a lower one then takes turns on its floor credit (otherwise it waits for the higher one's
      // burst to end, so that a bursty high tenant's kernels do not wait behind its floor turns).
      const auto higherSaturates = [&](const Member& m) {
        for (const Member& o : members)
          if (o.band < m.band && o.td->workSince != 0 && now - o.td->workSince >= kFloorAfter) return true;
        return false;
      };
      const auto eligible = [&](const Member& m) {
        // Fair credit orders the contenders of one priority; a lower one next to an active higher
        // one is held to its floor instead, and a tenant that does not contend (suspect) is not
        // held by a credit nobody refills.
        const bool fairOk = !fairOn || !m.td->contending || m.lower || m.td->fair > 0;
        return &m != pinned && !m.mps && !m.held && m.td->work && m.td->credit > 0 && fairOk &&
               (m.lower ? !higherWork(m, 0) || higherSaturates(m) : !higherWork(m, kPriorityYield));
      };
      uint32_t best = 3;
      for (Member& m : members)
        if (eligible(m)) best = std::min(best, m.band);
      for (size_t i = 0; i < members.size(); ++i) {
        Member& m = members[(dev.next + i) % members.size()];
        if (m.band == best && eligible(m)) {
          holder = &m;
          dev.holder = m.t->name;
          dev.turnStart = now;
          dev.turnBusy = dev.turnCharged = dev.turnFairCharged = 0;
          dev.turnBusyStart = m.td->busyTotal;
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
    const auto writeWords = [&](Member& m) {
      if (beat && !guarded([&] { m.words->gate_epoch.fetch_add(1); })) faultLocked(m.t);
      // The thrashing guard gates its members whatever the scheduler says (under MPS too), and
      // keeps every gate but the holder's closed; where the scheduler gates as well, both must open.
      const bool scheduled = schedule && &m != pinned && !m.mps && !m.held;
      const bool paced = scheduled || m.thrash;
      const uint32_t mode = (cc.metering || schedule || m.thrash ? kComputeMetered : 0) | (paced ? kComputePaced : 0) |
                            (scheduled && m.lower ? kComputeTight : 0);
      const bool open = (!scheduled || (holder == &m && !dev.draining)) && !m.held;
      m.td->paced = paced;
      m.td->open = open;
      if (!guarded([&] {
            LedgerComputeDevice* w = m.words;
            if (w->mode.load() != mode) w->mode.store(mode, std::memory_order_seq_cst);
            const uint32_t cap = static_cast<uint32_t>(m.mpsTurns ? m.word : m.cap) * 100;
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
    };
    for (Member& m : members) writeWords(m);
    for (Member& m : held) writeWords(m);
  }
  // Forget tenants that are gone.
  for (auto it = cs.tenants.begin(); it != cs.tenants.end();) {
    if (tenants_.count(it->first)) {
      ++it;
      continue;
    }
    probes_->forget(it->first);  // its probe file closed and removed
    it = cs.tenants.erase(it);
  }
  bool any = false;
  for (const ComputeState::Device& dev : cs.devices) any = any || dev.periodStart != 0;
  for (const ThrashGroup& tg : thrash_) any = any || tg.on;
  if (fast) return std::chrono::microseconds(100);
  return any ? std::chrono::microseconds(1000) : std::chrono::microseconds(20000);
}

bool Broker::thrashHeldLocked(const std::string& tenant, size_t d, bool* member, bool* draining) const {
  *member = false;
  *draining = false;
  const size_t n = devices_.size();
  if (d >= n || thrash_.size() != n) return false;
  const ThrashGroup& tg = thrash_[std::min(devices_[d].group(d), n - 1)];
  if (!tg.on || !std::binary_search(tg.members.begin(), tg.members.end(), tenant)) return false;
  // Only on the devices where it bursts: elsewhere its work evicts nothing of the others'.
  const auto it = tenants_.find(tenant);
  if (it == tenants_.end() || d >= it->second->managedBurst.size() || it->second->managedBurst[d] == 0) return false;
  *member = true;
  *draining = tg.holder == tenant && tg.draining;
  return tg.holder != tenant || tg.draining;
}

// The thrashing guard, per memory group, every compute step (docs/memory-elasticity.md,
// "Thrashing"). Managed bursters with work lately whose bursts together exceed the group's room
// (what managed memory can be resident in) would evict each other's pages at every switch of the
// device between them, each kernel waiting for its faults: instead they take turns, one holder at a
// time with its gate open for thrash_quantum_ms (less when it runs out of work), the others' gates
// closed; a turn ends by closing the holder's gate and waiting for its work in flight to drain
// (at most kDrainLimit), so the next holder's faults evict a working set no longer in use. Tenants
// that do not burst are not gated by it. It ends once the bursters with work have fitted in the
// room, or fewer than two have had work, for kThrashCalm.
void Broker::thrashStepLocked(ComputeState& cs, uint64_t now) {
  const size_t n = devices_.size();
  thrash_.resize(n);
  const ElasticityConfig& ec = config_.elasticity;
  const uint64_t quantum = uint64_t{ec.thrashQuantumMs} * kMs;
  for (size_t g = 0; g < n; ++g) {
    ThrashGroup& tg = thrash_[g];
    struct Burster {
      std::string name;
      uint64_t burst = 0;
      bool work = false, inflight = false, open = false, suspect = false;
      uint64_t lastWork = 0, busy = 0;
    };
    std::vector<Burster> active;  // tenants_ is a map: sorted by name
    uint64_t sum = 0;
    for (auto& [name, tp] : tenants_) {
      const TenantState& t = *tp;
      const auto it = cs.tenants.find(name);
      if (it == cs.tenants.end()) continue;
      Burster b{name};
      for (size_t d = 0; d < n && d < it->second.size() && d < t.managedBurst.size(); ++d) {
        if (std::min(devices_[d].group(d), n - 1) != g || t.managedBurst[d] == 0) continue;
        const ComputeState::TenantDevice& td = it->second[d];
        b.burst = addSaturated(b.burst, t.managedBurst[d]);
        b.work = b.work || td.work;
        b.inflight = b.inflight || td.inflight;
        b.open = b.open || td.open;  // its gate as the last step left it (the scheduler's too)
        b.lastWork = std::max(b.lastWork, td.lastWork);
        b.busy += td.busyTotal;
      }
      // A suspect (it claimed work through a whole stall) is trusted again once its busy time moves.
      if (const auto sus = tg.suspect.find(name); sus != tg.suspect.end()) {
        if (b.busy == sus->second) b.suspect = true;
        else tg.suspect.erase(sus);
      }
      if (b.burst == 0 || b.lastWork == 0 || now - b.lastWork >= kThrashActive) continue;
      sum = addSaturated(sum, b.burst);
      active.push_back(std::move(b));
    }
    const bool crowded = ec.thrashGuard && tg.room != kNoLimit && active.size() >= 2 && sum > tg.room;
    std::string names;
    for (const Burster& b : active) names += (names.empty() ? "" : ", ") + b.name;
    if (!tg.on) {
      if (!crowded) continue;
      tg.on = true;
      tg.onSince = now;
      tg.calmSince = 0;
      tg.turnsAtOn = tg.turns;
      tg.holder.clear();
      tg.draining = false;
      CUSHARE_BLOG(warn, "device {}: the managed bursts of {} ({} together) do not fit in the {} the device has for "
                   "them: they would evict each other's pages at every switch, so they take turns of {} ms "
                   "(elasticity.thrash_quantum_ms)", devices_[g].name(), names, formatSize(sum),
                   formatSize(tg.room), ec.thrashQuantumMs);
    } else if (!ec.thrashGuard) {
      tg.on = false;  // switched off by a reload: every gate it closed opens at this step
    } else if (crowded) {
      tg.calmSince = 0;
    } else if (tg.calmSince == 0) {
      tg.calmSince = now;
    } else if (now - tg.calmSince >= kThrashCalm) {
      tg.on = false;
    }
    if (!tg.on) {
      CUSHARE_BLOG(info, "device {}: the managed bursters' turns end after {:.1f} s ({} turns): {}",
                   devices_[g].name(), static_cast<double>(now - tg.onSince) / 1e9, tg.turns - tg.turnsAtOn,
                   ec.thrashGuard ? "their bursts fit in the room, or fewer than two have work" : "thrash_guard is off");
      tg.members.clear();
      tg.suspect.clear();
      tg.holder.clear();
      tg.draining = false;
      continue;
    }
    // Members: those with work lately (a burster waiting at its closed gate has work).
    tg.members.clear();
    for (const Burster& b : active) tg.members.push_back(b.name);
    const auto find = [&](const std::string& name) -> const Burster* {
      for (const Burster& b : active)
        if (b.name == name) return &b;
      return nullptr;
    };
    // The next holder after `after` in name order, round robin: among those with work now that are
    // not suspect, else those with work, else any member; empty if there are none.
    const auto next = [&](const std::string& after) {
      for (int pass = 0; pass < 3; ++pass) {
        const Burster* first = nullptr;
        for (const Burster& b : active) {
          if (pass < 2 && !b.work) continue;
          if (pass == 0 && b.suspect) continue;
          if (first == nullptr) first = &b;
          if (b.name > after) return b.name;
        }
        if (first != nullptr) return first->name;
      }
      return std::string();
    };
    const auto give = [&](const std::string& to) {
      tg.holder = to;
      tg.draining = false;
      tg.turnStart = tg.busyAt = now;
      if (const Burster* b = find(to)) tg.busyMark = b->busy;
      if (!to.empty()) ++tg.turns;
    };
    const Burster* h = find(tg.holder);
    if (h == nullptr) {  // no holder yet, or it left (no work lately, gone, suspect)
      give(next(tg.holder));
      continue;
    }
    // Only time its gate stood open counts towards a stall (a cap or a priority may close it).
    if (h->busy != tg.busyMark || !h->open) {
      tg.busyMark = h->busy;
      tg.busyAt = now;
    }
    // Another with work that is not suspect (a suspect never keeps the holder waiting).
    bool anotherWants = false;
    for (const Burster& b : active) anotherWants = anotherWants || (b.name != tg.holder && b.work && !b.suspect);
    // Work claimed, nothing run: the turn ends through the drain, the holder is suspect.
    const uint64_t stall = h->suspect ? kThrashSuspectStall : std::clamp(quantum / 2, kThrashStallMin, kThrashStallMax);
    if (!tg.draining && anotherWants && h->work && now - tg.busyAt >= stall) {
      if (!h->suspect)
        CUSHARE_BLOG(warn, "device {}: thrashing guard: {} claimed work for {} ms of its turn without running any: "
                     "its turn ends, and it gets one only when nobody else has work until its busy time moves",
                     devices_[g].name(), tg.holder, (now - tg.busyAt) / kMs);
      tg.suspect[tg.holder] = h->busy;
      tg.draining = true;
      tg.drainStart = now;
    }
    if (!tg.draining) {
      const bool idle = !h->work && now - h->lastWork >= kThrashIdlePass;
      if (anotherWants && (now - tg.turnStart >= quantum || idle)) {
        tg.draining = true;
        tg.drainStart = now;
      }
    }
    if (tg.draining && (!h->inflight || now - tg.drainStart > kDrainLimit)) {
      give(next(tg.holder));
      CUSHARE_BLOG(debug, "device {}: thrashing guard: {}'s turn", devices_[g].name(), tg.holder);
    }
  }
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
