// Launches: metering and pacing (docs/compute.md). Every launch road of hooks.def comes through
// launchOn(). Three cases, by the broker's mode word for the device in the tenant's ledger:
//  - mode 0 (no broker, or compute off): the launch trampoline (interpose.cpp) reads the launch
//    word (gLaunchWord, published here) and jumps to the real launch: two loads and a branch;
//  - metered: the stream is noted (a hash probe and an atomic add), so that the pacer thread
//    records timing events on it and turns them into busy time;
//  - paced: as metered, and the launch first takes a place in the process's in-flight bound and
//    checks the gate (one atomic add on the shared slot, one load of the gate). Closed gate or full
//    bound: the launching thread waits on a futex (no spin, no lock held), the wait counted as
//    throttled time.
// The pacer thread (started by the first metered launch, off the launch path) records a marker
// event after each stream's new launches, polls them in order, and adds the union of the
// intervals its streams were executing to the slot's busy_ns, then lowers in-flight. Where CUPTI
// starts (CUSHARE_METERING=cupti|auto, cupti_source.cpp) the busy time comes from its activity
// records instead, and the markers only count completions.
// A process whose environment lowers its own cap or priority below its tenant's
// (CUSHARE_THREAD_PERCENTAGE, CUSHARE_PRIORITY) also keeps a budget of its own per device (a
// local cap, kept by the pacer from the same busy time, whichever source gives it): its launches
// are paced by a process-local gate as well as by the tenant's (docs/compute.md, "Lowering from
// the environment").
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "policy/busy_source.h"
#include "policy/cupti_source.h"
#include "policy/probe_thread.h"
#include "runtime/log.h"
#include "runtime/mps_env.h"
#include "runtime/state.h"

namespace cushare::shim {

// Launches of one process on one device not yet known complete, while paced: closing the gate
// takes effect after at most this many kernels (docs/compute.md).
inline constexpr uint32_t kInFlightBound = 2;
// A closed gate that sees no opening for this long: the broker is taken to be gone.
inline constexpr uint64_t kBrokerGoneNs = 3'000'000'000ull;

namespace {

constexpr size_t kStreams = 128;   // streams the pacer tracks (a power of two)
constexpr size_t kPending = 8;     // markers in flight per stream
constexpr size_t kContexts = 16;

uint64_t nowNs() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

long futexWait(std::atomic<uint32_t>* word, uint32_t expected, uint64_t timeoutNs, bool shared) noexcept {
  timespec ts{static_cast<time_t>(timeoutNs / 1'000'000'000u), static_cast<long>(timeoutNs % 1'000'000'000u)};
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE,
                   expected, &ts, nullptr, 0);
}
void futexWake(std::atomic<uint32_t>* word, bool shared) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT32_MAX,
            nullptr, nullptr, 0);
}

struct Marker {
  CUevent event = nullptr;
  uint64_t count = 0;  // the stream's launches before it
  uint64_t start = 0;  // host ns the segment's work could start (0: when the previous ended)
};

// One stream the process launched on (key: the stream as given, per-thread default = 2), on one
// device ordinal. Written by the pacer under gMutex, except launched/idleStart (launch path).
struct StreamEntry {
  std::atomic<CUstream> stream{nullptr};
  std::atomic<int> dev{-1};  // -1: free
  CUcontext ctx = nullptr;
  std::atomic<uint64_t> launched{0};
  std::atomic<uint64_t> completed{0};
  std::atomic<uint64_t> idleStart{0};  // host ns of a launch that found the stream idle
  std::atomic<uint64_t> markedShared{0};  // = marked, for the launch path
  uint64_t marked = 0;
  uint64_t lastEnd = 0;  // host ns the last completed marker's work ended
  Marker pending[kPending];
  size_t head = 0, count = 0;
  bool dead = false;  // destroyed: freed once its markers are done
};

struct ContextClock {
  CUcontext ctx = nullptr;
  CUstream own = nullptr;  // the pacer's stream there (for the reference event)
  CUevent ref = nullptr;
  uint64_t refHost = 0;  // host ns of ref
  CUevent pool[64] = {};
  size_t free = 0;
};

struct Pacer {
  StreamEntry streams[kStreams];
  ContextClock clocks[kContexts];
  BusyUnion busy[kMaxDevices];           // host ns: the intervals counted so far (events)
  std::atomic<uint32_t> wake{0};         // futex: the pacer's sleep
  std::atomic<uint32_t> completions{0};  // futex: launchers waiting for the in-flight bound
  std::atomic<uint32_t> waiters{0};
  std::atomic<bool> started{false};
};

// A process's own lower cap on one device (the pacer keeps it; launchers read gate and tight).
struct LocalCap {
  std::atomic<uint32_t> on{0};          // 1: launches on the device take the local checks
  std::atomic<uint32_t> gate{kGateOpen};  // private futex word: closed while over the budget
  std::atomic<uint32_t> tight{0};       // 1: one launch in flight (yielding to a higher priority)
  uint32_t cap = kComputeNoCap;         // the rest is the pacer's (under gMutex)
  int64_t credit = 0;                   // ns of device time left (negative: debt)
  uint64_t last = 0;                    // host ns of the last refill
  std::atomic<uint64_t> used{0};        // busy ns metered since the last pass (CUPTI: any thread)
  uint32_t epoch = 0;                   // the device's gate_epoch as last seen, and since when
  uint64_t epochSince = 0;
};
// Budgets refill over this period; unused credit never exceeds one period's share.
constexpr uint64_t kLocalPeriodNs = 100'000'000;
// Set at exit, when the pacer stops: nothing refills a local budget any more, so launches made
// then (by later exit handlers) pass the local checks.
std::atomic<bool> gExiting{false};

