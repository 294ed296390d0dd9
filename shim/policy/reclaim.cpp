// Plain bursts (docs/memory-elasticity.md), the shim's two sides.
//
// A guaranteed allocation: when the driver refuses an ordinary allocation that the tenant's
// ledger granted (it is within its guarantee) while other tenants hold plain bursts in the
// device's memory group (the limits file's plain_mask), the shim posts what it waits for in the
// ledger (want_bytes, want_ns), keeps its reservation, and retries every millisecond for at most
// the broker's reclaim_wait_ms, refreshing the post every 10 ms; the broker asks the bursters to
// give back (below).
//
// A burster: cushare_reclaim_fd() (include/cushare/reclaim.h) gives the process an eventfd that a
// watcher thread of the shim makes readable whenever the broker changes a reclaim target of one of
// the process's devices (it polls the limits file every 5 ms); cushare_reclaim_target() says the
// target and what the tenant holds there. The process frees what it can (PyTorch:
// torch.cuda.empty_cache()) and reads the eventfd to rearm it. Nothing is taken from a process:
// one that does not give back is refused allocations above its guarantee past the deadline.
#include <fcntl.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <new>
#include <thread>

#include "interpose/real.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {
namespace {

uint64_t monotonicNs() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

const LimitsFile* boundLimits(const DeviceView& v) noexcept {
  const ShimState& s = state();
  if (!s.brokerManaged) return nullptr;
  const LimitsFile* f = s.limits.load(std::memory_order_acquire);
  if (f == nullptr || v.limitWord.load(std::memory_order_acquire) != f->limitWord(v.ledgerIndex)) return nullptr;
  return f;
}

std::atomic<uint32_t> gWaitsSaid{0};

}  // namespace

// The tenant's processes share one waiting word per device: a post keeps a larger wait another
// process refreshed within the last 20 ms (the broker sees the largest of them), and a waiter that
// is done clears the word only if nobody posted after it. Returns the time it wrote.
uint64_t postWant(int e, uint64_t bytes) noexcept {
  Ledger& l = *state().ledger;
  const uint64_t now = monotonicNs();
  const uint64_t theirs = l.wantBytes(e), theirNs = l.wantNs(e);
  const bool fresh = theirNs <= now && now - theirNs < 20000000ull;
  l.postWant(e, fresh && theirs > bytes ? theirs : bytes, now);
  return now;
}

bool reclaimWaitBegin(int ordinal, uint64_t bytes, uint64_t* deadlineNs, uint64_t* postedNs) noexcept {
  const DeviceView& v = state().devices[ordinal];
  const LimitsFile* f = boundLimits(v);
  if (f == nullptr || !f->plainBurstsOn(v.ledgerIndex)) return false;
  const uint64_t waitMs = f->reclaimWaitMs();
  if (waitMs == 0) return false;
  // Only when the device itself is what refused: not a pool at its own maximum size, not a
  // request the device would have room for (fragmentation, an error of another kind).
  // The current context's device must be the allocation's (cuMemCreate and pools name theirs).
  size_t free = 0, total = 0;
  CUdevice cur = -1;
  const RealDriver& d = realDriver();
  if (d.p_cuCtxGetDevice && d.p_cuCtxGetDevice(&cur) == CUDA_SUCCESS && cur == ordinal && d.p_cuMemGetInfo_v2 &&
      d.p_cuMemGetInfo_v2(&free, &total) == CUDA_SUCCESS && free >= bytes)
    return false;
  *postedNs = postWant(v.ledgerIndex, bytes);
  *deadlineNs = *postedNs + waitMs * 1000000ull;
  return true;
}

uint64_t reclaimWaitRefresh(int ordinal, uint64_t bytes) noexcept {
  return postWant(state().devices[ordinal].ledgerIndex, bytes);
}

