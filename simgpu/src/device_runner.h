// One simulated device as seen by one process that runs work on it: its engine (engine.h) plus
// its slot on the device's time-slice board (timeslice_board.h). Used by the driver for a
// process's own contexts (src/driver/device_time.cpp) and by the simulated MPS server for all its
// clients' contexts (mps/server_main.cpp): either way the process is ONE slot to the slicer.
//
// No threads, locks or clocks: the caller serialises calls and passes the device time (`due`) to
// step(), which arbitrates the board, runs the engine to the events that are due and publishes the
// slot's ground truth. So the same code runs against the steady clock (driver, server) and in unit
// tests against a virtual clock.
//
// Invariants: the engine's window is open only while this slot holds the board (or there is no
// board: then the process slices only its own contexts); the slot's counters only grow; a slot is
// claimed by CAS on its pid and a dead holder's window is freed from its end.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "engine.h"
#include "timeslice_board.h"

namespace simgpu {

class DeviceRunner {
 public:
  static constexpr uint64_t kNever = UINT64_MAX;
  // A process waiting for another's window looks again at least this often (device time): the
  // holder may release early. Only the wall-clock moment of noticing depends on it.
  static constexpr uint64_t kPollNs = 1'000'000;

  // queued: the number of kernels on their way to the engine (launched, not yet submitted), kept
  // by the caller (it may change without the caller's serialisation); they count as work for the
  // slicer, so the process keeps the device between back-to-back kernels. Null: none.
  DeviceRunner(const EngineParams& p, Engine::Completion done, const std::atomic<int64_t>* queued = nullptr)
      : p_(p), engine_(p, std::move(done)), queued_(queued) {}

  // Claims a slot of b for process `pid` (a free one, or one of a dead process). mpsServer marks
  // the slot as an MPS server's. false with *why when every slot is taken (the runner then slices
  // only its own contexts).
  bool joinBoard(Board* b, int32_t pid, bool mpsServer, std::string* why);
  Board* board() const { return board_; }
  int slot() const { return slot_; }

  Engine& engine() { return engine_; }
  const Engine& engine() const { return engine_; }

  // Queues a kernel whose stream reached startNs: it starts there, or later if the engine already
  // moved past that (time never goes back). Returns the engine's kernel id.
  uint64_t submit(int ctx, int streamPriority, const KernelShape& k, uint64_t startNs);


  // One step at device time `due`: the board first (so a window renewed late still joins the
  // previous one seamlessly), then the engine to the events that are due (its clock then stays at
  // the last one, so a stream that continues from that point starts exactly there), then the
  // slot's stats. Returns the device time to look again (kNever: nothing to do until new work).
  uint64_t step(uint64_t due);

 private:
  uint64_t arbitrate(uint64_t due);
  void publish();

  EngineParams p_;
  Engine engine_;
  Board* board_ = nullptr;
  int slot_ = -1;
  uint64_t windowStart_ = 0;
  const std::atomic<int64_t>* queued_;

  int64_t queued() const { return queued_ ? queued_->load(std::memory_order_acquire) : 0; }
};

}  // namespace simgpu
