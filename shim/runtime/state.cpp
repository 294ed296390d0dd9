// See state.h.
#include "state.h"

#include <cstdlib>
#include <memory>
#include <new>
#include <cstring>
#include <pthread.h>

#include <mutex>
#include <string>

#include "interpose/real.h"
#include "runtime/log.h"

extern char** environ;

namespace cushare::shim {
namespace {

ShimState* gState = nullptr;  // leaked on purpose
std::atomic<int> gProcessPhase{0};  // 0 not run, 1 ok, 2 failed
std::atomic<int> gDevicePhase{0};
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
  if (!loadRealDriver(&err)) {
    failProcess("cushare: " + err);
    return;
  }
  s->ledger = Ledger::open(s->config.ledgerDir, s->config.tenant, &err).release();
  if (!s->ledger) {
    failProcess("cushare: tenant '" + s->config.tenant + "': " + err);
    return;
  }
  gState = owned.release();  // kept for the life of the process (see state.h)
  gProcessPhase.store(1, std::memory_order_release);
}

}  // namespace

ShimState& state() noexcept { return *gState; }

CUresult processReady() noexcept {
  int p = gProcessPhase.load(std::memory_order_acquire);
  if (p == 0) {
    InitLock g;
    if (gProcessPhase.load(std::memory_order_acquire) == 0) runProcessInit();
    p = gProcessPhase.load(std::memory_order_acquire);
  }
  return p == 1 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult devicesReady() noexcept {
  const int p = gDevicePhase.load(std::memory_order_acquire);
  return p == 1 ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
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
  for (int i = 0; i < count; ++i) {
    CUdevice dev;
    CUuuid u;
    if (d.p_cuDeviceGet(&dev, i) != CUDA_SUCCESS || d.p_cuDeviceGetUuid_v2(&u, dev) != CUDA_SUCCESS)
      return fail("cushare: cannot read the UUID of device " + std::to_string(i));
    std::memcpy(uuids[i], u.bytes, 16);
    const std::string str = formatGpuUuid(uuids[i]);
    std::snprintf(s.devices[i].uuid, sizeof s.devices[i].uuid, "%s", str.c_str());
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
    const int idx = s.ledger->deviceIndex(uuids[i], limits[i], &err);
    if (idx < 0) return fail("cushare: tenant '" + s.config.tenant + "': " + err);
    s.devices[i].ledgerIndex = idx;
    s.devices[i].envLimit = limits[i];
    CUSHARE_LOG(LogLevel::kInfo, "tenant %s device %d (%s): limit %llu bytes", s.config.tenant.c_str(), i,
                s.devices[i].uuid, static_cast<unsigned long long>(effectiveLimit(i)));
  }
  s.deviceCount = count;
  gDevicePhase.store(1, std::memory_order_release);
  return CUDA_SUCCESS;
}

uint64_t effectiveLimit(int ordinal) noexcept {
  const DeviceView& v = gState->devices[ordinal];
  const uint64_t ledgerLimit = gState->ledger->limit(v.ledgerIndex);
  return v.envLimit < ledgerLimit ? v.envLimit : ledgerLimit;
}

}  // namespace cushare::shim
