// See mps_env.h.
#include "runtime/mps_env.h"

#include <pthread.h>

#include <cstdlib>
#include <new>

#include "cushare/mps_settings.h"
#include "cushare/shim_config.h"
#include "runtime/log.h"

namespace cushare::shim {
namespace {

pthread_once_t gOnce = PTHREAD_ONCE_INIT;
std::string* gError = nullptr;  // leaked on purpose (read during exit teardown)
bool gFailedWithoutMemory = false;
bool gClient = false;

void fail(const std::string& why) {
  gError = new (std::nothrow) std::string(why);
  gFailedWithoutMemory = gError == nullptr;
}

void run() {
  static const auto env = [](const char* n) { return std::getenv(n); };
  ShimConfig config;
  std::string err;
  // A bad CUSHARE_* variable fails phase 1 with its own message; nothing to add here.
  if (!loadShimConfig(env, &config, &err)) return;
  gLogLevel.store(static_cast<int>(config.logLevel), std::memory_order_relaxed);
  MpsHostSettings host;
  const int h = readMpsHost(config.ledgerDir, &host, &err);
  if (h == 0) return;  // MPS is off (or no broker owns the directory)
  if (h < 0) return fail("cushare: the broker's MPS settings cannot be used: " + err);
  MpsTenantSettings tenant;
  const int t = readMpsTenant(config.ledgerDir, config.tenant, &tenant, &err);
  if (t < 0) return fail("cushare: tenant '" + config.tenant + "': its MPS settings cannot be used: " + err);
  if (t == 0) {
    if (!host.unknown)  // phase 1 refuses the process (not a tenant), or the broker is writing the file
      return fail("cushare: tenant '" + config.tenant + "': MPS is on but the broker has published no MPS settings "
                  "for this tenant (" + config.ledgerDir + "/" + config.tenant + kMpsTenantSuffix + ")");
    tenant = *host.unknown;
  }
  MpsClientEnv e;
  if (!mpsClientEnv(host, tenant, config, env, &e, &err)) return fail(err);
  bool ok = ::setenv("CUDA_MPS_PIPE_DIRECTORY", e.pipeDir.c_str(), 1) == 0 &&
            ::setenv("CUDA_MPS_CLIENT_PRIORITY", e.priority.c_str(), 1) == 0;
  if (ok && !e.threads.empty()) ok = ::setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", e.threads.c_str(), 1) == 0;
  if (ok && !e.pinnedMem.empty()) ok = ::setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", e.pinnedMem.c_str(), 1) == 0;
  if (!ok) return fail("cushare: cannot set the MPS client environment (out of memory)");
  gClient = true;
  CUSHARE_LOG(LogLevel::kInfo, "tenant %s: MPS client of %s, active threads %s%%, priority %s, pinned memory %s",
              config.tenant.c_str(), e.pipeDir.c_str(), e.threads.empty() ? "100" : e.threads.c_str(),
              e.priority.c_str(), e.pinnedMem.empty() ? "unlimited" : e.pinnedMem.c_str());
}

// Before main: no other thread of the program exists yet (see mps_env.h).
__attribute__((constructor)) void atLoad() { setUpMpsEnv(); }

}  // namespace

void setUpMpsEnv() noexcept { pthread_once(&gOnce, [] { run(); }); }

bool mpsClient() noexcept {
  setUpMpsEnv();
  return gClient;
}

const std::string& mpsEnvError() noexcept {
  static const std::string kOutOfMemory = "cushare: out of memory while setting up the MPS client";
  static const std::string kNone;
  if (gFailedWithoutMemory) return kOutOfMemory;
  return gError == nullptr ? kNone : *gError;
}

}  // namespace cushare::shim
