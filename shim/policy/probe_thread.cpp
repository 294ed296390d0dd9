// Probe rounds in a tenant process (docs/probes.md, "In the shim"): the pacer notices a request
// in the broker's compute words of a device (probe_seq moved, probe_slot is this process's slot)
// and hands it to the probe thread, which loads the probe kernels (probes.fatbin beside the shim)
// into the device's primary context once, waits for the round's instant, runs the probes through
// the shim's own launch hook (so they wait at the tenant's gate like its kernels, and are metered
// and charged like them) and writes the records to the tenant's probe file.
//
// Never on the application's allocation or launch path: the pacer only compares a word and
// signals; the work is on this thread, started at the first request.
#include "policy/probe_thread.h"

#include <dlfcn.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cerrno>
#include <cstdio>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>

#include "cushare/probe_file.h"
#include "interpose/real.h"
#include "probe_runner.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {
namespace {

struct Request {
  int ordinal = -1;
  uint32_t seq = 0, entry = 0, what = 0, budgetUs = 0;
  uint64_t at = 0;
};

pthread_mutex_t gMu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t gCv = PTHREAD_COND_INITIALIZER;
// Requests in the order they came (a fixed ring: no allocation under the pacer's lock). A request
// whose probes wait for the tenant's turn delays the next, whose probes would wait as long: each
// start is still measured from its own instant. Full: the oldest is dropped (never answered; the
// broker's round forgets it).
constexpr int kQueue = 16;
Request gQueue[kQueue];
int gHead = 0, gCount = 0;
bool gStarted = false;
std::atomic<bool> gExiting{false};  // the process is exiting: no more driver calls from the thread
thread_local int tProbeOrdinal = -1;  // the device the probe thread is launching on
// The round's launches so far, and whether its first waited at the tenant's closed gate
// (kAnswerFirstLaunchWaitedAtGate).
thread_local unsigned tRoundLaunches = 0;
thread_local bool tFirstLaunchWaited = false;
// The thread's last waits at the gate (CLOCK_REALTIME, [start, end]): a request whose instant came
// while the thread waited at the gate for an earlier one waited behind that gate too (it runs
// once the gate opens, its latency counted from its instant, and is no solo start).
// Per device; room for every launch of every queued request (three each).
struct GateWait {
  int ordinal = -1;
  uint64_t start = 0, end = 0;
};
thread_local GateWait tGateWaits[3 * kQueue];
thread_local unsigned tGateWaitCount = 0;
bool waitedAtGateAt(int ordinal, uint64_t at) {
  for (const GateWait& w : tGateWaits)
    if (w.ordinal == ordinal && w.end != 0 && w.start <= at && at <= w.end) return true;
  return false;
}
uint32_t gSeen[kMaxDevices] = {};  // the pacer's last seen probe_seq per device (under the pacer's lock)

// Per device: on the probe thread, and in ProbeContextGuard (probe_thread.h); always under gRoundMu.
struct DeviceProbe {
  std::unique_ptr<probe::ProbeRunner> runner;
  CUstream stream = nullptr;
  bool retained = false;  // the thread holds a reference to the device's primary context
  CUdevice device = 0;    // the device it retained
  bool failed = false;  // loading failed: every later request answered with the same status
  int32_t status = probe::kProbeOk;
  std::string error;
};
// On the heap and never destroyed: the detached probe thread may be in a round when the process's
// static destructors run, and a library's destructor may release a context after ours would run.
DeviceProbe (&gDevices)[kMaxDevices] = *new DeviceProbe[1][kMaxDevices];
// probes.fatbin's path, found once by the thread before it takes any lock (dladdr takes the
// loader's lock, which a library's teardown may hold while it releases a context).
const std::string* gFatbin = nullptr;
// Held while the thread loads or runs a round (never while it sleeps until an instant), and by
// the shim's hooks across a program's release or reset of a primary context (ProbeContextGuard):
// the two never use a context at once.
pthread_mutex_t gRoundMu = PTHREAD_MUTEX_INITIALIZER;
// Guards waiting for gRoundMu: a probe launch waiting at the tenant's gate gives up (the round
// fails), so a release or reset never waits for a turn the tenant may never get.
std::atomic<int> gGuardsWaiting{0};
int gFile = -1;  // the tenant's probe file

constexpr uint64_t kMissedInstant = 50'000'000;  // later than this past the instant: not run
constexpr uint64_t kMemBuffer = uint64_t{32} << 20;  // the memory probe's buffer
constexpr uint64_t kSmallBuffer = uint64_t{64} << 10;  // without the memory probe

long futexShared(std::atomic<uint32_t>* word, uint32_t expected, uint64_t timeoutNs) noexcept {
  timespec ts{static_cast<time_t>(timeoutNs / 1'000'000'000u), static_cast<long>(timeoutNs % 1'000'000'000u)};
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

uint64_t clockNs(clockid_t c) {
  timespec ts;
  clock_gettime(c, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

// probes.fatbin beside the shim (installed: lib/cushare/), or in cushare/ beside it (build tree).
std::string fatbinPath() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&probeCheck), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string dir = info.dli_fname;
  const size_t slash = dir.rfind('/');
  dir = slash == std::string::npos ? "." : dir.substr(0, slash);
  for (const std::string& p : {dir + "/probes.fatbin", dir + "/cushare/probes.fatbin"})
    if (access(p.c_str(), R_OK) == 0) return p;
  return "";
}

// Whether the process already uses the device's primary context (every CUDA runtime program does).
bool primaryContextInUse(RealDriver& d, int ordinal) {
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  return d.p_cuDeviceGet && d.p_cuDevicePrimaryCtxGetState && d.p_cuDeviceGet(&dev, ordinal) == CUDA_SUCCESS &&
         d.p_cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS && active != 0;
}

void writeAnswer(const Request& r, int32_t status, const std::string& error, const probe::RoundRecords* rec,
                 uint32_t smCount, uint32_t workPerStep, uint32_t flags = 0) {
  if (gFile < 0) {
    const ShimState& st = state();
    const std::string path = st.config.ledgerDir + "/" + st.config.tenant + ".probe";
    gFile = open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (gFile < 0) {
      logLine(LogLevel::kWarn, "cushare: cannot open the probe file %s: %s (probe rounds not answered)", path.c_str(),
              std::strerror(errno));
      return;
    }
  }
  const size_t base = probe::probeAnswerOffset(r.seq);
  probe::ProbeAnswerHeader h{};
  h.entry = r.entry;
  h.status = status;
  h.sm_count = smCount;
  h.at_ns = r.at;
  h.flags = flags;
  std::snprintf(h.error, sizeof h.error, "%s", error.c_str());
  uint32_t next = 0;
  if (rec != nullptr && status == probe::kProbeOk) {
    const probe::ProbeRun* runs[3] = {&rec->tick, &rec->sm, &rec->mem};
    for (int i = 0; i < 3; ++i) {
      const probe::ProbeRun& run = *runs[i];
      if (run.blocks == 0) continue;
      if (run.records.size() != run.blocks || run.blocks > probe::kProbeFileMaxRecords - next) {
        h.status = probe::kProbeTooManyRecords;
        std::snprintf(h.error, sizeof h.error, "%u blocks do not fit an answer", run.blocks);
        break;
      }
      probe::ProbeFileLaunch& l = h.launches[i];
      l.kind = run.kind;
      l.blocks = run.blocks;
      l.threads = run.threads;
      l.work_per_step = run.kind == probe::kProbeSm ? workPerStep : 0;
      l.budget_ns = run.budgetNs;
      l.launch_realtime_ns = run.launchRealtimeNs;
      l.launch_monotonic_ns = run.launchMonotonicNs;
      l.first_record = next;
      const size_t bytes = run.records.size_bytes();
      const off_t at = static_cast<off_t>(base + sizeof h + size_t{next} * sizeof(probe::BlockRecord));
      if (pwrite(gFile, run.records.data(), bytes, at) != static_cast<ssize_t>(bytes)) return;
      next += run.blocks;
    }
  }
  h.done_ns = clockNs(CLOCK_REALTIME);
  // The header without seq, then seq alone (4 aligned bytes): the broker reads an answer only
  // once its seq names the request, and then finds the whole of it.
  h.seq = 0;
  if (pwrite(gFile, &h, sizeof h, static_cast<off_t>(base)) != static_cast<ssize_t>(sizeof h)) return;
  (void)pwrite(gFile, &r.seq, sizeof r.seq, static_cast<off_t>(base + offsetof(probe::ProbeAnswerHeader, seq)));
}

// The whole device's multiprocessors. An MPS client with an active thread percentage sees only
// its share of them (the attribute reflects the limit), so its count is scaled back by the
// percentage the shim set for it (mps_env.cpp): exact on simgpu, within the server's rounding to
// whole TPCs on a GPU (a client of 30 % of 132 SMs sees 40: 133).
uint32_t deviceSms(uint32_t visible) {
  const char* p = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  if (p == nullptr || *p == '\0') return visible;
  char* end = nullptr;
  const double pct = std::strtod(p, &end);
  if (end == p || pct <= 0 || pct >= 100) return visible;
  return static_cast<uint32_t>(visible * 100.0 / pct + 0.5);
}

// Frees the runner (its module and memory, in its context, while it still exists: their charges
// return through the shim's hooks), then the thread's reference to the primary context. Under
// gRoundMu. The next request loads again if the process uses the context then.
void letGo(DeviceProbe& dp) {
  RealDriver& d = realDriver();
  if (dp.stream != nullptr) cuStreamDestroy_v2(dp.stream);
  dp.stream = nullptr;
  dp.runner.reset();
  if (dp.retained && d.p_cuDevicePrimaryCtxRelease_v2) d.p_cuDevicePrimaryCtxRelease_v2(dp.device);
  dp = DeviceProbe{};
}

// The thread's own reference to the device's primary context (recorded in dp, so that letGo and
// ProbeContextGuard drop it), made current on this thread.
bool retainAndMakeCurrent(RealDriver& d, int ordinal, DeviceProbe& dp) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (!d.p_cuDeviceGet || !d.p_cuDevicePrimaryCtxRetain || !d.p_cuCtxSetCurrent ||
      d.p_cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS || d.p_cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS)
    return false;
  dp.retained = true;
  dp.device = dev;
  return d.p_cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
}

void runRequest(const Request& r) {
  if (gExiting.load(std::memory_order_acquire)) return;
  DeviceProbe& dp = gDevices[r.ordinal];
  RealDriver& d = realDriver();
  // The memory probe's buffer (charged to the tenant) only when the memory probe is asked for;
  // a runner loaded without it is loaded again the first time it is.
  const uint64_t memBuffer = (r.what & probe::kRunMem) ? kMemBuffer : kSmallBuffer;
  if (dp.runner && dp.runner->options().memBufferBytes < memBuffer) letGo(dp);  // its reference too
  if (!dp.runner && !dp.failed) {
    const std::string path = gFatbin != nullptr ? *gFatbin : std::string();
    if (path.empty()) {
      dp.failed = true;
      dp.status = probe::kProbeNoFatbin;
      dp.error = "probes.fatbin not found beside the shim";
    } else if (!primaryContextInUse(d, r.ordinal)) {
      // A program with contexts of its own (driver API): a probe in the primary context would be
      // a context beside the program's, time-sliced against it (measuring the program as
      // interference) and, on a GPU, hundreds of MiB the ledger does not see. Not probed; asked
      // again next round (the program may start using it).
      writeAnswer(r, probe::kProbeRunFailed, "not probed: the process does not use the primary context",
                  nullptr, 0, 0);
      return;
    } else if (!retainAndMakeCurrent(d, r.ordinal, dp)) {
      dp.failed = true;
      dp.status = probe::kProbeLoadFailed;
      dp.error = "no primary context for the device";
    } else {
      probe::RunnerOptions o;
      o.memBufferBytes = memBuffer;
      if (const probe::ProbeError e = probe::ProbeRunner::load(path.c_str(), o, &dp.runner); e) {
        dp.failed = true;
        dp.status = probe::kProbeLoadFailed;
        dp.error = e.message();
      } else {
        // The highest priority stream of the context: the probe is not queued behind the
        // tenant's own blocks (docs/probe-analysis.md).
        int least = 0, greatest = 0;
        if (d.p_cuCtxGetStreamPriorityRange) d.p_cuCtxGetStreamPriorityRange(&least, &greatest);
        if (cuStreamCreateWithPriority(&dp.stream, CU_STREAM_NON_BLOCKING, greatest) != CUDA_SUCCESS) dp.stream = nullptr;
      }
    }
    if (dp.failed)
      logLine(LogLevel::kWarn, "cushare: probe rounds on device %d are not run: %s", r.ordinal, dp.error.c_str());
  }
  if (dp.failed) {
    writeAnswer(r, dp.status, dp.error, nullptr, 0, 0);
    return;
  }
  // The instant (CLOCK_REALTIME, absolute); a request already long past is not run (its start
  // would read as a wait for the device). The wait is outside gRoundMu: a program's release or
  // reset meanwhile lets go of the runner, which is then loaded again.
  const bool idleAtInstant = clockNs(CLOCK_REALTIME) <= r.at;
  timespec at{static_cast<time_t>(r.at / 1'000'000'000u), static_cast<long>(r.at % 1'000'000'000u)};
  pthread_mutex_unlock(&gRoundMu);
  while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &at, nullptr) == EINTR) {
  }
  pthread_mutex_lock(&gRoundMu);
  if (gExiting.load(std::memory_order_acquire)) return;
  if (!dp.runner) {
    writeAnswer(r, probe::kProbeRunFailed, "the program let go of the primary context before the instant", nullptr,
                0, 0);
    return;
  }
  // (Running such a round anyway when its instant came while the thread waited at the gate, so
  // that its 0 is counted, made shares worse on simgpu: 0.377 / 0.612 for 0.328 / 0.659 in
  // BrokerMps.WeightsOneToTwoHoldBetweenAClientAndAProcessOutsideMps, 0.332 / 0.657 without.)
  if (clockNs(CLOCK_REALTIME) > r.at + kMissedInstant) {
    writeAnswer(r, probe::kProbeRunFailed, "missed the round's instant", nullptr, 0, 0);
    return;
  }
  probe::ProbeBudgets b;
  const uint64_t budget = uint64_t{std::clamp<uint32_t>(r.budgetUs, 20, 10'000)} * 1000;
  b.smNs = budget;
  b.memNs = budget * 3 / 4;
  b.tickNs = budget / 2;
  probe::RoundRecords rec;
  tRoundLaunches = 0;
  tFirstLaunchWaited = false;
  if (const probe::ProbeError e = dp.runner->runRound(dp.stream, r.what & probe::kRunAll, b, &rec); e) {
    writeAnswer(r, probe::kProbeRunFailed, e.message(), nullptr, 0, 0);
    return;
  }
  writeAnswer(r, probe::kProbeOk, "", &rec, deviceSms(dp.runner->smCount()), dp.runner->options().workPerStep,
              (idleAtInstant ? probe::kAnswerIdleAtInstant : 0) |
                  (tFirstLaunchWaited || waitedAtGateAt(r.ordinal, r.at) ? probe::kAnswerFirstLaunchWaitedAtGate : 0));
}

// runRequest under gRoundMu (which it lets go of while it waits for the round's instant).
void runRequestLocked(const Request& r) {
  pthread_mutex_lock(&gRoundMu);
  runRequest(r);
  pthread_mutex_unlock(&gRoundMu);
}

void* probeMain(void*) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  gFatbin = new std::string(fatbinPath());
  for (;;) {
    pthread_mutex_lock(&gMu);
    while (gCount == 0) pthread_cond_wait(&gCv, &gMu);
    const Request r = gQueue[gHead];
    gHead = (gHead + 1) % kQueue;
    --gCount;
    pthread_mutex_unlock(&gMu);
    tProbeOrdinal = r.ordinal;
    runRequestLocked(r);
  }
  return nullptr;
}

}  // namespace

