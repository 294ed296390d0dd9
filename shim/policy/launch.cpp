// Launches: the hot path of metering and pacing (docs/compute.md, "The launch path"). Every launch
// road of hooks.def comes through launchOn(). Three cases, by the broker's mode word for the device
// in the tenant's ledger:
//  - mode 0 (no broker, or compute off): the launch trampoline (interpose.cpp) reads the launch
//    word (gLaunchWord, published here) and jumps to the real launch: two loads and a branch;
//  - metered: the stream is noted (a hash probe and an atomic add), so that the pacer thread
//    (pacer.cpp) records timing events on it and turns them into busy time;
//  - paced: as metered, and the launch first takes a place in the process's in-flight bound (its
//    length is queued device time: pacer.h) and checks the gate (one atomic add on the shared
//    slot, one load of the gate, one of the bound). Closed gate or full bound: the launching
//    thread waits on a futex (no spin, no lock held), the wait counted as throttled time.
// A process whose environment lowers its own cap or priority below its tenant's also checks its
// local gate (local_cap.cpp).
#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "interpose/hooks.h"
#include "interpose/real.h"
#include "policy/pacer.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {

namespace {

// The gate epoch + 1 at which the broker was found gone (0: never): launches then pass a closed
// gate until the epoch changes (a broker opened it again).
constinit std::atomic<uint32_t> gGoneEpoch{0};

// The device ordinal the launch goes to (the current context's), or -1.
inline int launchDevice() noexcept {
  ShimState& st = state();
  if (st.deviceCount == 1) return 0;
  CUdevice dev = -1;
  if (realDriver().p_cuCtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0 || dev >= st.deviceCount) return -1;
  return dev;
}

// A paced launch may go with `before` launches of the process in flight on device `dev`: fewer
// than the in-flight bound (pacer.h: queued device time), one only under the tight bit. At the
// minimum bound (nothing measured yet, or long launches) the second only once the stream's
// previous launches have their marker: two launches made together would otherwise share one
// marker, free both places at once and be followed by two more together, the device idle
// between every pair.
inline bool mayGo(uint32_t before, const StreamEntry* e, uint32_t mode, int dev) noexcept {
  if (before == 0) return true;
  if ((mode & kComputeTight) != 0) return false;
  const uint32_t extra = gPacer.boundExtra[dev].load(std::memory_order_relaxed);
  if (before >= kMinInFlight + extra) return false;
  return extra != 0 || e->launched.load(std::memory_order_relaxed) <= e->markedShared.load(std::memory_order_acquire);
}

// The mode a launch on the device is checked against: the broker's, with the local cap's bits.
inline bool localOn(const LocalCap& lc) noexcept {
  return lc.on.load(std::memory_order_acquire) != 0 && !gExiting.load(std::memory_order_relaxed);
}
inline uint32_t effectiveMode(uint32_t mode, const LocalCap& lc) noexcept {
  if (!localOn(lc)) return mode;
  return mode | kComputePaced | (lc.tight.load(std::memory_order_relaxed) != 0 ? kComputeTight : 0);
}

// Whether the launch's stream is being captured (or cannot tell): a capturing thread must not
// make the event calls of a pacer's pass (they may invalidate its capture), so it leaves them to
// the pacer thread. Only on the wait path.
bool capturing(const StreamEntry* e) noexcept {
  const RealDriver& d = realDriver();
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return d.p_cuStreamIsCapturing == nullptr ||
         d.p_cuStreamIsCapturing(e->stream.load(std::memory_order_relaxed), &status) != CUDA_SUCCESS ||
         status != CU_STREAM_CAPTURE_STATUS_NONE;
}

// The paced wait: closed gate (the tenant's, or the process's own budget) or full in-flight bound.
// Returns with a place in the bound taken.
__attribute__((noinline)) void waitForTurn(int dev, LedgerComputeDevice* c, LedgerComputeSlot* slot,
                                           StreamEntry* e, LocalCap& lc) noexcept {
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
    if ((mode & kComputePaced) == 0 || (gate == kGateOpen && local == kGateOpen && mayGo(before, e, mode, dev))) break;
    giveBack(slot, 1);  // not now: the place back, and wait
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
      // The bound is full. Look at the markers from here first (completions the pacer has not
      // had a core to see yet); wait for the pacer only when nothing new is found.
      const uint32_t seq = gPacer.completions.load(std::memory_order_acquire);
      if (!capturing(e) && helpPass() && gPacer.completions.load(std::memory_order_acquire) != seq) continue;
      gPacer.waiters.fetch_add(1, std::memory_order_acq_rel);
      gPacer.wake.fetch_add(1, std::memory_order_release);
      futexWake(&gPacer.wake, false);
      if (!mayGo(slot->inflight.load(std::memory_order_seq_cst), e, effectiveMode(c->mode.load(std::memory_order_relaxed), lc),
                 dev))
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
    if (!tenantOpen || !localOpen || !mayGo(before, e, eff, dev)) {
      giveBack(slot, 1);
      waitForTurn(dev, c, slot, e, lc);
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
  if (c->gate.load(std::memory_order_seq_cst) != kGateOpen || !mayGo(before, e, mode, 0)) {
    giveBack(slot, 1);  // not now: the place back, and the whole path, which waits
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
    giveBack(t.slot, 1);
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
