// The pacer (docs/compute.md, "Measuring GPU time"): one thread per process, started by the first
// metered launch, off the launch path. Each pass records a marker event after each stream's new
// launches, polls the markers in order, and turns completed ones into busy time (the union of the
// intervals the process's streams were executing, added to the slot's busy_ns, unless CUPTI gives
// it: cupti_source.cpp), completions (the slot's inflight given back, waiting launchers woken) and
// the in-flight bound (kQueuedNs over the device time a launch has been taking, pacer.h); then the
// local budgets (local_cap.cpp) and the slot's activity bits for the broker. It also owns the
// stream table (insertStream, the forget hooks) and the fork and exit handling.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "interpose/real.h"
#include "policy/busy_source.h"
#include "policy/cupti_source.h"
#include "policy/pacer.h"
#include "policy/probe_thread.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {

constinit PacerShared gPacer;
constinit std::atomic<bool> gExiting{false};
constinit LedgerComputeSlot* gSlots[kMaxDevices] = {};
pthread_mutex_t gPacerMutex = PTHREAD_MUTEX_INITIALIZER;

namespace {

constexpr size_t kContexts = 16;

struct ContextClock {
  CUcontext ctx = nullptr;
  CUstream own = nullptr;  // the pacer's stream there (for the reference event)
  CUevent ref = nullptr;
  uint64_t refHost = 0;  // host ns of ref
  CUevent pool[64] = {};
  size_t free = 0;
};

constexpr size_t kLaunchSamples = 8;
struct LaunchTimes {
  uint64_t sample[kLaunchSamples] = {};  // ns per launch of the last markers
  size_t next = 0;                       // samples taken
};

// The pacer thread's own state (under gPacerMutex).
struct PacerOwn {
  ContextClock clocks[kContexts];
  BusyUnion busy[kMaxDevices];  // host ns: the intervals counted so far (events)
  LaunchTimes launchTimes[kMaxDevices];  // device time a launch has been taking, per marker
};
constinit PacerOwn gOwn;

ContextClock* clockFor(CUcontext ctx) noexcept {
  RealDriver& d = realDriver();
  for (ContextClock& c : gOwn.clocks)
    if (c.ctx == ctx) return &c;
  for (ContextClock& c : gOwn.clocks) {
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
  if (LedgerComputeSlot* slot = ownSlot(dev)) giveBack(slot, static_cast<uint32_t>(count - before));
  notifyLaunchers();
}

static_assert(ActivityBusy::kDevices == kMaxDevices);

// A marker's interval of the stream's work, counted once over the process's streams. Not when
// CUPTI counts the busy time.
void addBusy(int dev, uint64_t start, uint64_t end) noexcept {
  if (cuptiActive()) return;
  const uint64_t ns = gOwn.busy[dev].add(start, end);
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

// The busy-time source asked for: standalone CUSHARE_METERING; under a broker the broker's (the
// host segment's), except that under its `auto` a process may ask for events (a profiler of its
// own owns CUPTI's callbacks): never for CUPTI, nor for events where the operator chose cupti.
MeteringSource meteringAsked() noexcept {
  const ShimState& st = state();
  if (!st.brokerManaged) return st.config.metering;
  const auto chosen = static_cast<MeteringSource>(st.host.metering);
  if (chosen == MeteringSource::kAuto && st.config.meteringSet && st.config.metering == MeteringSource::kEvents)
    return MeteringSource::kEvents;
  return chosen;
}

// The busy-time source, chosen once as the pacer thread starts (docs/compute.md): events, or
// CUPTI where it starts (cupti, auto), else events; under a broker CUPTI only from the library the
// broker offers. On its own short thread: CUPTI's start can take long, and the pacer's passes
// (completions for the in-flight bound) must not wait for it; the events count busy time until
// CUPTI is active.
void* chooseBusySource(void*) noexcept {
  const ShimState& st = state();
  const MeteringSource m = meteringAsked();
  const char* library = nullptr;  // standalone: by name (nothing is billed from it)
  if (st.brokerManaged) {
    if (st.host.cuptiLibrary.empty()) {
      logLine(m == MeteringSource::kCupti ? LogLevel::kWarn : LogLevel::kInfo,
              "cushare: CUPTI activity records are not used (the broker offers no CUPTI library: "
              "compute.cupti_library): GPU busy time from events on the streams");
      return nullptr;
    }
    library = st.host.cuptiLibrary.c_str();
  }
  if (m == MeteringSource::kAuto && std::getenv("CUDA_INJECTION64_PATH") != nullptr) {
    // A profiler injected into the process owns CUPTI's activity callbacks: leave them to it.
    logLine(LogLevel::kInfo, "cushare: CUPTI activity records are not used (CUDA_INJECTION64_PATH is set: a profiler "
            "uses CUPTI): GPU busy time from events on the streams");
    return nullptr;
  }
  char why[512];
  if (startCupti(library, st.host.ownerUid, st.deviceCount, cuptiBusy, cuptiMetered, why, sizeof why)) {
    std::atexit(flushCuptiAtExit);  // registered after libcupti loaded: runs before its teardown
    logLine(LogLevel::kInfo, "cushare: GPU busy time from CUPTI activity records");
    return nullptr;
  }
  // Asked for explicitly: said at the default level too.
  logLine(m == MeteringSource::kCupti ? LogLevel::kWarn : LogLevel::kInfo,
          "cushare: CUPTI activity records are not used (%s): GPU busy time from events on the streams", why);
  return nullptr;
}

// A completed marker's interval of `launches` launches: the device time a launch takes, and from
// it the in-flight bound (pacer.h). The estimate is the median of the last kLaunchSamples markers'
// (a marker delayed by a loaded host, or a stream that waited on another, moves it only once it
// is the common case).
void noteLaunchTime(int dev, uint64_t intervalNs, uint64_t launches) noexcept {
  if (launches == 0 || intervalNs == 0) return;
  LaunchTimes& lt = gOwn.launchTimes[dev];
  lt.sample[lt.next++ % kLaunchSamples] = std::max<uint64_t>(intervalNs / launches, 1);
  const size_t n = std::min<size_t>(lt.next, kLaunchSamples);
  uint64_t sorted[kLaunchSamples];
  std::copy(lt.sample, lt.sample + n, sorted);
  std::nth_element(sorted, sorted + n / 2, sorted + n);
  const uint64_t est = sorted[n / 2];
  const uint64_t bound = std::clamp<uint64_t>(kQueuedNs / est, kMinInFlight, kMaxInFlight);
  gPacer.boundExtra[dev].store(static_cast<uint32_t>(bound - kMinInFlight), std::memory_order_relaxed);
}

// Set by pass(): ns until a local budget lets launches go again (0: none waits for one).
uint64_t gLocalRefill = 0;
// Passes run (under gPacerMutex), and how many of them by launchers; said at exit at debug level
// (perf/pacer_instructions.sh turns them into the pacer's instructions per launch).
uint64_t gPasses = 0, gLauncherPasses = 0;

// One pass: markers after new launches, completed markers turned into busy time, local budgets.
// True while any marker is pending. A launcher's pass (helpPass) leaves the probe requests to the
// pacer thread: the probe thread is started from there, with every signal blocked.
__attribute__((noinline)) bool pass(bool launcher = false) noexcept {
  ++gPasses;
  gLauncherPasses += launcher;
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
          if (end > start) noteLaunchTime(dev, end - start, m.count - e.completed.load(std::memory_order_relaxed));
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
    if (!launcher) probeCheck(i, st.devices[i].compute, st.ledger->slot());
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
  pthread_mutex_lock(&gPacerMutex);
  gExiting.store(true, std::memory_order_release);
  const uint64_t passes = gPasses, byLaunchers = gLauncherPasses;
  pthread_mutex_unlock(&gPacerMutex);
  CUSHARE_LOG(LogLevel::kDebug, "cushare: pacer: %llu passes, %llu of them by launchers",
              static_cast<unsigned long long>(passes), static_cast<unsigned long long>(byLaunchers));
}

void* pacerMain(void*) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  if (const ShimState& st = state(); st.brokerManaged && st.config.meteringSet && st.config.metering != meteringAsked())
    logLine(LogLevel::kInfo, "cushare: CUSHARE_METERING=%s is not used: the broker chooses the metering source (%s)",
            meteringName(st.config.metering), meteringName(meteringAsked()));
  if (meteringAsked() != MeteringSource::kEvents) {
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
    pthread_mutex_lock(&gPacerMutex);
    if (gExiting.load(std::memory_order_acquire)) {
      pthread_mutex_unlock(&gPacerMutex);
      return nullptr;
    }
    const bool pending = pass();
    const uint64_t refill = gLocalRefill;  // read under the lock: a launcher's pass writes it too
    pthread_mutex_unlock(&gPacerMutex);
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
    if (refill != 0 && refill < sleep) sleep = refill;
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
  for (ContextClock& c : gOwn.clocks) c = ContextClock{};
  for (LedgerComputeSlot*& slot : gSlots) slot = nullptr;
  for (BusyUnion& u : gOwn.busy) u.reset();
  for (int i = 0; i < kMaxDevices; ++i) {  // measured afresh in the child
    gOwn.launchTimes[i] = LaunchTimes{};
    gPacer.boundExtra[i].store(0);
  }
  cuptiForgetAfterFork();  // CUPTI's threads are the parent's: the child meters with events
  probeResetAfterFork();
  resetLocalAfterFork();
  gPacer.waiters.store(0);
  gPacer.started.store(false);
  pthread_mutex_init(&gPacerMutex, nullptr);
}

bool pacerUsable() noexcept {
  const RealDriver& d = realDriver();
  return d.p_cuCtxGetCurrent && d.p_cuCtxSetCurrent && d.p_cuEventCreate && d.p_cuEventRecord && d.p_cuEventQuery &&
         d.p_cuEventDestroy_v2 && d.p_cuEventElapsedTime && d.p_cuStreamCreate && d.p_cuEventSynchronize &&
         d.p_cuStreamDestroy_v2;
}

}  // namespace

// A launcher whose in-flight bound is full runs a pass itself when the pacer is not in one: on a
// loaded host the pacer thread may wait long for a core, and the launcher is running anyway. The
// launcher's current context is restored (a pass makes each stream's context current).
bool helpPass() noexcept {
  if (!gPacer.started.load(std::memory_order_acquire) || pthread_mutex_trylock(&gPacerMutex) != 0) return false;
  bool ran = false;
  if (!gExiting.load(std::memory_order_acquire)) {
    RealDriver& d = realDriver();
    CUcontext mine = nullptr;
    if (d.p_cuCtxGetCurrent(&mine) == CUDA_SUCCESS) {
      pass(true);
      d.p_cuCtxSetCurrent(mine);
      ran = true;
    }
  }
  pthread_mutex_unlock(&gPacerMutex);
  return ran;
}

__attribute__((noinline)) StreamEntry* insertStream(CUstream key, int dev) noexcept {
  // A driver without the entry points the pacer needs: launches are neither metered nor paced.
  static const bool usable = pacerUsable();
  if (!usable) return nullptr;
  pthread_mutex_lock(&gPacerMutex);
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
  pthread_mutex_unlock(&gPacerMutex);
  return found;
}


// The stream table forgets a destroyed stream (its pending markers are still waited for).
void pacerForgetStream(CUstream s) noexcept {
  if (!gPacer.started.load(std::memory_order_acquire)) return;
  pthread_mutex_lock(&gPacerMutex);
  for (StreamEntry& e : gPacer.streams)
    if (e.dev.load(std::memory_order_relaxed) >= 0 && e.stream.load(std::memory_order_relaxed) == s) e.dead = true;
  pthread_mutex_unlock(&gPacerMutex);
}

// A context is about to be destroyed or reset: everything the pacer holds there goes (its events
// die with it; the launches count as complete).
void pacerForgetContexts() noexcept {
  if (!gPacer.started.load(std::memory_order_acquire)) return;
  pthread_mutex_lock(&gPacerMutex);
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
  for (ContextClock& c : gOwn.clocks) {
    if (c.ctx == nullptr) continue;
    for (size_t i = 0; i < c.free; ++i) d.p_cuEventDestroy_v2(c.pool[i]);
    d.p_cuEventDestroy_v2(c.ref);
    d.p_cuStreamDestroy_v2(c.own);
    c = ContextClock{};
  }
  pthread_mutex_unlock(&gPacerMutex);
}

}  // namespace cushare::shim
