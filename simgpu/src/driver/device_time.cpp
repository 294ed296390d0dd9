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
// engine's window is open only while this process holds the board (device_runner.h). The device
// is stepped (board, then due events) by a runner thread and by any worker waiting for its kernel.
// An MPS client has no engine of its own: each kernel's shape goes to its server, which runs all
// its clients in one engine (mps_client.h), and the worker waits for the server's answer.
//
// Invariants: the engine is only touched under d.mu; nobody sleeps past the engine's next event
// or the board's next decision; the engine is never destroyed (cudart tears down after our
// destructors).
#include <unistd.h>

#include <chrono>
#include <thread>
#include <unordered_map>

#include "device_runner.h"
#include "driver.h"
#include "engine.h"
#include "mps_client.h"
#include "probe_twin.h"
#include "timeslice_board.h"

namespace simgpu {
namespace {

thread_local uint64_t tlsStreamNs = 0;          // the device time the executing stream has reached
thread_local const Stream* tlsStream = nullptr;  // the stream whose operation this worker runs

struct DeviceEngine {
  std::mutex mu;
  std::condition_variable wake;  // the runner: new work or an earlier next event
  std::condition_variable done;  // workers: a kernel completed
  DeviceRunner* runner = nullptr;  // the engine and this process's board slot (device_runner.h)
  std::unordered_map<uint64_t, uint64_t> finished;  // kernel id -> end, until its waiter takes it
  std::unordered_map<uint64_t, std::vector<BlockEvent>> traces;  // traced kernels (probe twins)' blocks
  std::unordered_map<const Context*, int> contexts;
  bool runnerStarted = false;
  std::atomic<int64_t> queued{0};  // kernels launched on streams, not yet at the engine
};

constexpr uint64_t kNever = DeviceRunner::kNever;

DeviceEngine& deviceEngine(int dev) {
  static auto* engines = new DeviceEngine[kMaxDevices];
  return engines[dev];
}

uint64_t realNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// Caller holds d.mu. One step of the device (DeviceRunner::step), then wakes the waiting
// workers. Run by the runner thread, and by a worker waiting for its kernel (which saves a
// thread hop per kernel).
uint64_t step(DeviceEngine& d) {
  const uint64_t next = d.runner->step(deviceNowNs());
  d.done.notify_all();
  return next;
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

// Caller holds d.mu.
void ensureEngine(DeviceEngine& d, int dev) {
  if (!d.runner) {
    const Config& cfg = drv().cfg;
    EngineParams p;
    p.sms = cfg.smCount;
    p.sliceNs = cfg.sliceNs;
    p.switchNs = cfg.switchNs;
    d.runner = new DeviceRunner(p, [&d](uint64_t id, uint64_t end) { d.finished[id] = end; }, &d.queued);
    d.runner->engine().setBlockObserver([&d](const BlockEvent& e) { d.traces[e.kernel].push_back(e); });
    std::string err;
    Board* b = openBoard(cfg.stateDir, boardDevice(dev), &err);  // one per physical device (or MIG device)
    if (!b) {
      std::fprintf(stderr, "simgpu: %s; kernels of this process do not take turns with other processes\n", err.c_str());
    } else if (!d.runner->joinBoard(b, getpid(), false, &err)) {
      std::fprintf(stderr, "simgpu: device %d: %s; this process does not take turns\n", dev, err.c_str());
    }
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
    d.runner = nullptr;
    new (&d.finished) std::unordered_map<uint64_t, uint64_t>;
    new (&d.traces) std::unordered_map<uint64_t, std::vector<BlockEvent>>;
    new (&d.contexts) std::unordered_map<const Context*, int>;
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
  // A process's own engine: every context is its own time-slice group. (An MPS client's contexts
  // run in its server's engine instead, with its SM cap and priority: see deviceExecute.)
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

CUresult deviceExecute(const KernelParams& k) {
  const Stream* s = tlsStream;
  if (!s) return CUDA_SUCCESS;  // not on a stream worker: nothing to wait for
  const Context* ctx = s->ctx;
  const int streamPriority = s->priority;
  DeviceEngine& d = deviceEngine(k.device);
  ProbeLaunch probe;  // a probe kernel's native twin: time-boxed, traced, writes its records
  if (k.fn->probeKind) {
    if (const CUresult r = probeBegin(k, &probe); r != CUDA_SUCCESS) {
      if (k.queued) d.queued.fetch_sub(1, std::memory_order_acq_rel);
      return r;
    }
  }
  KernelShape shape = kernelShape(k);
  probeShape(probe, &shape);
  // Its managed memory's faults: it starts that much later than its stream or the device allows.
  if (k.faultNs != 0) tlsStreamNs = std::max(tlsStreamNs, deviceNowNs()) + k.faultNs;
  if (mpsClient()) {
    // The server runs it in its one engine, side by side with its other clients' work.
    const int64_t behind = k.queued ? d.queued.fetch_sub(1, std::memory_order_acq_rel) - 1 : d.queued.load();
    uint64_t end = 0;
    std::vector<BlockTrace> traces;
    const CUresult r = mpsRunKernel(hostDevice(k.device), ctx->id, streamPriority, shape, tlsStreamNs,
                                    static_cast<uint32_t>(std::max<int64_t>(0, behind)), &end,
                                    shape.traceBlocks ? &traces : nullptr);
    tlsStreamNs = std::max(tlsStreamNs, end);
    if (r != CUDA_SUCCESS) return r;
    return probeEnd(k, probe, traces);
  }
  std::unique_lock l(d.mu);
  ensureEngine(d, k.device);
  if (k.queued) d.queued.fetch_sub(1, std::memory_order_acq_rel);
  auto [it, fresh] = d.contexts.try_emplace(ctx, 0);
  if (fresh) {
    const EngineContextParams p = engineContextParams(ctx);
    it->second = d.runner->engine().addContext(p.group, p.smCap, p.clientPriority);
  }
  // The kernel starts where its stream is, or later if the engine already moved past that.
  const uint64_t id = d.runner->submit(it->second, streamPriority, shape, tlsStreamNs);
  d.wake.notify_one();
  while (d.finished.count(id) == 0) {
    const uint64_t next = step(d);
    if (d.finished.count(id)) break;
    if (next == kNever) d.done.wait(l);
    else d.done.wait_until(l, realTimeOf(next));
  }
  tlsStreamNs = std::max(tlsStreamNs, d.finished[id]);
  d.finished.erase(id);
  if (!shape.traceBlocks) return CUDA_SUCCESS;
  std::vector<BlockTrace> traces;
  if (auto t = d.traces.find(id); t != d.traces.end()) {
    foldBlockEvents(t->second, shape.blocks, &traces);
    d.traces.erase(t);
  } else {
    traces.assign(shape.blocks, BlockTrace{});
  }
  l.unlock();
  return probeEnd(k, probe, traces);
}

}  // namespace simgpu