constinit Pacer gPacer;
constinit LocalCap gLocal[kMaxDevices];
// Some device has a local cap in force: the launch path's common case takes the whole path.
constinit std::atomic<uint32_t> gLocalAny{0};
// This process's compute slot per device ordinal, once looked up (cleared in a forked child).
constinit LedgerComputeSlot* gSlots[kMaxDevices] = {};
// The gate epoch + 1 at which the broker was found gone (0: never): launches then pass a closed
// gate until the epoch changes (a broker opened it again).
constinit std::atomic<uint32_t> gGoneEpoch{0};
pthread_mutex_t gMutex = PTHREAD_MUTEX_INITIALIZER;

size_t hashOf(CUstream s, int dev) noexcept {
  const uintptr_t v = reinterpret_cast<uintptr_t>(s);
  return ((v >> 4) ^ (v >> 12) ^ static_cast<uintptr_t>(dev) * 0x9E37u) & (kStreams - 1);
}

LedgerComputeSlot* ownSlot(int ordinal) noexcept {
  ShimState& st = state();
  return st.ledger->computeSlotAt(st.devices[ordinal].ledgerIndex, st.ledger->slot());
}

// ---- the pacer thread (under gMutex unless said) ----

ContextClock* clockFor(CUcontext ctx) noexcept {
  RealDriver& d = realDriver();
  for (ContextClock& c : gPacer.clocks)
    if (c.ctx == ctx) return &c;
  for (ContextClock& c : gPacer.clocks) {
    if (c.ctx != nullptr) continue;
    if (d.p_cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return nullptr;
    if (d.p_cuStreamCreate(&c.own, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return nullptr;
    if (d.p_cuEventCreate(&c.ref, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return nullptr;
    c.ctx = ctx;
    c.refHost = 0;
    return &c;
  }
  return nullptr;
}

// A reference event whose host time is known: recorded on the pacer's idle stream and waited for.
// Renewed every 10 s (cuEventElapsedTime is a float of milliseconds).
bool refresh(ContextClock* c, uint64_t now) noexcept {
  if (c->refHost != 0 && now - c->refHost < 10'000'000'000ull) return true;
  RealDriver& d = realDriver();
  const uint64_t before = nowNs();
  if (d.p_cuEventRecord(c->ref, c->own) != CUDA_SUCCESS || d.p_cuEventSynchronize(c->ref) != CUDA_SUCCESS)
    return false;
  c->refHost = before;
  return true;
}

CUevent takeEvent(ContextClock* c) noexcept {
  if (c->free > 0) return c->pool[--c->free];
  CUevent e = nullptr;
  return realDriver().p_cuEventCreate(&e, CU_EVENT_DEFAULT) == CUDA_SUCCESS ? e : nullptr;
}
void giveEvent(ContextClock* c, CUevent e) noexcept {
  if (c->free < sizeof c->pool / sizeof c->pool[0]) c->pool[c->free++] = e;
  else realDriver().p_cuEventDestroy_v2(e);
}

// Launchers waiting for a completion or a marker look again.
void notifyLaunchers() noexcept {
  gPacer.completions.fetch_add(1, std::memory_order_release);
  if (gPacer.waiters.load(std::memory_order_acquire) != 0) futexWake(&gPacer.completions, false);
}

void finish(StreamEntry& e, uint64_t count) noexcept {
  const uint64_t before = e.completed.load(std::memory_order_relaxed);
  if (count <= before) return;
  e.completed.store(count, std::memory_order_release);
  const int dev = e.dev.load(std::memory_order_relaxed);
  if (LedgerComputeSlot* slot = ownSlot(dev)) {
    // Clamped: the slot is writable by the tenant's processes; never wrap below zero.
    uint32_t cur = slot->inflight.load(std::memory_order_relaxed);
    const uint32_t n = static_cast<uint32_t>(count - before);
    while (!slot->inflight.compare_exchange_weak(cur, cur > n ? cur - n : 0, std::memory_order_seq_cst)) {
    }
  }
  notifyLaunchers();
}

static_assert(ActivityBusy::kDevices == kMaxDevices);

// A marker's interval of the stream's work, counted once over the process's streams. Not when
// CUPTI counts the busy time.
void addBusy(int dev, uint64_t start, uint64_t end) noexcept {
  if (cuptiActive()) return;
  const uint64_t ns = gPacer.busy[dev].add(start, end);
  if (ns == 0) return;
  gLocal[dev].used.fetch_add(ns, std::memory_order_relaxed);
  if (LedgerComputeSlot* slot = ownSlot(dev)) slot->busy_ns.fetch_add(ns, std::memory_order_relaxed);
}

// CUPTI's busy time (its buffer callback, any thread): to the device's slot and its local budget,
// on metered devices.
void cuptiBusy(int dev, uint64_t ns) noexcept {
  gLocal[dev].used.fetch_add(ns, std::memory_order_relaxed);
  if (LedgerComputeSlot* slot = ownSlot(dev)) slot->busy_ns.fetch_add(ns, std::memory_order_relaxed);
}
bool cuptiMetered(int dev) noexcept {
  const LedgerComputeDevice* c = state().devices[dev].compute;
  return c != nullptr && (c->mode.load(std::memory_order_relaxed) & kComputeModeMask) != 0;
}
void flushCuptiAtExit() noexcept { flushCupti(true); }

// The busy-time source, chosen once as the pacer thread starts (docs/compute.md):
// CUSHARE_METERING=events, or CUPTI where it starts (cupti, auto), else events. On its own short
// thread: CUPTI's start can take long, and the pacer's passes (completions for the in-flight
// bound) must not wait for it; the events count busy time until CUPTI is active.
void* chooseBusySource(void*) noexcept {
  const MeteringSource m = state().config.metering;
  if (m == MeteringSource::kAuto && std::getenv("CUDA_INJECTION64_PATH") != nullptr) {
    // A profiler injected into the process owns CUPTI's activity callbacks: leave them to it.
    logLine(LogLevel::kInfo, "cushare: CUPTI activity records are not used (CUDA_INJECTION64_PATH is set: a profiler "
            "uses CUPTI): GPU busy time from events on the streams");
    return nullptr;
  }
  char why[512];
  if (startCupti(nullptr, state().deviceCount, cuptiBusy, cuptiMetered, why, sizeof why)) {
    std::atexit(flushCuptiAtExit);  // registered after libcupti loaded: runs before its teardown
    logLine(LogLevel::kInfo, "cushare: GPU busy time from CUPTI activity records");
    return nullptr;
  }
  // Asked for explicitly: said at the default level too.
  logLine(m == MeteringSource::kCupti ? LogLevel::kWarn : LogLevel::kInfo,
          "cushare: CUPTI activity records are not used (%s): GPU busy time from events on the streams", why);
  return nullptr;
}

// The local cap of a device, from the environment and the broker's words: the environment's cap
// when below 100 %; when CUSHARE_PRIORITY is below the tenant's and the broker publishes that a
// higher priority than the process's own is active among the other tenants, the floor too, with
// one launch in flight (what the broker does to a lower-priority tenant). None for an MPS client
// (its server enforces the same settings as its share of the SMs; a time budget on top would
// apply them twice, even where its tenant is paced because of a sibling outside MPS) or where the
// device is not metered (nothing measured).
// Returns the ns until the budget allows a launch again (0: it does now).
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

// Set by pass(): ns until a local budget lets launches go again (0: none waits for one).
uint64_t gLocalRefill = 0;

// One pass: markers after new launches, completed markers turned into busy time, local budgets.
// True while any marker is pending.
bool pass() noexcept {
  RealDriver& d = realDriver();
  const uint64_t now = nowNs();
  bool pending = false;
  for (StreamEntry& e : gPacer.streams) {
    const int dev = e.dev.load(std::memory_order_relaxed);
    if (dev < 0) continue;
    ContextClock* c = clockFor(e.ctx);
    if (c == nullptr || d.p_cuCtxSetCurrent(e.ctx) != CUDA_SUCCESS || !refresh(c, now)) {
      // The context is gone or unusable: nothing it holds runs any more.
      finish(e, e.launched.load(std::memory_order_acquire));
      e.count = 0;
      continue;
    }
    const uint64_t launched = e.launched.load(std::memory_order_acquire);
    if (!e.dead && launched > e.marked && e.count < kPending) {
      CUstream s = e.stream.load(std::memory_order_relaxed);
      if (s == CU_STREAM_PER_THREAD) s = CU_STREAM_LEGACY;  // another thread's: see compute.md
      CUstreamCaptureStatus cap = CU_STREAM_CAPTURE_STATUS_NONE;
      if (s != CU_STREAM_LEGACY && s != nullptr && d.p_cuStreamIsCapturing &&
          d.p_cuStreamIsCapturing(s, &cap) == CUDA_SUCCESS && cap != CU_STREAM_CAPTURE_STATUS_NONE) {
        // Captured launches do not run now (the graph's launch is metered): nothing in flight.
        e.marked = launched;
        e.markedShared.store(launched, std::memory_order_release);
        notifyLaunchers();
        if (e.count == 0) finish(e, launched);
      } else if (CUevent ev = takeEvent(c)) {
        if (d.p_cuEventRecord(ev, s) == CUDA_SUCCESS) {
          const uint64_t hint = e.idleStart.exchange(0, std::memory_order_acq_rel);
          e.pending[(e.head + e.count) % kPending] = {ev, launched, hint};
          ++e.count;
          e.marked = launched;
          e.markedShared.store(launched, std::memory_order_release);
          notifyLaunchers();
        } else {
          giveEvent(c, ev);
          e.marked = launched;
          e.markedShared.store(launched, std::memory_order_release);
          notifyLaunchers();
          if (e.count == 0) finish(e, launched);
        }
      }
    }
    while (e.count > 0) {
      Marker& m = e.pending[e.head];
      const CUresult q = d.p_cuEventQuery(m.event);
      if (q == CUDA_ERROR_NOT_READY) break;
      if (q == CUDA_SUCCESS) {
        float ms = 0;
        if (d.p_cuEventElapsedTime(&ms, c->ref, m.event) == CUDA_SUCCESS && ms >= 0) {
          const uint64_t end = c->refHost + static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
          uint64_t start = e.lastEnd;
          if (m.start > start) start = m.start;
          if (start == 0) start = end;
          addBusy(dev, start, end);
          e.lastEnd = end;
        }
      }
      giveEvent(c, m.event);
      finish(e, m.count);
      e.head = (e.head + 1) % kPending;
      --e.count;
    }
    if (e.count > 0) pending = true;
    if (e.dead && e.count == 0) {
      finish(e, e.launched.load(std::memory_order_acquire));
      e.stream.store(nullptr, std::memory_order_relaxed);
      e.dev.store(-1, std::memory_order_release);
      e.dead = false;
    }
  }
  // Activity, for the broker's scheduler: work in flight on each device this process uses.
  ShimState& st = state();
  gLocalRefill = 0;
  uint32_t any = 0;
  for (int i = 0; i < st.deviceCount; ++i) {
    if (st.devices[i].compute != nullptr) {
      const uint64_t refill = updateLocal(i, st.devices[i].compute, nowNs());
      if (refill != 0 && (gLocalRefill == 0 || refill < gLocalRefill)) gLocalRefill = refill;
      any |= gLocal[i].on.load(std::memory_order_relaxed);
    }
    LedgerComputeSlot* slot = ownSlot(i);
    if (slot == nullptr || st.devices[i].compute == nullptr) continue;
    probeCheck(i, st.devices[i].compute, st.ledger->slot());
    const uint32_t in = slot->inflight.load(std::memory_order_relaxed) != 0 ? kActivityInFlight : 0;
    constexpr uint32_t kMine = kActivityInFlight;
    uint32_t a = slot->activity.load(std::memory_order_relaxed);
    while ((a & kMine) != in &&
           !slot->activity.compare_exchange_weak(a, (a & ~kMine) | in, std::memory_order_relaxed)) {
    }
  }
  gLocalAny.store(any, std::memory_order_release);
  return pending;
}

// At exit (atexit runs before the driver's own teardown, which was loaded earlier): the pacer
// makes no more driver calls.
void stopPacerAtExit() noexcept {
  pthread_mutex_lock(&gMutex);
  gExiting.store(true, std::memory_order_release);
  pthread_mutex_unlock(&gMutex);
}

void* pacerMain(void*) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  if (state().config.metering != MeteringSource::kEvents) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, chooseBusySource, nullptr) != 0)  // signals blocked, as here
      logLine(LogLevel::kWarn, "cushare: cannot start a thread to start CUPTI: GPU busy time from events");
    pthread_attr_destroy(&attr);
  }
  uint64_t flushed = 0;
  for (;;) {
    const uint32_t seq = gPacer.wake.load(std::memory_order_acquire);
    pthread_mutex_lock(&gMutex);
    if (gExiting.load(std::memory_order_acquire)) {
      pthread_mutex_unlock(&gMutex);
      return nullptr;
    }
    const bool pending = pass();
    pthread_mutex_unlock(&gMutex);
    if (cuptiActive()) {
      // CUPTI's completed buffers (its callback turns them into busy time): every millisecond
      // while work is pending, every 20 ms otherwise.
      const uint64_t now = nowNs();
      if (now - flushed >= (pending ? 1'000'000u : 20'000'000u)) {
        flushCupti(false);
        flushed = now;
      }
    }
    // Launchers wait for the in-flight bound: poll often. Otherwise often while work is pending
    // (markers end busy intervals), rarely when idle (a launch wakes us only when it must wait).
    uint64_t sleep = gPacer.waiters.load(std::memory_order_acquire) != 0 ? 50'000
                     : pending                                             ? 100'000
                                                                           : 2'000'000;
    // A local budget that refills sooner: the pacer opens the local gate then.
    if (gLocalRefill != 0 && gLocalRefill < sleep) sleep = gLocalRefill;
    futexWait(&gPacer.wake, seq, sleep, false);
  }
  return nullptr;
}

void resetAfterFork() noexcept {
  // The pacer thread does not exist in the child; its streams and events are the parent's.
  for (StreamEntry& e : gPacer.streams) {
    e.stream.store(nullptr);
    e.dev.store(-1);
    e.count = 0;
    e.head = 0;
    e.dead = false;
  }
  for (ContextClock& c : gPacer.clocks) c = ContextClock{};
  for (LedgerComputeSlot*& slot : gSlots) slot = nullptr;
  for (BusyUnion& u : gPacer.busy) u.reset();
  cuptiForgetAfterFork();  // CUPTI's threads are the parent's: the child meters with events
  probeResetAfterFork();
  for (LocalCap& lc : gLocal) {  // the child starts its own budget (its pacer sets it)
    lc.cap = kComputeNoCap;
    lc.last = 0;
    lc.on.store(0);
    lc.tight.store(0);
    lc.gate.store(kGateOpen);
  }
  gLocalAny.store(0);
  gPacer.waiters.store(0);
  gPacer.started.store(false);
  pthread_mutex_init(&gMutex, nullptr);
}

// The stream's entry, added if new (and the pacer started). Null when the table is full.
bool pacerUsable() noexcept {
  const RealDriver& d = realDriver();
  return d.p_cuCtxGetCurrent && d.p_cuCtxSetCurrent && d.p_cuEventCreate && d.p_cuEventRecord && d.p_cuEventQuery &&
         d.p_cuEventDestroy_v2 && d.p_cuEventElapsedTime && d.p_cuStreamCreate && d.p_cuEventSynchronize &&
         d.p_cuStreamDestroy_v2;
}

__attribute__((noinline)) StreamEntry* insertStream(CUstream key, int dev) noexcept {
  // A driver without the entry points the pacer needs: launches are neither metered nor paced.
  static const bool usable = pacerUsable();
  if (!usable) return nullptr;
  pthread_mutex_lock(&gMutex);
  StreamEntry* found = nullptr;
  const size_t h = hashOf(key, dev);
  for (size_t i = 0; i < kStreams && found == nullptr; ++i) {
    StreamEntry& e = gPacer.streams[(h + i) & (kStreams - 1)];
    const int edev = e.dev.load(std::memory_order_relaxed);
    if (edev == dev && e.stream.load(std::memory_order_relaxed) == key && !e.dead) found = &e;
  }
  // A free entry, else one of the same device whose stream has nothing in flight and no marker
  // pending (given up: a later launch there takes an entry again). Its counts are never reset,
  // only caught up: a launcher that found the old stream's entry just before may still count its
  // launch here, and that launch then gets a marker of the new stream's, which gives its place in
  // the in-flight bound (on the same device's slot) back.
  StreamEntry* idle = nullptr;
  for (size_t i = 0; i < kStreams && found == nullptr; ++i) {
    StreamEntry& e = gPacer.streams[(h + i) & (kStreams - 1)];
    const int edev = e.dev.load(std::memory_order_relaxed);
    if (edev == -1) {
      idle = &e;
      break;
    }
    if (idle == nullptr && edev == dev && !e.dead && e.count == 0 &&
        e.completed.load(std::memory_order_acquire) == e.launched.load(std::memory_order_acquire))
      idle = &e;
  }
  for (StreamEntry* ep = idle; ep != nullptr && found == nullptr; ep = nullptr) {
    StreamEntry& e = *ep;
    CUcontext ctx = nullptr;
    if (realDriver().p_cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr) break;
    e.dev.store(-1, std::memory_order_release);  // while it changes hands (a given-up entry)
    e.ctx = ctx;
    const uint64_t now = e.launched.load(std::memory_order_acquire);
    e.completed.store(now, std::memory_order_release);
    e.idleStart.store(0);
    e.marked = now;
    e.markedShared.store(now, std::memory_order_release);
    e.lastEnd = 0;
    e.count = 0;
    e.head = 0;
    e.stream.store(key, std::memory_order_relaxed);
    e.dev.store(dev, std::memory_order_release);
    found = &e;
  }
  if (found == nullptr) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      logLine(LogLevel::kWarn, "cushare: more than %zu streams have work at once: launches on further streams are "
              "not metered or paced until one is idle", kStreams);
  }
  if (found != nullptr && !gPacer.started.load(std::memory_order_relaxed)) {
    static bool atfork = false;
    if (!atfork) atfork = pthread_atfork(nullptr, nullptr, resetAfterFork) == 0 && std::atexit(stopPacerAtExit) == 0;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, pacerMain, nullptr) == 0) {
      gPacer.started.store(true, std::memory_order_relaxed);
    } else {
      logLine(LogLevel::kError, "cushare: cannot start the pacer thread: launches are not metered");
    }
    pthread_attr_destroy(&attr);
  }
  pthread_mutex_unlock(&gMutex);
  return found;
}

