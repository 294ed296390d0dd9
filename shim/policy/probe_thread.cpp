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
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
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
Request gQueue[kMaxDevices];  // at most one waiting per device (a newer one replaces it)
bool gQueued[kMaxDevices] = {};
bool gStarted = false;
uint32_t gSeen[kMaxDevices] = {};  // the pacer's last seen probe_seq per device (under the pacer's lock)

// Per device, on the probe thread only.
struct DeviceProbe {
  std::unique_ptr<probe::ProbeRunner> runner;
  CUstream stream = nullptr;
  bool failed = false;  // loading failed: every later request answered with the same status
  int32_t status = probe::kProbeOk;
  std::string error;
};
DeviceProbe gDevices[kMaxDevices];
int gFile = -1;  // the tenant's probe file

constexpr uint64_t kMissedInstant = 50'000'000;  // later than this past the instant: not run
constexpr uint64_t kMemBuffer = uint64_t{32} << 20;

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

void writeAnswer(const Request& r, int32_t status, const std::string& error, const probe::RoundRecords* rec,
                 uint32_t smCount, uint32_t workPerStep) {
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
  probe::ProbeFileHeader h{};
  h.magic = probe::kProbeFileMagic;
  h.version = probe::kProbeFileVersion;
  h.max_records = probe::kProbeFileMaxRecords;
  h.entry = r.entry;
  h.status = status;
  h.sm_count = smCount;
  h.at_ns = r.at;
  std::snprintf(h.error, sizeof h.error, "%s", error.c_str());
  uint32_t next = 0;
  if (rec != nullptr && status == probe::kProbeOk) {
    const probe::ProbeRun* runs[3] = {&rec->tick, &rec->sm, &rec->mem};
    for (int i = 0; i < 3; ++i) {
      const probe::ProbeRun& run = *runs[i];
      if (run.blocks == 0) continue;
      if (run.records.size() != run.blocks || run.blocks > probe::kProbeFileMaxRecords - next) {
        h.status = probe::kProbeTooManyRecords;
        std::snprintf(h.error, sizeof h.error, "%u blocks do not fit the probe file", run.blocks);
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
      const off_t at = static_cast<off_t>(probe::kProbeFileRecordsOffset + size_t{next} * sizeof(probe::BlockRecord));
      if (pwrite(gFile, run.records.data(), bytes, at) != static_cast<ssize_t>(bytes)) return;
      next += run.blocks;
    }
  }
  h.done_ns = clockNs(CLOCK_REALTIME);
  // The header last, seq within it: the broker reads a header only once it names its request.
  (void)pwrite(gFile, &h, sizeof h, 0);
}

void runRequest(const Request& r) {
  DeviceProbe& dp = gDevices[r.ordinal];
  RealDriver& d = realDriver();
  if (!dp.runner && !dp.failed) {
    const std::string path = fatbinPath();
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    if (path.empty()) {
      dp.failed = true;
      dp.status = probe::kProbeNoFatbin;
      dp.error = "probes.fatbin not found beside the shim";
    } else if (!d.p_cuDeviceGet || !d.p_cuDevicePrimaryCtxRetain || !d.p_cuCtxSetCurrent ||
               d.p_cuDeviceGet(&dev, r.ordinal) != CUDA_SUCCESS ||
               d.p_cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || d.p_cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
      dp.failed = true;
      dp.status = probe::kProbeLoadFailed;
      dp.error = "no primary context for the device";
    } else {
      probe::RunnerOptions o;
      o.memBufferBytes = kMemBuffer;
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
  // would read as a wait for the device).
  timespec at{static_cast<time_t>(r.at / 1'000'000'000u), static_cast<long>(r.at % 1'000'000'000u)};
  while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &at, nullptr) == EINTR) {
  }
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
  if (const probe::ProbeError e = dp.runner->runRound(dp.stream, r.what & probe::kRunAll, b, &rec); e) {
    writeAnswer(r, probe::kProbeRunFailed, e.message(), nullptr, 0, 0);
    return;
  }
  writeAnswer(r, probe::kProbeOk, "", &rec, dp.runner->smCount(), dp.runner->options().workPerStep);
}

void* probeMain(void*) {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  for (;;) {
    pthread_mutex_lock(&gMu);
    int found = -1;
    while (found < 0) {
      for (int i = 0; i < kMaxDevices && found < 0; ++i)
        if (gQueued[i]) found = i;
      if (found < 0) pthread_cond_wait(&gCv, &gMu);
    }
    const Request r = gQueue[found];
    gQueued[found] = false;
    pthread_mutex_unlock(&gMu);
    runRequest(r);
  }
  return nullptr;
}

}  // namespace

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
  gQueue[ordinal] = r;
  gQueued[ordinal] = true;
  if (!gStarted) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    gStarted = pthread_create(&t, &attr, probeMain, nullptr) == 0;
    pthread_attr_destroy(&attr);
    if (!gStarted) logLine(LogLevel::kWarn, "cushare: cannot start the probe thread: probe rounds not answered");
  }
  pthread_cond_signal(&gCv);
  pthread_mutex_unlock(&gMu);
}

void probeResetAfterFork() noexcept {
  // The thread, its runners and the parent's requests are not the child's.
  gMu = PTHREAD_MUTEX_INITIALIZER;
  gCv = PTHREAD_COND_INITIALIZER;
  gStarted = false;
  for (int i = 0; i < kMaxDevices; ++i) {
    gQueued[i] = false;
    (void)gDevices[i].runner.release();  // its memory and module are the parent's context's
    gDevices[i] = DeviceProbe{};
  }
  gFile = -1;
}

}  // namespace cushare::shim
