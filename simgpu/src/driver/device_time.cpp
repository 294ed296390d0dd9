// Device time in the driver: one Engine (engine.h) per simulated device of this process, driven
// against the steady clock by a runner thread; kernels wait in their stream's worker until the
// engine completes them, so everything after them in stream order (events, host callbacks,
// cuStreamQuery, synchronisation) follows device time.
//
// Device time is CLOCK_MONOTONIC divided by SIMGPU_TIME_SCALE, so it means the same in every
// process of the host. Each stream keeps the device time its work has reached (lastDoneNs): an
// operation starts at max(its submission, the stream's previous operation's end), a kernel ends
// when the engine says, and an event is stamped with that position, not with the moment the
// worker thread woke up, so event times are exact to the model.
//
// Processes take turns on the device through its time-slice board (timeslice_board.h): the
// engine's window is open only while this process holds the board. The device is stepped (board,
// then due events) by a runner thread and by any worker waiting for its kernel.
//
// Invariants: the engine is only touched under d.mu; nobody sleeps past the engine's next event
// or the board's next decision; the engine is never destroyed (cudart tears down after our
// destructors).
#include <unistd.h>

#include <chrono>
#include <thread>
#include <unordered_map>

#include "driver.h"
#include "engine.h"
#include "timeslice_board.h"