// The probes' launches (probe_driver.h sends the runner's cuLaunchKernel here): like the tenant's
// kernels they wait for its gate where the broker paces the device (a futex wait until the
// tenant's turn, which a tenant without work never gets; 3 s without the broker's heartbeat and
// the gate is taken for gone; given up when a ProbeContextGuard waits or the process exits), unless this process's
// kernels are still in flight (the tenant's turn draining: its work is on the device), then go straight to the
// driver, neither metered nor counted in flight, so that a probe of the tenant holding the device
// starts within the launch latency instead of behind its own in-flight kernels.
CUresult probeLaunch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                     unsigned shared, CUstream s, void** params, void** extra) noexcept {
  RealDriver& d = realDriver();
  if (!d.p_cuLaunchKernel) return CUDA_ERROR_NOT_SUPPORTED;
  const int o = tProbeOrdinal;
  LedgerComputeDevice* w = o >= 0 && o < kMaxDevices ? state().devices[o].compute : nullptr;
  const ShimState& st = state();
  const LedgerComputeSlot* own =
      w != nullptr && st.ledger->slot() >= 0 ? st.ledger->computeSlotAt(st.devices[o].ledgerIndex, st.ledger->slot()) : nullptr;
  const bool first = tRoundLaunches++ == 0;
  uint64_t waitStart = 0;  // CLOCK_REALTIME when this launch began waiting at the gate; 0: it did not
  // Every wait is kept, also one given up (a request queued behind it waited at the gate too).
  const auto noteWait = [&] {
    if (waitStart != 0) tGateWaits[tGateWaitCount++ % (3 * kQueue)] = {o, waitStart, clockNs(CLOCK_REALTIME)};
  };
  if (w != nullptr) {
    uint32_t epoch = w->gate_epoch.load(std::memory_order_acquire);
    uint64_t still = clockNs(CLOCK_MONOTONIC);
    for (;;) {
      // A release or reset of the context waits for this round: give up rather than wait for a
      // turn the tenant may never get (it may have no work); so at exit.
      if (gGuardsWaiting.load(std::memory_order_acquire) > 0 || gExiting.load(std::memory_order_acquire)) {
        noteWait();
        return CUDA_ERROR_NOT_PERMITTED;
      }
      if (!(w->mode.load(std::memory_order_acquire) & kComputePaced)) break;
      const uint32_t gate = w->gate.load(std::memory_order_seq_cst);
      if (gate == kGateOpen) break;
      // The process's own kernels still on the device (its turn draining): the tenant holds the
      // device, and the probe, on the context's highest-priority stream, runs beside them.
      if (own != nullptr && own->inflight.load(std::memory_order_acquire) != 0) break;
      const uint32_t e = w->gate_epoch.load(std::memory_order_acquire);
      const uint64_t now = clockNs(CLOCK_MONOTONIC);
      if (e != epoch) {
        epoch = e;
        still = now;
      } else if (now - still > 3'000'000'000u) {
        break;  // the broker is gone: as the launch hook, run unpaced
      }
      // The tenant does not hold the device: whenever the gate opens, this start is a wait.
      if (first) tFirstLaunchWaited = true;
      if (waitStart == 0) waitStart = clockNs(CLOCK_REALTIME);
      futexShared(&w->gate, gate, 50'000'000);
    }
  }
  noteWait();
  return d.p_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, s, params, extra);
}

