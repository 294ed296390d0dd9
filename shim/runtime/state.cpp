// See state.h.
#include "state.h"

#include <cstdlib>
#include <memory>
#include <new>
#include <cstring>
#include <pthread.h>
#include <unistd.h>

#include <cerrno>

#include <mutex>
#include <string>

#include "interpose/real.h"
#include "runtime/clock.h"
#include "runtime/log.h"
#include "runtime/mps_env.h"

extern char** environ;

namespace cushare::shim {
namespace detail {
ShimState* gState = nullptr;  // leaked on purpose
constinit std::atomic<int> gProcessPhase{0};
constinit std::atomic<int> gDevicePhase{0};
}  // namespace detail
using detail::gDevicePhase;
using detail::gProcessPhase;
using detail::gUnpublished;
using detail::gState;

namespace {
// Constant-initialised: hooks can run before this library's constructors (another library's
// constructor calling CUDA, or cudart resolving entry points early).
pthread_mutex_t gInitMutex = PTHREAD_MUTEX_INITIALIZER;
struct InitLock {
  InitLock() { pthread_mutex_lock(&gInitMutex); }
  ~InitLock() { pthread_mutex_unlock(&gInitMutex); }
};

void failProcess(const std::string& why) {
  logLine(LogLevel::kError, "%s", why.c_str());
  gProcessPhase.store(2, std::memory_order_release);
}

// Standalone, the tenant's first process creates its ledger. In a directory a broker owns, the
// broker has created the ledgers of its tenants; an unknown tenant is refused, or, when the broker
// admits unknown tenants under a profile, creates its ledger with that profile's limits (the
// broker adopts it).
bool openLedger(ShimState* s, std::string* err) {
  const std::string& dir = s->config.ledgerDir;
  const int host = readHostSegment(dir, &s->host, err);
  if (host < 0) return false;
  if (host == 0) {
    if (s->config.requireBroker) {
      *err = "CUSHARE_REQUIRE_BROKER=1, but no broker owns the ledger directory " + dir +
             " (no host.segment there): mount the broker's ledger directory into the container, "
             "with CUSHARE_LEDGER_DIR exactly as `cushare env` printed it";
      return false;
    }
    LedgerOpenOptions o;
    o.renewLimits = true;  // standalone: the environment sets the limits, per session
    s->ledger = Ledger::open(dir, s->config.tenant, o, err).release();
    return s->ledger != nullptr;
  }
  s->brokerManaged = true;
  if (!s->host.profileForUnknown) {
    const std::string path = dir + "/" + s->config.tenant + ".ledger";
    if (::access(path.c_str(), F_OK) != 0 && errno == ENOENT) {
      *err = "not a tenant of this host's broker (ledger directory " + dir +
             ", unknown_tenants: refuse); ask the operator to add it to the broker's configuration";
      return false;
    }
  }
  LedgerOpenOptions o;
  o.createDir = false;
  o.createFile = s->host.profileForUnknown;
  s->ledger = Ledger::open(dir, s->config.tenant, o, err).release();
  return s->ledger != nullptr;
}

void runProcessInit() {
  std::unique_ptr<ShimState> owned(new (std::nothrow) ShimState);
  if (!owned) {
    failProcess("cushare: out of memory at start-up");
    return;
  }
  ShimState* s = owned.get();
  std::string err;
  if (!loadShimConfig([](const char* n) { return std::getenv(n); }, &s->config, &err)) {
    failProcess(err + " (the shim refuses to run unlimited; fix or unset the variable)");
    return;
  }
  gLogLevel.store(static_cast<int>(s->config.logLevel), std::memory_order_relaxed);
  // A misspelt variable would silently mean "no limit": refuse it.
  for (char** e = environ; e && *e; ++e) {
    if (std::strncmp(*e, "CUSHARE_", 8) != 0) continue;
    const char* eq = std::strchr(*e, '=');
    std::string_view name(*e, eq ? static_cast<size_t>(eq - *e) : std::strlen(*e));
    if (!isShimVariable(name) && name != "CUSHARE_SOCKET") {
      failProcess("cushare: unknown variable " + std::string(name) + " in the environment (misspelt?)");
      return;
    }
  }
  // Normally done by the constructor already; here when a hook ran first. Before the driver is
  // loaded: it reads CUDA_MPS_* at cuInit (mps_env.h).
  setUpMpsEnv();
  if (!loadRealDriver(&err)) {
    failProcess("cushare: " + err);
    return;
  }
  if (!openLedger(s, &err)) {
    failProcess("cushare: tenant '" + s->config.tenant + "': " + err);
    return;
  }
  // MPS is on but this process could not be made a client with its tenant's settings: refused,
  // never a client at the server's defaults. After openLedger, so that a process of no tenant
  // hears that first.
  if (const std::string& mps = mpsEnvError(); !mps.empty()) {
    failProcess(mps);
    return;
  }
  gState = owned.release();  // kept for the life of the process (see state.h)
  gProcessPhase.store(1, std::memory_order_release);
}

}  // namespace

CUresult detail::runProcessPhase() noexcept {
  if (gProcessPhase.load(std::memory_order_acquire) == 0) {  // a failed phase 1 takes no lock
    InitLock g;
    if (gProcessPhase.load(std::memory_order_acquire) == 0) runProcessInit();
  }
  return gProcessPhase.load(std::memory_order_acquire) == 1 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult prepareDriverInit() noexcept {
  InitLock g;  // one thread at a time sets the variables (the program's own threads aside)
  std::string err;
  if (reapplyMpsEnv(&err)) return CUDA_SUCCESS;
  logLine(LogLevel::kError, "%s", err.c_str());
  return CUDA_ERROR_NOT_INITIALIZED;
}

namespace {

constexpr int kBrokerAdoptWaitMs = 2000;

uint64_t monotonicMs() { return nowNs() / 1'000'000u; }

constinit const std::atomic<uint64_t> kNoBudget{0};  // the limit of a device the broker does not know

// Under a broker: the limits file's entry for this device (its index into *e) and its limit word,
// or null. wait: for the broker to publish it (it does when it sees the ledger or the new entry;
// at once, it watches the directory), at most kBrokerAdoptWaitMs for all of the process's devices
// together. A limits file that is refused is logged once and never waited for. Caller holds the
// init lock.
const std::atomic<uint64_t>* publishedLimit(ShimState& s, const uint8_t uuid[16], bool wait, int* e) {
  static uint64_t waitedMs = 0;
  static bool refused = false;
  const uint64_t start = monotonicMs();
  for (;;) {
    if (s.limits.load(std::memory_order_acquire) == nullptr && !refused) {
      std::unique_ptr<LimitsFile> f;
      std::string err;
      const int r = LimitsFile::openForShim(s.config.ledgerDir, s.ledger->fileIno(), s.config.tenant,
                                            s.host.ownerUid, &f, &err);
      if (r > 0) s.limits.store(f.release(), std::memory_order_release);  // kept for the life of the process
      if (r < 0) {
        refused = true;
        logLine(LogLevel::kError, "cushare: tenant %s: %s; nothing can be allocated", s.config.tenant.c_str(),
                err.c_str());
      }
    }
    if (const LimitsFile* f = s.limits.load(std::memory_order_acquire))
      if (const int found = f->find(uuid); found >= 0) {
        *e = found;
        return f->limitWord(found);
      }
    const uint64_t spent = waitedMs + (monotonicMs() - start);
    if (!wait || refused || spent >= kBrokerAdoptWaitMs) break;
    ::usleep(1000);
  }
  waitedMs += monotonicMs() - start;
  return nullptr;
}

// The ledger entry of the device with this UUID, and its limits, into *v (label names the device
// in messages: "device 0", "NVML device GPU-..."). Standalone, the entry's limit is the
// session's (see LedgerOpenOptions::renewLimits): this process's environment sets it if it is
// the first of the session to get here; a higher limit asked for while the tenant's other
// processes run is refused with a warning, a lower one applies to this process (effectiveLimit).
// With a broker, the entry and its limit are those the broker published in the ledger's limits
// file (publishedLimit); a device entry the broker did not make yet (an unknown tenant's) is added
// to the ledger at zero: only the broker knows whether the name already has a budget in use (a
// file removed and created again while the old one's processes run), and it publishes the entry
// when it sees it (at once: it watches the directory). A process waits for that at most
// kBrokerAdoptWaitMs in all. Caller holds the init lock.
bool resolveDevice(ShimState& s, const uint8_t uuid[16], uint64_t envLimit, const std::string& label,
                   DeviceView* v, std::string* err) {
  int idx;
  const std::atomic<uint64_t>* word = nullptr;
  if (s.brokerManaged) {
    // The entry and its limit are the broker's word (its limits file), not the ledger's: the
    // tenant can rewrite its ledger's limits and UUIDs, and what it allocated before the broker
    // put them back would stay. A device of the host without a published entry yet gets one in
    // the ledger (at 0), which the broker publishes when it sees it.
    const HostDevice* hd = s.host.device(uuid);
    if (hd == nullptr)
      logLine(LogLevel::kWarn, "cushare: %s (%s) is not known to this host's broker: nothing can be allocated on it",
              label.c_str(), v->uuid[0] ? v->uuid : formatGpuUuid(uuid).c_str());
    int published = -1;
    if (hd != nullptr) word = publishedLimit(s, uuid, /*wait=*/false, &published);
    idx = word != nullptr ? published : s.ledger->deviceIndex(uuid, 0, err);
    if (word == nullptr && idx >= 0 && hd != nullptr) {
      word = publishedLimit(s, uuid, /*wait=*/true, &published);
      if (word != nullptr) {
        idx = published;
      } else {
        word = &gUnpublished;
        logLine(LogLevel::kWarn,
                "cushare: tenant %s %s: the broker has not published this device's limit within %d ms; "
                "allocations are denied until it does", s.config.tenant.c_str(), label.c_str(), kBrokerAdoptWaitMs);
      }
    }
    if (word == nullptr) word = &kNoBudget;
  } else {
    idx = s.ledger->sessionDeviceIndex(uuid, envLimit, err);
    if (idx >= 0) word = s.ledger->limitWord(idx);
  }
  if (idx < 0) {
    *err = "cushare: tenant '" + s.config.tenant + "': " + *err;
    return false;
  }
  v->ledgerIndex = idx;
  v->limitWord.store(word, std::memory_order_release);
  v->envLimit = envLimit;
  v->compute = s.ledger->compute(idx);
  if (v->uuid[0] == '\0') std::snprintf(v->uuid, sizeof v->uuid, "%s", formatGpuUuid(uuid).c_str());  // else as spelled
  const uint64_t inForce = s.ledger->limit(idx);
  if (!s.brokerManaged && envLimit > inForce) {
    const std::string asked = envLimit == kUnlimited ? std::string("no limit") : std::to_string(envLimit) + " bytes";
    logLine(LogLevel::kWarn,
            "cushare: tenant %s %s: CUSHARE_MEMORY_LIMIT asks for %s, but the tenant's running processes "
            "use a limit of %llu bytes: refused, %llu bytes apply until every process of the tenant has exited",
            s.config.tenant.c_str(), label.c_str(), asked.c_str(), static_cast<unsigned long long>(inForce),
            static_cast<unsigned long long>(inForce));
  }
  return true;
}

std::atomic<bool> gNvmlViewFailed{false};

}  // namespace

constinit const std::atomic<uint64_t> detail::gUnpublished{0};

uint64_t detail::unpublishedLimit(const DeviceView& cv) noexcept {
  // Opening the limits file costs system calls: at most one try a millisecond while it is not
  // there. Once it is mapped, a look is a scan of its entries.
  static std::atomic<uint64_t> nextOpen{0};
  const uint64_t now = nowNs();
  if (gState->limits.load(std::memory_order_acquire) == nullptr) {
    if (now < nextOpen.load(std::memory_order_relaxed)) return 0;
    nextOpen.store(now + 1'000'000u, std::memory_order_relaxed);
  }
  // Never waits for the init lock: its holder may be asking for this very limit (a log line).
  if (pthread_mutex_trylock(&gInitMutex) != 0) return 0;
  auto& v = const_cast<DeviceView&>(cv);
  const std::atomic<uint64_t>* word = v.limitWord.load(std::memory_order_acquire);
  uint8_t uuid[16];
  if (word == &gUnpublished && parseGpuUuidBytes(v.uuid, uuid)) {
    int e = -1;
    const std::atomic<uint64_t>* found = publishedLimit(*gState, uuid, /*wait=*/false, &e);
    // Only the entry this process counts in: another index is not what its reservations sum.
    if (found != nullptr && e == v.ledgerIndex) {
      v.limitWord.store(found, std::memory_order_release);
      word = found;
      logLine(LogLevel::kInfo, "cushare: tenant %s device %s: the broker has published its limit, %llu bytes",
              gState->config.tenant.c_str(), v.uuid, static_cast<unsigned long long>(found->load()));
    }
  }
  pthread_mutex_unlock(&gInitMutex);
  return word->load(std::memory_order_acquire);
}

const DeviceView* nvmlDeviceView(const char* uuid) noexcept {
  NvmlDevices& n = gState->nvml;
  const auto find = [&]() -> const DeviceView* {
    const int count = n.count.load(std::memory_order_acquire);
    for (int i = 0; i < count; ++i)
      if (std::strcmp(n.devices[i].uuid, uuid) == 0) return &n.devices[i];
    return nullptr;
  };
  if (const DeviceView* v = find()) return v;
  if (gNvmlViewFailed.load(std::memory_order_acquire)) return nullptr;
  InitLock g;
  if (const DeviceView* v = find()) return v;
  if (gNvmlViewFailed.load(std::memory_order_relaxed)) return nullptr;
  ShimState& s = *gState;
  std::string err;
  uint8_t bytes[16];
  uint64_t envLimit = kUnlimited;
  const int count = n.count.load(std::memory_order_relaxed);
  DeviceView* v = count < kMaxDevices ? &n.devices[count] : nullptr;
  if (v == nullptr) {
    err = "cushare: more than 64 devices are not supported";
  } else if (!parseGpuUuidBytes(uuid, bytes)) {
    err = std::string("cushare: NVML reports a device with an unreadable UUID '") + uuid + "'";
  } else if (memoryLimitOfUuid(s.config.memory, uuid, &envLimit, &err) &&
             resolveDevice(s, bytes, envLimit, std::string("NVML device ") + uuid, v, &err)) {
    n.count.store(count + 1, std::memory_order_release);
    CUSHARE_LOG(LogLevel::kInfo, "tenant %s NVML device %s: limit %llu bytes", s.config.tenant.c_str(), uuid,
                static_cast<unsigned long long>(effectiveLimit(*v)));
    return v;
  }
  logLine(LogLevel::kError, "%s (NVML memory queries fail)", err.c_str());
  gNvmlViewFailed.store(true, std::memory_order_release);
  return nullptr;
}

CUresult initDevices() noexcept {
  if (CUresult r = processReady(); r != CUDA_SUCCESS) return r;
  InitLock g;
  if (int p = gDevicePhase.load(std::memory_order_acquire); p != 0) return p == 1 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
  ShimState& s = *gState;
  RealDriver& d = realDriver();
  auto fail = [](const std::string& why) {
    logLine(LogLevel::kError, "%s", why.c_str());
    gDevicePhase.store(2, std::memory_order_release);
    return CUDA_ERROR_NOT_INITIALIZED;
  };
  int count = 0;
  if (d.p_cuDeviceGetCount(&count) != CUDA_SUCCESS || count < 0) return fail("cushare: cannot count devices");
  if (count > kMaxDevices) return fail("cushare: more than 64 devices are not supported");
  unsigned char uuids[kMaxDevices][16];
  std::string spelled[kMaxDevices];
  for (int i = 0; i < count; ++i) {
    CUdevice dev;
    CUuuid u, first;
    if (d.p_cuDeviceGet(&dev, i) != CUDA_SUCCESS || d.p_cuDeviceGetUuid_v2(&u, dev) != CUDA_SUCCESS)
      return fail("cushare: cannot read the UUID of device " + std::to_string(i));
    std::memcpy(uuids[i], u.bytes, 16);
    // A MIG device: _v2 gives its own UUID, the first ABI its GPU's. Only the spelling ("MIG-") in
    // messages and NVML's matching follows from it; devices are matched by their 16 bytes.
    const bool mig = d.p_cuDeviceGetUuid && d.p_cuDeviceGetUuid(&first, dev) == CUDA_SUCCESS &&
                     std::memcmp(first.bytes, u.bytes, 16) != 0;
    spelled[i] = formatDeviceUuid(uuids[i], mig);
    std::snprintf(s.devices[i].uuid, sizeof s.devices[i].uuid, "%s", spelled[i].c_str());
    // Whether the driver can evict managed memory here (Linux, Pascal or newer): else it is as
    // fixed as any, and a bursting tenant may not have more of it than its guarantee.
    int concurrent = 0;
    s.devices[i].managedEvictable =
        d.p_cuDeviceGetAttribute &&
        d.p_cuDeviceGetAttribute(&concurrent, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, dev) == CUDA_SUCCESS &&
        concurrent != 0;
  }
  std::vector<uint64_t> limits;
  std::string err;
  if (!resolveMemoryLimits(
          s.config.memory, count,
          [&](int ordinal, std::string* out) {
            *out = s.devices[ordinal].uuid;
            return true;
          },
          &limits, &err))
    return fail(err);
  for (int i = 0; i < count; ++i) {
    if (!resolveDevice(s, uuids[i], limits[i], "device " + std::to_string(i), &s.devices[i], &err)) return fail(err);
    CUSHARE_LOG(LogLevel::kInfo, "tenant %s device %d (%s): limit %llu bytes", s.config.tenant.c_str(), i,
                s.devices[i].uuid, static_cast<unsigned long long>(effectiveLimit(i)));
  }
  s.deviceCount = count;
  gDevicePhase.store(1, std::memory_order_release);
  return CUDA_SUCCESS;
}

}  // namespace cushare::shim