namespace simgpu {
namespace {

thread_local uint64_t tlsStreamNs = 0;          // the device time the executing stream has reached
thread_local const Stream* tlsStream = nullptr;  // the stream whose operation this worker runs

struct DeviceEngine {
  std::mutex mu;
  std::condition_variable wake;  // the runner: new work or an earlier next event
  std::condition_variable done;  // workers: a kernel completed
  Engine* engine = nullptr;
  std::unordered_map<uint64_t, uint64_t> finished;  // kernel id -> end, until its waiter takes it
  std::unordered_map<const Context*, int> contexts;
  bool runnerStarted = false;
  // Cross-process time slicing (timeslice_board.h); null: this process slices only its own
  // contexts (the board could not be opened, or every slot is taken).
  Board* board = nullptr;
  int slot = -1;
  uint64_t windowStart = 0;
  std::atomic<int64_t> queued{0};  // kernels launched on streams, not yet at the engine
};

constexpr uint64_t kNever = UINT64_MAX;
// A process waiting for another's window looks again at least this often (device time): the
// holder may release early. Only the wall-clock moment of noticing depends on it, not the model.
constexpr uint64_t kPollNs = 1'000'000;

DeviceEngine& deviceEngine(int dev) {
  static auto* engines = new DeviceEngine[kMaxDevices];
  return engines[dev];
}

uint64_t realNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

bool othersWant(const Board* b, int self) {
  for (uint32_t i = 0; i < kBoardSlots; ++i)
    if (static_cast<int>(i) != self && b->slot[i].wants.load(std::memory_order_acquire) &&
        pidAlive(b->slot[i].pid.load(std::memory_order_relaxed)))
      return true;
  return false;
}

// Caller holds d.mu. Takes, keeps or gives up the device on the board (protocol in
// timeslice_board.h) and opens the engine's window to match. Returns the device time at which to
// look again.
uint64_t arbitrate(DeviceEngine& d, uint64_t due) {
  Board* b = d.board;
  if (!b) return kNever;
  Engine& e = *d.engine;
  const Config& cfg = drv().cfg;
  const bool wants = !e.idle() || d.queued.load(std::memory_order_acquire) > 0;
  b->slot[d.slot].wants.store(wants ? 1 : 0, std::memory_order_release);
  uint64_t h = b->holder.load(std::memory_order_acquire);
  const int hs = h ? boardSlotOf(h) : -1;
  const uint64_t end = h ? boardEndOf(h) : 0;
  const uint32_t me = static_cast<uint32_t>(d.slot + 1);
  auto take = [&](uint64_t from) -> uint64_t {
    uint64_t start = std::max(e.now(), from);
    const uint32_t last = b->lastRan.load(std::memory_order_acquire);
    if (last != 0 && last != me) start += cfg.switchNs;
    const uint64_t packed = boardPack(d.slot, start + cfg.sliceNs);
    if (!b->holder.compare_exchange_strong(h, packed, std::memory_order_acq_rel)) return due;  // raced: look again
    if (last != me) {
      b->lastRan.store(me, std::memory_order_release);
      if (last != 0) b->switches.fetch_add(1, std::memory_order_relaxed);
    }
    d.windowStart = start;
    e.setWindow(start, boardEndOf(packed));
    return boardEndOf(packed) - cfg.sliceNs / 2;
  };
  auto renew = [&]() -> uint64_t {
    const uint64_t packed = boardPack(d.slot, end + cfg.sliceNs);
    if (!b->holder.compare_exchange_strong(h, packed, std::memory_order_acq_rel)) return due;
    e.setWindow(d.windowStart, boardEndOf(packed));
    return boardEndOf(packed) - cfg.sliceNs / 2;
  };
  if (hs == d.slot) {
    if (!wants) {  // work-conserving: an idle process yields at once
      b->freeSinceNs.store(e.now(), std::memory_order_release);
      if (b->holder.compare_exchange_strong(h, 0, std::memory_order_acq_rel)) e.setWindow(kNever, kNever);
      return kNever;
    }
    const bool others = othersWant(b, d.slot);
    if (!others && due + cfg.sliceNs / 2 >= end) return renew();  // nobody waits: keep going
    if (due < end) return others ? end : end - cfg.sliceNs / 2;
    // The window is over and others wanted the device: they get a grace period to take it.
    const uint64_t grace = end + cfg.switchNs + kPollNs;
    return due >= grace ? take(grace) : grace;
  }
  if (!wants) return kNever;
  if (hs < 0) return take(b->freeSinceNs.load(std::memory_order_acquire));
  if (!pidAlive(b->slot[hs].pid.load(std::memory_order_relaxed))) return take(std::min(due, end));
  if (due >= end) return take(end);
  return std::min(end, due + kPollNs);  // someone else's window
}

void publishStats(DeviceEngine& d) {
  if (!d.board) return;
  ContextStats sum;
  for (int i = 0; i < d.engine->contextCount(); ++i) {
    const ContextStats& c = d.engine->stats(i);
    sum.busyNs += c.busyNs;
    sum.busySmNs += c.busySmNs;
    sum.blocksRun += c.blocksRun;
    sum.kernelsRun += c.kernelsRun;
    sum.slicedOutNs += c.slicedOutNs;
  }
  BoardSlot& s = d.board->slot[d.slot];
  s.busyNs.store(sum.busyNs, std::memory_order_relaxed);
  s.busySmNs.store(sum.busySmNs, std::memory_order_relaxed);
  s.blocksRun.store(sum.blocksRun, std::memory_order_relaxed);
  s.kernelsRun.store(sum.kernelsRun, std::memory_order_relaxed);
  s.slicedOutNs.store(sum.slicedOutNs, std::memory_order_relaxed);
  s.updatedNs.store(d.engine->now(), std::memory_order_release);
}

// Caller holds d.mu. One step of the device: the board first (so a window renewed late still
// joins the previous one seamlessly), then the engine only to the events that are due (its clock
// then stays at the last one, so a stream that continues from that point starts exactly there).
// Returns the device time of the next thing to do. Run by the runner thread, and by a worker
// waiting for its kernel (which saves a thread hop per kernel).
uint64_t step(DeviceEngine& d) {
  const uint64_t due = deviceNowNs();
  uint64_t look = arbitrate(d, due);
  for (uint64_t next; (next = d.engine->nextEventTime()) <= due;) d.engine->advanceTo(next);
  if (d.board && d.engine->idle() && d.queued.load() == 0) look = std::min(look, arbitrate(d, due));
  publishStats(d);
  d.done.notify_all();
  return std::min(look, d.engine->nextEventTime());
}

std::chrono::steady_clock::time_point realTimeOf(uint64_t deviceNs) {
  const double real = static_cast<double>(deviceNs) * drv().cfg.timeScale;
  return std::chrono::steady_clock::time_point(std::chrono::nanoseconds(static_cast<uint64_t>(real) + 1));
}

void runner(DeviceEngine* d) {
  std::unique_lock l(d->mu);
  for (;;) {
    const uint64_t next = step(*d);
    if (next == kNever) {
      d->wake.wait(l);
    } else {
      d->wake.wait_until(l, realTimeOf(next));
    }
  }
}

// Caller holds d.mu. Claims a slot on the device's board (a free one, or one of a dead process).
void joinBoard(DeviceEngine& d, int dev) {
  std::string err;
  Board* b = openBoard(drv().cfg.stateDir, hostDevice(dev), &err);  // one board per physical device
  if (!b) {
    std::fprintf(stderr, "simgpu: %s; kernels of this process do not take turns with other processes\n", err.c_str());
    return;
  }
  const int32_t self = getpid();
  for (uint32_t i = 0; i < kBoardSlots; ++i) {
    int32_t pid = b->slot[i].pid.load(std::memory_order_acquire);
    if (pid != 0 && pidAlive(pid)) continue;
    if (!b->slot[i].pid.compare_exchange_strong(pid, self, std::memory_order_acq_rel)) continue;
    BoardSlot& s = b->slot[i];
    s.wants.store(0);
    s.busyNs.store(0), s.busySmNs.store(0), s.blocksRun.store(0), s.kernelsRun.store(0), s.slicedOutNs.store(0);
    // A dead process may have held the device from this slot: free it from the end of its window.
    uint64_t h = b->holder.load(std::memory_order_acquire);
    if (h && boardSlotOf(h) == static_cast<int>(i)) {
      b->freeSinceNs.store(boardEndOf(h), std::memory_order_release);
      b->holder.compare_exchange_strong(h, 0, std::memory_order_acq_rel);
    }
    d.board = b;
    d.slot = static_cast<int>(i);
    d.engine->setWindow(kNever, kNever);  // closed until the board grants a window
    return;
  }
  std::fprintf(stderr, "simgpu: all %u time-slice slots of device %d are taken; this process does not take turns\n",
               kBoardSlots, dev);
}

// Caller holds d.mu.
void ensureEngine(DeviceEngine& d, int dev) {
  if (!d.engine) {
    EngineParams p;
    p.sms = drv().cfg.smCount;
    p.sliceNs = drv().cfg.sliceNs;
    p.switchNs = drv().cfg.switchNs;
    d.engine = new Engine(p, [&d](uint64_t id, uint64_t end) { d.finished[id] = end; });
    joinBoard(d, dev);
  }
  if (!d.runnerStarted) {
    d.runnerStarted = true;
    std::thread(runner, &d).detach();
  }
}

[[maybe_unused]] const int kResetRunnersAtFork = pthread_atfork(nullptr, nullptr, [] {
  for (int i = 0; i < kMaxDevices; ++i) {
    DeviceEngine& d = deviceEngine(i);
    new (&d.mu) std::mutex;  // the parent's threads are gone; their lock state is meaningless here
    new (&d.wake) std::condition_variable;
    new (&d.done) std::condition_variable;
    d.runnerStarted = false;
    // The parent's engine, contexts and board slot are the parent's: start afresh (leaked).
    d.engine = nullptr;
    new (&d.finished) std::unordered_map<uint64_t, uint64_t>;
    new (&d.contexts) std::unordered_map<const Context*, int>;
    d.board = nullptr;
    d.slot = -1;
    d.queued.store(0);
  }
});

}  // namespace

void deviceKernelQueued(int dev) { deviceEngine(dev).queued.fetch_add(1, std::memory_order_acq_rel); }

uint64_t deviceNowNs() {
  const uint64_t r = realNs();
  const double scale = drv().cfg.timeScale;
  return scale == 1.0 ? r : static_cast<uint64_t>(static_cast<double>(r) / scale);
}

EngineContextParams engineContextParams(const Context* c) {
  // The one place MPS plugs in: an MPS client's contexts get group = its server's pid (the whole
  // server is one context to the time slicer), smCap and clientPriority from the client's
  // parameters (../notes: mps-engine-interface). Without MPS every context is its own group.
  EngineContextParams p;
  p.group = c->id;
  p.smCap = drv().cfg.testSmCap;  // tests of the cap's effect in a real program, until MPS sets it
  return p;
}

uint64_t streamPositionNs() { return tlsStreamNs; }
void streamPositionAtLeast(uint64_t ns) { tlsStreamNs = std::max(tlsStreamNs, ns); }
void streamExecBegin(const Stream* s, uint64_t ns) {
  tlsStream = s;
  tlsStreamNs = ns;
}

namespace {
KernelShape kernelShape(const KernelParams& k) {
  KernelShape s;
  s.blocks = static_cast<uint64_t>(k.grid[0]) * k.grid[1] * k.grid[2];
  s.threadsPerBlock = k.block[0] * k.block[1] * k.block[2];
  s.registersPerThread = k.fn->registers;
  s.sharedPerBlock = std::max<uint32_t>(k.fn->staticShared, kReservedSharedPerBlock) + k.sharedMem;
  s.blockNs = k.blockNs;
  return s;
}

}  // namespace

bool blockFitsSm(const Function* f, const unsigned block[3], unsigned sharedMem) {
  KernelParams k;
  k.fn = const_cast<Function*>(f);
  for (int i = 0; i < 3; ++i) k.block[i] = block[i];
  k.sharedMem = sharedMem;
  return blocksPerSm(kernelShape(k), SmLimits{}) > 0;
}

void deviceExecute(const KernelParams& k) {
  const Stream* s = tlsStream;
  if (!s) return;  // not on a stream worker: nothing to wait for
  const Context* ctx = s->ctx;
  const int streamPriority = s->priority;
  DeviceEngine& d = deviceEngine(k.device);
  std::unique_lock l(d.mu);
  ensureEngine(d, k.device);
  if (k.queued) d.queued.fetch_sub(1, std::memory_order_acq_rel);
  auto [it, fresh] = d.contexts.try_emplace(ctx, 0);
  if (fresh) {
    const EngineContextParams p = engineContextParams(ctx);
    it->second = d.engine->addContext(p.group, p.smCap, p.clientPriority);
  }
  // The kernel starts where its stream is, or later if the engine already moved past that.
  if (tlsStreamNs > d.engine->now()) d.engine->advanceTo(tlsStreamNs);
  const uint64_t id = d.engine->submit(it->second, streamPriority, kernelShape(k));
  d.wake.notify_one();
  while (d.finished.count(id) == 0) {
    const uint64_t next = step(d);
    if (d.finished.count(id)) break;
    if (next == kNever) d.done.wait(l);
    else d.done.wait_until(l, realTimeOf(next));
  }
  tlsStreamNs = std::max(tlsStreamNs, d.finished[id]);
  d.finished.erase(id);
}

}  // namespace simgpu