void probeCheck(int ordinal, LedgerComputeDevice* w, int slot) noexcept {
  if (ordinal < 0 || ordinal >= kMaxDevices || w == nullptr || slot < 0) return;
  const uint32_t seq = w->probe_seq.load(std::memory_order_acquire);
  if (seq == gSeen[ordinal]) return;
  gSeen[ordinal] = seq;
  if (seq == 0 || w->probe_slot.load(std::memory_order_relaxed) != static_cast<uint32_t>(slot)) return;
  Request r;
  r.ordinal = ordinal;
  r.seq = seq;
  r.entry = static_cast<uint32_t>(state().devices[ordinal].ledgerIndex);
  r.at = w->probe_at_ns.load(std::memory_order_relaxed);
  r.what = w->probe_what.load(std::memory_order_relaxed);
  r.budgetUs = w->probe_budget_us.load(std::memory_order_relaxed);
  pthread_mutex_lock(&gMu);
  if (gCount == kQueue) {
    gHead = (gHead + 1) % kQueue;
    --gCount;
  }
  gQueue[(gHead + gCount) % kQueue] = r;
  ++gCount;
  if (!gStarted) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    static bool atexitSet = false;
    if (!atexitSet) atexitSet = std::atexit([] { gExiting.store(true, std::memory_order_release); }) == 0;
    gStarted = pthread_create(&t, &attr, probeMain, nullptr) == 0;
    pthread_attr_destroy(&attr);
    if (!gStarted) logLine(LogLevel::kWarn, "cushare: cannot start the probe thread: probe rounds not answered");
  }
  pthread_cond_signal(&gCv);
  pthread_mutex_unlock(&gMu);
}