void reclaimWaitEnd(int ordinal, uint64_t bytes, bool granted, uint64_t startedNs, uint64_t postedNs) noexcept {
  const ShimState& s = state();
  const int e = s.devices[ordinal].ledgerIndex;
  if (s.ledger->wantNs(e) == postedNs) s.ledger->postWant(e, 0, monotonicNs());  // else another waits
  if (granted && gWaitsSaid.fetch_add(1, std::memory_order_relaxed) < 8)
    logLine(LogLevel::kInfo,
            "tenant %s device %d (%s): allocation of %llu bytes within its guarantee granted after %llu ms, once "
            "other tenants' plain bursts were given back",
            s.config.tenant.c_str(), ordinal, s.devices[ordinal].uuid, static_cast<unsigned long long>(bytes),
            static_cast<unsigned long long>((monotonicNs() - startedNs) / 1000000));
  if (!granted && gWaitsSaid.fetch_add(1, std::memory_order_relaxed) < 8)
    logLine(LogLevel::kWarn,
            "tenant %s device %d (%s): allocation of %llu bytes within its guarantee waited %llu ms for other "
            "tenants' plain bursts to be given back, in vain: out of memory (docs/memory-elasticity.md)",
            s.config.tenant.c_str(), ordinal, s.devices[ordinal].uuid, static_cast<unsigned long long>(bytes),
            static_cast<unsigned long long>((monotonicNs() - startedNs) / 1000000));
}

uint64_t reclaimNowNs() noexcept { return monotonicNs(); }

namespace {

// The eventfd the watcher writes is the shim's own; each cushare_reclaim_fd call hands out a
// duplicate, so a program closing its descriptor (a garbage-collected wrapper) never makes the
// watcher write into whatever reuses the number. A forked child has no watcher: it starts afresh.
struct Watcher {
  std::mutex mu;
  int fd = -1;
  uint64_t seen[kMaxDevices] = {};
};
Watcher& watcher() {
  static Watcher* w = new Watcher;  // leaked: its thread runs until exit
  return *w;
}

void watch() noexcept {
  Watcher& w = watcher();
  for (;;) {
    if (devicesReady() == CUDA_SUCCESS) {
      const ShimState& s = state();
      bool moved = false;
      for (int i = 0; i < s.deviceCount; ++i) {
        const LimitsFile* f = boundLimits(s.devices[i]);
        if (f == nullptr) continue;
        const uint64_t seq = f->reclaimSeq(s.devices[i].ledgerIndex);
        if (seq != w.seen[i]) {
          w.seen[i] = seq;
          moved = true;
        }
      }
      if (moved) {
        const uint64_t one = 1;
        (void)!::write(w.fd, &one, sizeof one);
      }
    }
    ::usleep(5000);
  }
}

}  // namespace
}  // namespace cushare::shim

using namespace cushare;
using namespace cushare::shim;

extern "C" __attribute__((visibility("default"))) int cushare_reclaim_fd(void) {
  Watcher& w = watcher();
  std::lock_guard<std::mutex> g(w.mu);
  if (w.fd < 0) {
    if (processReady() != CUDA_SUCCESS || !state().brokerManaged) return -1;
    const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0) return -1;
    static const int once = pthread_atfork(nullptr, nullptr, [] {
      Watcher& c = watcher();
      new (&c.mu) std::mutex;  // the parent's may have been held by another thread at the fork
      if (c.fd >= 0) ::close(c.fd);
      c.fd = -1;  // no watcher thread in the child: the next call starts one
    });
    (void)once;
    w.fd = fd;
    // A target set before the call wakes it: what is asked counts as seen only once read.
    try {
      std::thread(watch).detach();
    } catch (...) {
      ::close(fd);
      w.fd = -1;
      return -1;
    }
  }
  return ::fcntl(w.fd, F_DUPFD_CLOEXEC, 0);
}

extern "C" __attribute__((visibility("default"))) int cushare_reclaim_target(int device, unsigned long long* target,
                                                                            unsigned long long* held) {
  if (!target || !held || devicesReady() != CUDA_SUCCESS || device < 0 || device >= state().deviceCount) return -1;
  const DeviceView& v = state().devices[device];
  const LimitsFile* f = boundLimits(v);
  const uint64_t t = f ? f->reclaimTarget(v.ledgerIndex) : kLedgerNoLimit;
  *held = state().ledger->used(v.ledgerIndex);
  *target = t;
  return t == kLedgerNoLimit ? 0 : 1;
}
