// See device_runner.h; the board's protocol is in timeslice_board.h.
#include "device_runner.h"

#include <algorithm>

namespace simgpu {
namespace {

bool othersWant(const Board* b, int self) {
  for (uint32_t i = 0; i < kBoardSlots; ++i)
    if (static_cast<int>(i) != self && b->slot[i].wants.load(std::memory_order_acquire) &&
        pidAlive(b->slot[i].pid.load(std::memory_order_relaxed)))
      return true;
  return false;
}

}  // namespace

bool DeviceRunner::joinBoard(Board* b, int32_t self, bool mpsServer, std::string* why) {
  for (uint32_t i = 0; i < kBoardSlots; ++i) {
    int32_t pid = b->slot[i].pid.load(std::memory_order_acquire);
    if (pid != 0 && pidAlive(pid)) continue;
    if (!b->slot[i].pid.compare_exchange_strong(pid, self, std::memory_order_acq_rel)) continue;
    BoardSlot& s = b->slot[i];
    s.wants.store(0);
    s.busyNs.store(0), s.busySmNs.store(0), s.blocksRun.store(0), s.kernelsRun.store(0), s.slicedOutNs.store(0);
    s.mpsServer.store(mpsServer ? 1 : 0, std::memory_order_release);
    // A dead process may have held the device from this slot: free it from the end of its window.
    uint64_t h = b->holder.load(std::memory_order_acquire);
    if (h && boardSlotOf(h) == static_cast<int>(i)) {
      b->freeSinceNs.store(boardEndOf(h), std::memory_order_release);
      b->holder.compare_exchange_strong(h, 0, std::memory_order_acq_rel);
    }
    board_ = b;
    slot_ = static_cast<int>(i);
    engine_.setWindow(kNever, kNever);  // closed until the board grants a window
    return true;
  }
  *why = "all " + std::to_string(kBoardSlots) + " time-slice slots of the device are taken";
  return false;
}

uint64_t DeviceRunner::submit(int ctx, int streamPriority, const KernelShape& k, uint64_t startNs) {
  if (startNs > engine_.now()) {
    // As step() does: the board first (a holder renews its window at its end, so a submission
    // that comes past the end before the runner's step would otherwise run the engine through a
    // closed window: a process alone sliced out of the time between).
    arbitrate(startNs);
    engine_.advanceTo(startNs);
  }
  return engine_.submit(ctx, streamPriority, k);
}

// Takes, keeps or gives up the device on the board and opens the engine's window to match.
uint64_t DeviceRunner::arbitrate(uint64_t due) {
  Board* b = board_;
  if (!b) return kNever;
  Engine& e = engine_;
  const bool wants = !e.idle() || queued() > 0;
  b->slot[slot_].wants.store(wants ? 1 : 0, std::memory_order_release);
  uint64_t h = b->holder.load(std::memory_order_acquire);
  const int hs = h ? boardSlotOf(h) : -1;
  const uint64_t end = h ? boardEndOf(h) : 0;
  const uint32_t me = static_cast<uint32_t>(slot_ + 1);
  auto take = [&](uint64_t from) -> uint64_t {
    uint64_t start = std::max(e.now(), from);
    const uint32_t last = b->lastRan.load(std::memory_order_acquire);
    if (last != 0 && last != me) start += p_.switchNs;
    const uint64_t packed = boardPack(slot_, start + p_.sliceNs);
    if (!b->holder.compare_exchange_strong(h, packed, std::memory_order_acq_rel)) return due;  // raced: look again
    if (last != me) {
      b->lastRan.store(me, std::memory_order_release);
      if (last != 0) b->switches.fetch_add(1, std::memory_order_relaxed);
    }
    windowStart_ = start;
    e.setWindow(start, boardEndOf(packed));
    return boardEndOf(packed);
  };
  // Nobody else wanted the device: the window runs on from its end, or from now when this process
  // was kept off the CPU past it (the device was idle for everyone else: not a slice lost).
  auto renew = [&]() -> uint64_t {
    const uint64_t packed = boardPack(slot_, std::max(end, due) + p_.sliceNs);
    if (!b->holder.compare_exchange_strong(h, packed, std::memory_order_acq_rel)) return due;
    e.setWindow(windowStart_, boardEndOf(packed));
    return boardEndOf(packed);
  };
  if (hs == slot_) {
    if (!wants) {  // work-conserving: an idle process yields at once
      b->freeSinceNs.store(e.now(), std::memory_order_release);
      if (b->holder.compare_exchange_strong(h, 0, std::memory_order_acq_rel)) e.setWindow(kNever, kNever);
      return kNever;
    }
    // Renewed at the window's end, not before: a GPU's time slice runs from when its context got
    // the device, so a context that gets work waits at most one slice (renewing half a slice
    // early let an arrival just after it wait one and a half). The renewal opens the engine's
    // window before step() advances it, so a holder alone never stalls at the boundary.
    if (due < end) return end;
    if (!othersWant(b, slot_)) return renew();  // nobody waits: keep going
    // The window is over and others wanted the device: they get a grace period to take it.
    const uint64_t grace = end + p_.switchNs + kPollNs;
    return due >= grace ? take(grace) : grace;
  }
  if (!wants) return kNever;
  if (hs < 0) return take(b->freeSinceNs.load(std::memory_order_acquire));
  if (!pidAlive(b->slot[hs].pid.load(std::memory_order_relaxed))) return take(std::min(due, end));
  if (due >= end) return take(end);
  return std::min(end, due + kPollNs);  // someone else's window
}

void DeviceRunner::publish() {
  if (!board_) return;
  const ContextStats& t = engine_.totals();
  BoardSlot& s = board_->slot[slot_];
  // A seqlock on updatedNs (readCounters in timeslice_board.h): "being written", then the counters.
  s.updatedNs.store(kBoardWriting, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.busyNs.store(t.busyNs, std::memory_order_relaxed);
  s.busySmNs.store(t.busySmNs, std::memory_order_relaxed);
  s.blocksRun.store(t.blocksRun, std::memory_order_relaxed);
  s.kernelsRun.store(t.kernelsRun, std::memory_order_relaxed);
  s.slicedOutNs.store(t.slicedOutNs, std::memory_order_relaxed);
  s.updatedNs.store(engine_.now(), std::memory_order_release);
}

uint64_t DeviceRunner::step(uint64_t due) {
  uint64_t look = arbitrate(due);
  for (uint64_t next; (next = engine_.nextEventTime()) <= due;) engine_.advanceTo(next);
  if (board_ && engine_.idle() && queued() == 0) look = std::min(look, arbitrate(due));
  publish();
  return std::min(look, engine_.nextEventTime());
}

}  // namespace simgpu