// The device ordinal the launch goes to (the current context's), or -1.
inline int launchDevice() noexcept {
  ShimState& st = state();
  if (st.deviceCount == 1) return 0;
  CUdevice dev = -1;
  if (realDriver().p_cuCtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= st.deviceCount) return -1;
  return dev;
}

// A paced launch may go with `before` launches of the process in flight: fewer than the bound,
// and, beyond the first, only once the stream's previous launches have their marker. Otherwise
// two launches made together would share one marker, free both places at once, and be followed
// by two more together: the device would idle between every pair (docs/compute.md).
inline bool mayGo(uint32_t before, StreamEntry* e, uint32_t mode) noexcept {
  return before == 0 ||
         ((mode & kComputeTight) == 0 && before < kInFlightBound &&
          e->launched.load(std::memory_order_relaxed) <= e->markedShared.load(std::memory_order_acquire));
}

// The mode a launch on the device is checked against: the broker's, with the local cap's bits.
inline bool localOn(const LocalCap& lc) noexcept {
  return lc.on.load(std::memory_order_acquire) != 0 && !gExiting.load(std::memory_order_relaxed);
}
inline uint32_t effectiveMode(uint32_t mode, const LocalCap& lc) noexcept {
  if (!localOn(lc)) return mode;
  return mode | kComputePaced | (lc.tight.load(std::memory_order_relaxed) != 0 ? kComputeTight : 0);
}