ProbeContextGuard::ProbeContextGuard(CUdevice dev) noexcept : dev_(dev) {
  gGuardsWaiting.fetch_add(1, std::memory_order_acq_rel);
  pthread_mutex_lock(&gRoundMu);
}

ProbeContextGuard::~ProbeContextGuard() {
  pthread_mutex_unlock(&gRoundMu);
  gGuardsWaiting.fetch_sub(1, std::memory_order_acq_rel);
}

void ProbeContextGuard::letGoBeforeReset() noexcept {
  for (DeviceProbe& dp : gDevices)
    if (dp.retained && dp.device == dev_) letGo(dp);
}

void ProbeContextGuard::afterRelease(CUresult programsRelease) noexcept {
  if (programsRelease != CUDA_SUCCESS) return;
  RealDriver& d = realDriver();
  for (DeviceProbe& dp : gDevices) {
    if (!dp.retained || dp.device != dev_) continue;
    if (!d.p_cuDevicePrimaryCtxRelease_v2 || !d.p_cuDevicePrimaryCtxGetState || !d.p_cuDevicePrimaryCtxRetain) {
      letGo(dp);  // cannot look: free it all while the context surely lives (the program's call is done)
      continue;
    }
    d.p_cuDevicePrimaryCtxRelease_v2(dev_);  // the thread's reference
    unsigned flags = 0;
    int active = 0;
    CUcontext ctx = nullptr;
    if (d.p_cuDevicePrimaryCtxGetState(dev_, &flags, &active) == CUDA_SUCCESS && active &&
        d.p_cuDevicePrimaryCtxRetain(&ctx, dev_) == CUDA_SUCCESS) {
      // The program still holds it: the reference back, the runner kept. Unless another thread of
      // the program retained a new context between the last release and the look (a retain is not
      // hooked): the runner's memory is then gone (its buffer's id is another's or none), so it is
      // forgotten, and the reference to the new context dropped (the next round loads afresh).
      if (!dp.runner || dp.runner->ownsItsMemory()) continue;
      d.p_cuDevicePrimaryCtxRelease_v2(dev_);
    }
    // Gone (with the thread's reference, or under it): everything of the runner died with it.
    if (dp.runner) dp.runner->abandon();
    dp = DeviceProbe{};
  }
}

void probeResetAfterFork() noexcept {
  // The thread, its runners and the parent's requests are not the child's.
  gMu = PTHREAD_MUTEX_INITIALIZER;
  gRoundMu = PTHREAD_MUTEX_INITIALIZER;
  gGuardsWaiting.store(0, std::memory_order_relaxed);
  gCv = PTHREAD_COND_INITIALIZER;
  gStarted = false;
  gHead = gCount = 0;
  for (int i = 0; i < kMaxDevices; ++i) {
    (void)gDevices[i].runner.release();  // its memory and module are the parent's context's
    gDevices[i] = DeviceProbe{};
  }
  gFile = -1;
}

}  // namespace cushare::shim
