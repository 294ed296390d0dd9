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
// Invariants: the engine is only touched under g.mu; the runner never sleeps past the engine's
// next event; the engine is never destroyed (cudart tears down after our destructors).
#include <chrono>
#include <thread>
#include <unordered_map>

#include "driver.h"
#include "engine.h"

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
};

DeviceEngine& deviceEngine(int dev) {
  static auto* engines = new DeviceEngine[kMaxDevices];
  return engines[dev];
}

uint64_t realNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

void runner(DeviceEngine* d) {
  std::unique_lock l(d->mu);
  for (;;) {
    // Only to the events that are due: the engine's clock then stays at the last one, so a
    // stream that continues from that point (its next kernel) starts exactly there.
    const uint64_t due = deviceNowNs();
    for (uint64_t next; (next = d->engine->nextEventTime()) <= due;) d->engine->advanceTo(next);
    d->done.notify_all();
    const uint64_t next = d->engine->nextEventTime();
    if (next == UINT64_MAX) {
      d->wake.wait(l);
    } else {
      const double real = static_cast<double>(next) * drv().cfg.timeScale;
      d->wake.wait_until(l, std::chrono::steady_clock::time_point(
                                std::chrono::nanoseconds(static_cast<uint64_t>(real) + 1)));
    }
  }
}

// Caller holds d.mu.
void ensureEngine(DeviceEngine& d) {
  if (!d.engine) {
    EngineParams p;
    p.sms = drv().cfg.smCount;
    p.sliceNs = drv().cfg.sliceNs;
    p.switchNs = drv().cfg.switchNs;
    d.engine = new Engine(p, [&d](uint64_t id, uint64_t end) { d.finished[id] = end; });
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
  }
});

}  // namespace

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
  ensureEngine(d);
  auto [it, fresh] = d.contexts.try_emplace(ctx, 0);
  if (fresh) {
    const EngineContextParams p = engineContextParams(ctx);
    it->second = d.engine->addContext(p.group, p.smCap, p.clientPriority);
  }
  // The kernel starts where its stream is, or later if the engine already moved past that.
  if (tlsStreamNs > d.engine->now()) d.engine->advanceTo(tlsStreamNs);
  const uint64_t id = d.engine->submit(it->second, streamPriority, kernelShape(k));
  d.wake.notify_one();
  d.done.wait(l, [&] { return d.finished.count(id) != 0; });
  tlsStreamNs = std::max(tlsStreamNs, d.finished[id]);
  d.finished.erase(id);
}

}  // namespace simgpu
