// What the launch path (launch.cpp) shares with the pacer (pacer.cpp) and the process's own budget
// (local_cap.cpp): the stream table, the in-flight bound, the local gates, the futexes
// (docs/compute.md, "The launch path" and "Measuring GPU time").
//
// Who writes what:
//  - launch path (any thread): StreamEntry::launched and idleStart, the slot's inflight (a place
//    taken before a paced launch), the waiter counts;
//  - pacer thread (under gPacerMutex): markers, completions (StreamEntry::completed, the slot's
//    inflight given back), busy time, the in-flight bound, the local budgets;
//  - the broker (through the ledger): mode, gate, cap, priority, others.
#pragma once

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "runtime/clock.h"
#include "runtime/state.h"

namespace cushare::shim {

// ---- the in-flight bound (docs/compute.md, "The in-flight bound") ----
// A paced process may have launches in flight (launched, not yet seen complete by its pacer) up to
// a bound that the pacer keeps per device from queued device time: kQueuedNs divided by the
// device time a launch of the process has been taking (measured by the markers), within
// [kMinInFlight, kMaxInFlight]. So closing a gate takes effect after about kQueuedNs of the
// process's device time however short its kernels are, and a launch under budget never waits for
// the pacer to see the previous ones complete (which it sees only every pass, 100 us).
inline constexpr uint64_t kQueuedNs = 1'000'000;
inline constexpr uint32_t kMinInFlight = 2;    // before anything is measured, and for long kernels
inline constexpr uint32_t kMaxInFlight = 256;  // whatever the estimate says
// A closed gate that sees no opening for this long: the broker is taken to be gone.
inline constexpr uint64_t kBrokerGoneNs = 3'000'000'000ull;

inline long futexWait(std::atomic<uint32_t>* word, uint32_t expected, uint64_t timeoutNs, bool shared) noexcept {
  timespec ts{static_cast<time_t>(timeoutNs / 1'000'000'000u), static_cast<long>(timeoutNs % 1'000'000'000u)};
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE,
                   expected, &ts, nullptr, 0);
}
inline void futexWake(std::atomic<uint32_t>* word, bool shared) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT32_MAX,
            nullptr, nullptr, 0);
}

inline constexpr size_t kStreams = 128;  // streams the pacer tracks (a power of two)
inline constexpr size_t kPending = 8;    // markers in flight per stream

struct Marker {
  CUevent event = nullptr;
  uint64_t count = 0;     // the stream's launches before it
  uint64_t start = 0;     // host ns the segment's work could start (0: when the previous ended)
};

// One stream the process launched on (key: the stream as given, per-thread default = 2), on one
// device ordinal. Written by the pacer under gPacerMutex, except launched/idleStart (launch path).
struct StreamEntry {
  std::atomic<CUstream> stream{nullptr};
  std::atomic<int> dev{-1};  // -1: free
  CUcontext ctx = nullptr;
  std::atomic<uint64_t> launched{0};
  std::atomic<uint64_t> completed{0};
  std::atomic<uint64_t> idleStart{0};     // host ns of a launch that found the stream idle
  std::atomic<uint64_t> markedShared{0};  // = marked, for the launch path
  uint64_t marked = 0;
  uint64_t lastEnd = 0;  // host ns the last completed marker's work ended
  Marker pending[kPending];
  size_t head = 0, count = 0;
  bool dead = false;  // destroyed: freed once its markers are done
};

// What the launch path and the pacer meet at.
struct PacerShared {
  StreamEntry streams[kStreams];
  std::atomic<uint32_t> wake{0};         // futex: the pacer's sleep
  std::atomic<uint32_t> completions{0};  // futex: launchers waiting for the in-flight bound
  std::atomic<uint32_t> waiters{0};
  std::atomic<bool> started{false};
  // The in-flight bound per device, less kMinInFlight (so zero, the start, is the minimum).
  std::atomic<uint32_t> boundExtra[kMaxDevices];
};

// A process's own lower cap on one device (local_cap.cpp keeps it; launchers read gate and tight).
struct LocalCap {
  std::atomic<uint32_t> on{0};              // 1: launches on the device take the local checks
  std::atomic<uint32_t> gate{kGateOpen};    // private futex word: closed while over the budget
  std::atomic<uint32_t> tight{0};           // 1: one launch in flight (yielding to a higher priority)
  uint32_t cap = kComputeNoCap;             // the rest is the pacer's (under gPacerMutex)
  int64_t credit = 0;                       // ns of device time left (negative: debt)
  uint64_t last = 0;                        // host ns of the last refill
  std::atomic<uint64_t> used{0};            // busy ns metered since the last pass (CUPTI: any thread)
  uint32_t epoch = 0;                       // the device's gate_epoch as last seen, and since when
  uint64_t epochSince = 0;
};

extern PacerShared gPacer;
extern LocalCap gLocal[kMaxDevices];
// Some device has a local cap in force: the launch path's common case takes the whole path.
extern std::atomic<uint32_t> gLocalAny;
// Set at exit, when the pacer stops: nothing refills a local budget any more, so launches made
// then (by later exit handlers) pass the local checks.
extern std::atomic<bool> gExiting;
// This process's compute slot per device ordinal, once looked up (cleared in a forked child).
extern LedgerComputeSlot* gSlots[kMaxDevices];
extern pthread_mutex_t gPacerMutex;

inline size_t hashOf(CUstream s, int dev) noexcept {
  const uintptr_t v = reinterpret_cast<uintptr_t>(s);
  return ((v >> 4) ^ (v >> 12) ^ static_cast<uintptr_t>(dev) * 0x9E37u) & (kStreams - 1);
}

inline LedgerComputeSlot* ownSlot(int ordinal) noexcept {
  ShimState& st = state();
  return st.ledger->computeSlotAt(st.devices[ordinal].ledgerIndex, st.ledger->slot());
}

// The in-flight count given back, clamped: the slot is writable by the tenant's processes, and a
// count never wraps below zero.
inline void giveBack(LedgerComputeSlot* slot, uint32_t n) noexcept {
  uint32_t cur = slot->inflight.load(std::memory_order_relaxed);
  while (!slot->inflight.compare_exchange_weak(cur, cur > n ? cur - n : 0, std::memory_order_seq_cst)) {
  }
}

// pacer.cpp: the stream's entry, added if new (the pacer thread started with the first). Null
// when the table is full or the driver lacks what the pacer needs.
StreamEntry* insertStream(CUstream key, int dev) noexcept;

// pacer.cpp: a pass of the pacer's run by a launcher whose in-flight bound is full, unless the
// pacer is in one; true when it ran.
bool helpPass() noexcept;

// pacer.cpp: the stream table forgets a destroyed stream (its pending markers are still waited
// for); a context about to be destroyed or reset takes everything the pacer holds there with it.
void pacerForgetStream(CUstream s) noexcept;
void pacerForgetContexts() noexcept;

// local_cap.cpp: the local cap of a device from the environment and the broker's words, its
// budget refilled and charged; returns the ns until it lets a launch go again (0: it does now).
// Under gPacerMutex (the pacer's pass).
uint64_t updateLocal(int dev, const LedgerComputeDevice* c, uint64_t now) noexcept;
// local_cap.cpp: a forked child starts its own budgets.
void resetLocalAfterFork() noexcept;

}  // namespace cushare::shim