// The paced wait: closed gate (the tenant's, or the process's own budget) or full in-flight bound.
// Returns with a place in the bound taken.
__attribute__((noinline)) void waitForTurn(LedgerComputeDevice* c, LedgerComputeSlot* slot, StreamEntry* e,
                                           LocalCap& lc) noexcept {
  const uint64_t start = nowNs();
  uint64_t gateWait = 0;
  bool blocked = false;
  uint32_t epoch = c->gate_epoch.load(std::memory_order_relaxed);
  uint64_t epochSince = start;
  for (;;) {
    const uint32_t before = slot->inflight.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t tenantMode = c->mode.load(std::memory_order_relaxed);
    // A tenant not paced has no gate to wait for (only its own budget, if any).
    const uint32_t gate = (tenantMode & kComputePaced) ? c->gate.load(std::memory_order_seq_cst) : kGateOpen;
    const uint32_t mode = effectiveMode(tenantMode, lc);
    const uint32_t local = localOn(lc) ? lc.gate.load(std::memory_order_seq_cst) : kGateOpen;
    if ((mode & kComputePaced) == 0 || (gate == kGateOpen && local == kGateOpen && mayGo(before, e, mode))) break;
    // Undo (clamped: the tenant may have written the counter) and wait.
    uint32_t cur = slot->inflight.load(std::memory_order_relaxed);
    while (cur > 0 && !slot->inflight.compare_exchange_weak(cur, cur - 1, std::memory_order_seq_cst)) {
    }
    const uint64_t t0 = nowNs();
    if (gate != kGateOpen && gGoneEpoch.load(std::memory_order_relaxed) == epoch + 1) {
      slot->inflight.fetch_add(1, std::memory_order_seq_cst);  // the broker is gone: run on
      break;
    }
    if (gate != kGateOpen) {
      // Any value but "open" counts as closed: a tenant scribbling on its gate only stops itself.
      if (!blocked) {
        slot->activity.fetch_or(kActivityBlocked, std::memory_order_seq_cst);
        blocked = true;
      }
      futexWait(&c->gate, gate, 50'000'000, true);
      const uint64_t t1 = nowNs();
      gateWait += t1 - t0;
      // Alive: the broker takes a waiting bit whose time stands still at an open gate for a
      // waiter that does not run (stopped), and ignores it until this moves (compute.cpp).
      slot->activity_ns.store(t1, std::memory_order_relaxed);
      // A broker gives every tenant with work a turn within two periods (at most 2 s). A gate
      // closed for kBrokerGone without any opening means the broker is gone (killed): run on.
      if (const uint32_t e = c->gate_epoch.load(std::memory_order_relaxed); e != epoch) {
        epoch = e;
        epochSince = t1;
      } else if (t1 - epochSince > kBrokerGoneNs) {
        static std::atomic<bool> said{false};
        if (!said.exchange(true))
          logLine(LogLevel::kWarn, "cushare: the compute gate stayed closed for %llu s without a turn (broker gone?): "
                  "launches run unpaced until it opens again", static_cast<unsigned long long>(kBrokerGoneNs / 1'000'000'000u));
        gGoneEpoch.store(epoch + 1, std::memory_order_relaxed);  // until the gate opens again
        slot->inflight.fetch_add(1, std::memory_order_seq_cst);  // the place the loop's exit holds
        break;
      }
    } else if (local != kGateOpen) {
      // Over the process's own budget: the pacer opens the local gate when it refills. Not
      // "blocked" for the broker (the tenant's turn passes on to others meanwhile).
      if (blocked) {
        slot->activity.fetch_and(~kActivityBlocked, std::memory_order_seq_cst);
        blocked = false;
      }
      gPacer.wake.fetch_add(1, std::memory_order_release);
      futexWake(&gPacer.wake, false);
      futexWait(&lc.gate, local, 50'000'000, false);
      gateWait += nowNs() - t0;
    } else {
      const uint32_t seq = gPacer.completions.load(std::memory_order_acquire);
      gPacer.waiters.fetch_add(1, std::memory_order_acq_rel);
      gPacer.wake.fetch_add(1, std::memory_order_release);
      futexWake(&gPacer.wake, false);
      if (!mayGo(slot->inflight.load(std::memory_order_seq_cst), e, effectiveMode(c->mode.load(std::memory_order_relaxed), lc)))
        futexWait(&gPacer.completions, seq, 5'000'000, false);
      gPacer.waiters.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  if (blocked) slot->activity.fetch_and(~kActivityBlocked, std::memory_order_seq_cst);
  if (gateWait != 0) slot->throttled_ns.fetch_add(gateWait, std::memory_order_relaxed);
  slot->activity_ns.store(start, std::memory_order_relaxed);
}

}  // namespace

constinit const std::atomic<uint32_t> gLaunchUnready{kComputeModeMask};
constinit std::atomic<const std::atomic<uint32_t>*> gLaunchWord{&gLaunchUnready};
namespace {
// The launch word of a process that sees several devices (or none): always the hook, which finds
// the launch's device.
constinit const std::atomic<uint32_t> gLaunchSeveral{kComputeModeMask};

// The launch word published once the devices are ready (hooks.h); whether this launch is plain.
__attribute__((noinline, cold)) bool publishLaunchWord() noexcept {
  if (devicesReady() != CUDA_SUCCESS) return true;  // plain until then, as the driver is not started
  const ShimState& st = state();
  const std::atomic<uint32_t>* w =
      st.deviceCount == 1 && st.devices[0].compute != nullptr ? &st.devices[0].compute->mode : &gLaunchSeveral;
  gLaunchWord.store(w, std::memory_order_release);
  return (w->load(std::memory_order_relaxed) & kComputeModeMask) == 0;
}
}  // namespace

// The common case, checked by every launch hook before anything else (the trampolines check the
// same word before the hook): no compute mode on a single-device process's device (or devices not
// ready yet). False means the devices are ready.
inline bool launchPlain() noexcept {
  const std::atomic<uint32_t>* w = gLaunchWord.load(std::memory_order_acquire);
  if (__builtin_expect(w == &gLaunchUnready, 0)) return publishLaunchWord();
  return (w->load(std::memory_order_relaxed) & kComputeModeMask) == 0;
}

// A metered launch's bookkeeping, before and after the real call (no lambda, no template: the
// launch's arguments stay where they are).
struct Ticket {
  StreamEntry* entry = nullptr;  // null: nothing to do after the launch
  LedgerComputeSlot* slot = nullptr;
};

// Before a metered or paced launch: the stream noted, the in-flight place taken (waiting for the
// gate or the bound when paced). Returns false when the launch is neither (*t untouched). Only
// after launchPlain() said no (the devices are ready). launchBegin is the common case (one device,
// its slot known, the stream in its home place in the table, the gate open and the bound free):
// no frame, every other case out of line in launchBeginSlow.
__attribute__((noinline, cold)) bool launchBeginSlow(CUstream key, Ticket* t) noexcept {
  ShimState& st = state();
  const int dev = launchDevice();
  if (dev < 0) return false;
  LedgerComputeDevice* c = st.devices[dev].compute;
  const uint32_t mode = c->mode.load(std::memory_order_acquire);
  if ((mode & kComputeModeMask) == 0) return false;
  LedgerComputeSlot* slot = gSlots[dev];
  if (slot == nullptr) {
    // A forked child claims a slot of its own at its first launch, as at its first reservation.
    if (st.ledger->slot() < 0) st.ledger->ensureSlot();
    slot = ownSlot(dev);
    if (slot == nullptr) {
      static std::atomic<bool> said{false};
      if (!said.exchange(true))
        logLine(LogLevel::kWarn, "cushare: no ledger slot for this process (all %u taken?): its launches are not "
                "metered or paced", kLedgerMaxSlots);
      return false;
    }
    gSlots[dev] = slot;
  }
  StreamEntry* e = &gPacer.streams[hashOf(key, dev)];
  if (e->stream.load(std::memory_order_relaxed) != key || e->dev.load(std::memory_order_acquire) != dev) {
    e = insertStream(key, dev);
    if (e == nullptr) return false;  // more streams than the table holds: not metered
  }
  LocalCap& lc = gLocal[dev];
  const uint32_t eff = effectiveMode(mode, lc);
  if (eff & kComputePaced) {
    const uint32_t before = slot->inflight.fetch_add(1, std::memory_order_seq_cst);
    const bool tenantOpen = (mode & kComputePaced) == 0 || c->gate.load(std::memory_order_seq_cst) == kGateOpen;
    const bool localOpen = !localOn(lc) || lc.gate.load(std::memory_order_seq_cst) == kGateOpen;
    if (!tenantOpen || !localOpen || !mayGo(before, e, eff)) {
      uint32_t cur = slot->inflight.load(std::memory_order_relaxed);
      while (cur > 0 && !slot->inflight.compare_exchange_weak(cur, cur - 1, std::memory_order_seq_cst)) {
      }
      waitForTurn(c, slot, e, lc);
    }
  } else {
    slot->inflight.fetch_add(1, std::memory_order_relaxed);
  }
  t->entry = e;
  t->slot = slot;
  return true;
}

__attribute__((noinline)) bool launchBegin(CUstream key, Ticket* t) noexcept {
  const ShimState& st = state();
  if (st.deviceCount != 1) return launchBeginSlow(key, t);
  LedgerComputeDevice* c = st.devices[0].compute;
  const uint32_t mode = c->mode.load(std::memory_order_acquire);
  LedgerComputeSlot* slot = gSlots[0];
  StreamEntry* e = &gPacer.streams[hashOf(key, 0)];
  if ((mode & kComputePaced) == 0 || slot == nullptr || e->stream.load(std::memory_order_relaxed) != key ||
      e->dev.load(std::memory_order_acquire) != 0 || gLocalAny.load(std::memory_order_relaxed) != 0)
    return launchBeginSlow(key, t);  // metered only, a local cap, or anything to look up first
  const uint32_t before = slot->inflight.fetch_add(1, std::memory_order_seq_cst);
  if (c->gate.load(std::memory_order_seq_cst) != kGateOpen || !mayGo(before, e, mode)) {
    // Not now: the place back (clamped), and the whole path, which waits.
    uint32_t cur = slot->inflight.load(std::memory_order_relaxed);
    while (cur > 0 && !slot->inflight.compare_exchange_weak(cur, cur - 1, std::memory_order_seq_cst)) {
    }
    return launchBeginSlow(key, t);
  }
  t->entry = e;
  t->slot = slot;
  return true;
}

// After it: a failed launch gives its place back; a launch on an idle stream starts a busy
// interval (the clock is read only then).
inline CUresult launchEnd(const Ticket& t, CUresult r) noexcept {
  if (r != CUDA_SUCCESS) {
    uint32_t cur = t.slot->inflight.load(std::memory_order_relaxed);
    while (cur > 0 && !t.slot->inflight.compare_exchange_weak(cur, cur - 1, std::memory_order_seq_cst)) {
    }
    return r;
  }
  const uint64_t before = t.entry->launched.fetch_add(1, std::memory_order_release);
  if (before == t.entry->completed.load(std::memory_order_relaxed))
    t.entry->idleStart.store(nowNs(), std::memory_order_relaxed);
  return r;
}

// Every other launch: `launch` is the real call, `key` the stream as the pacer names it.
template <class Launch>
inline CUresult launchOn(CUstream key, Launch&& launch) noexcept {
  Ticket t;
  if (launchPlain() || !launchBegin(key, &t)) return launch();
  return launchEnd(t, launch());
}

namespace {
inline CUstream ptszKey(CUstream s) noexcept { return s == nullptr ? CU_STREAM_PER_THREAD : s; }
}  // namespace

// The stream table forgets a destroyed stream (its pending markers are still waited for).
void pacerForgetStream(CUstream s) noexcept {
  if (!gPacer.started.load(std::memory_order_acquire)) return;
  pthread_mutex_lock(&gMutex);
  for (StreamEntry& e : gPacer.streams)
    if (e.dev.load(std::memory_order_relaxed) >= 0 && e.stream.load(std::memory_order_relaxed) == s) e.dead = true;
  pthread_mutex_unlock(&gMutex);
}

// A context is about to be destroyed or reset: everything the pacer holds there goes (its events
// die with it; the launches count as complete).
void pacerForgetContexts() noexcept {
  if (!gPacer.started.load(std::memory_order_acquire)) return;
  pthread_mutex_lock(&gMutex);
  RealDriver& d = realDriver();
  for (StreamEntry& e : gPacer.streams) {
    if (e.dev.load(std::memory_order_relaxed) < 0) continue;
    finish(e, e.launched.load(std::memory_order_acquire));
    for (size_t i = 0; i < e.count; ++i) d.p_cuEventDestroy_v2(e.pending[(e.head + i) % kPending].event);
    e.count = 0;
    e.head = 0;
    e.stream.store(nullptr, std::memory_order_relaxed);
    e.dev.store(-1, std::memory_order_release);
  }
  for (ContextClock& c : gPacer.clocks) {
    if (c.ctx == nullptr) continue;
    for (size_t i = 0; i < c.free; ++i) d.p_cuEventDestroy_v2(c.pool[i]);
    d.p_cuEventDestroy_v2(c.ref);
    d.p_cuStreamDestroy_v2(c.own);
    c = ContextClock{};
  }
  pthread_mutex_unlock(&gMutex);
}

// The launch hooks: reached from their trampolines (interpose.cpp) when a compute mode is in
// force (or several devices are seen), and from the generated wrapper before the devices are
// ready; launchOn checks the launch word again.
CUresult hook_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shmem, CUstream s, void** params, void** extra) noexcept {
  return launchOn(s, [&] { return realDriver().p_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
CUresult hook_cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, unsigned shmem, CUstream s, void** params, void** extra) noexcept {
  return launchOn(ptszKey(s), [&] {
    return realDriver().p_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  });
}
CUresult hook_cuLaunchKernelEx(const CUlaunchConfig* cfg, CUfunction f, void** params, void** extra) noexcept {
  return launchOn(cfg ? cfg->hStream : nullptr, [&] { return realDriver().p_cuLaunchKernelEx(cfg, f, params, extra); });
}
CUresult hook_cuLaunchKernelEx_ptsz(const CUlaunchConfig* cfg, CUfunction f, void** params, void** extra) noexcept {
  return launchOn(ptszKey(cfg ? cfg->hStream : nullptr),
                  [&] { return realDriver().p_cuLaunchKernelEx_ptsz(cfg, f, params, extra); });
}
CUresult hook_cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                        unsigned by, unsigned bz, unsigned shmem, CUstream s, void** params) noexcept {
  return launchOn(s, [&] {
    return realDriver().p_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  });
}
CUresult hook_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                             unsigned by, unsigned bz, unsigned shmem, CUstream s,
                                             void** params) noexcept {
  return launchOn(ptszKey(s), [&] {
    return realDriver().p_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  });
}
// Several devices at once: paced and metered on the current context's device, by the first
// entry's stream (docs/compute.md).
CUresult hook_cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS* list, unsigned n, unsigned flags) noexcept {
  return launchOn(list && n ? list[0].hStream : nullptr,
                  [&] { return realDriver().p_cuLaunchCooperativeKernelMultiDevice(list, n, flags); });
}
CUresult hook_cuLaunch(CUfunction f) noexcept {
  return launchOn(nullptr, [&] { return realDriver().p_cuLaunch(f); });
}
CUresult hook_cuLaunchGrid(CUfunction f, int w, int h) noexcept {
  return launchOn(nullptr, [&] { return realDriver().p_cuLaunchGrid(f, w, h); });
}
CUresult hook_cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) noexcept {
  return launchOn(s, [&] { return realDriver().p_cuLaunchGridAsync(f, w, h, s); });
}
// A stream's priority in the tenant's band (docs/compute.md), once the broker's words are in force
// on the device: low tenants get the least priority, normal ones at most the middle of the range,
// high ones what they ask. A band value the broker never writes counts as low.
CUresult hook_cuStreamCreateWithPriority(CUstream* ph, unsigned flags, int priority) noexcept {
  RealDriver& d = realDriver();
  int least = 0, greatest = 0;
  if (devicesReady() == CUDA_SUCCESS && d.p_cuCtxGetStreamPriorityRange &&
      d.p_cuCtxGetStreamPriorityRange(&least, &greatest) == CUDA_SUCCESS) {
    const int dev = launchDevice();
    const LedgerComputeDevice* c = dev >= 0 ? state().devices[dev].compute : nullptr;
    if (c != nullptr && (c->mode.load(std::memory_order_acquire) & kComputeModeMask) != 0) {
      const uint32_t band = c->priority.load(std::memory_order_relaxed);
      // Numerically lower is higher priority: greatest <= priority <= least.
      if (band >= 2) priority = least;
      else if (band == 1 && priority < (least + greatest) / 2) priority = (least + greatest) / 2;
    }
  }
  return d.p_cuStreamCreateWithPriority(ph, flags, priority);
}

CUresult hook_cuStreamDestroy(CUstream s) noexcept {
  pacerForgetStream(s);
  return realDriver().p_cuStreamDestroy(s);
}
CUresult hook_cuStreamDestroy_v2(CUstream s) noexcept {
  pacerForgetStream(s);
  return realDriver().p_cuStreamDestroy_v2(s);
}

// graph_memory.cpp's graph launches come through here.
CUresult paceGraphLaunch(CUgraphExec exec, CUstream s, bool ptsz) noexcept {
  if (ptsz) return launchOn(ptszKey(s), [&] { return realDriver().p_cuGraphLaunch_ptsz(exec, s); });
  return launchOn(s, [&] { return realDriver().p_cuGraphLaunch(exec, s); });
}

}  // namespace cushare::shim
