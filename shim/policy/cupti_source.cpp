// CUPTI activity records as the busy-time source (docs/compute.md: measuring GPU time). libcupti
// is loaded at run time, never linked (under a broker only from the file the broker offers,
// standalone by the name "libcupti.so.13"): the shim loads and meters with
// events where it is absent or does not start (simgpu: CUPTI needs the real driver). Started by
// the pacer thread (launch.cpp) when CUSHARE_METERING is cupti or auto, off the launch path; the
// records reach activityBusy().consume from CUPTI's buffer callback (CUPTI's worker thread, or
// the pacer thread while it flushes).
#include "policy/cupti_source.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "interpose/real.h"
#include "runtime/log.h"

namespace cushare::shim {
namespace {

constexpr const char* kCuptiLibrary = "libcupti.so.13";
// Activity buffers: CUPTI asks for one when it has records to write and hands it back full or
// flushed. A flush every millisecond or so hands back mostly empty buffers: a small pool saves
// the allocations.
constexpr size_t kBufferBytes = 64 * 1024;
constexpr size_t kPooled = 16;

ActivityBusy gActivity;
std::atomic<bool> gActive{false};
pthread_mutex_t gPoolMutex = PTHREAD_MUTEX_INITIALIZER;
uint8_t* gPool[kPooled] = {};
size_t gPoolCount = 0;

void CUPTIAPI bufferRequested(uint8_t** buffer, size_t* size, size_t* maxNumRecords) {
  uint8_t* b = nullptr;
  pthread_mutex_lock(&gPoolMutex);
  if (gPoolCount > 0) b = gPool[--gPoolCount];
  pthread_mutex_unlock(&gPoolMutex);
  if (b == nullptr) b = static_cast<uint8_t*>(std::aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, kBufferBytes));
  *buffer = b;
  *size = b != nullptr ? kBufferBytes : 0;  // 0: CUPTI drops the records (counted as dropped)
  *maxNumRecords = 0;                       // as many as fit
}

void CUPTIAPI bufferCompleted(CUcontext ctx, uint32_t streamId, uint8_t* buffer, size_t, size_t valid) {
  const BufferReport rep = gActivity.consume(ctx, streamId, buffer, valid);
  if (rep.dropped != 0) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      logLine(LogLevel::kWarn, "cushare: CUPTI dropped %zu activity records (buffers full): busy time is under-counted",
              rep.dropped);
  }
  if (rep.walkFailed) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      logLine(LogLevel::kWarn, "cushare: an activity buffer ended in an invalid record after %zu records: the rest "
              "was not counted", rep.records);
  }
  if (buffer == nullptr) return;
  pthread_mutex_lock(&gPoolMutex);
  if (gPoolCount < kPooled) {
    gPool[gPoolCount++] = buffer;
    buffer = nullptr;
  }
  pthread_mutex_unlock(&gPoolMutex);
  std::free(buffer);
}

const char* resultText(const CuptiApi& api, CUptiResult r) {
  const char* s = nullptr;
  if (api.getResultString == nullptr || api.getResultString(r, &s) != CUPTI_SUCCESS || s == nullptr)
    return "unknown CUPTI error";
  return s;
}

// The kinds whose records are device work (busy_source.cpp parses the same ones).
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMCPY2, CUPTI_ACTIVITY_KIND_MEMSET};

// The operator's CUPTI, offered by the broker (an absolute path): a regular file of root or the
// broker's user that neither group nor others may write, and no other libcupti.so.13 already in
// the process (a tenant's own, preloaded or opened first, is what the name would bind to).
bool trustedCupti(const char* library, uint32_t brokerUid, char* why, size_t whySize) noexcept {
  struct stat st;
  if (::stat(library, &st) != 0) {
    std::snprintf(why, whySize, "the broker's CUPTI library %s: %s", library, std::strerror(errno));
    return false;
  }
  if (!S_ISREG(st.st_mode)) {
    std::snprintf(why, whySize, "the broker's CUPTI library %s is not a regular file", library);
    return false;
  }
  if (st.st_uid != 0 && st.st_uid != brokerUid) {
    std::snprintf(why, whySize, "the broker's CUPTI library %s belongs to uid %u, neither root nor the broker's user",
                  library, static_cast<unsigned>(st.st_uid));
    return false;
  }
  if ((st.st_mode & 022) != 0) {
    std::snprintf(why, whySize, "the broker's CUPTI library %s is writable by group or others (mode %04o)", library,
                  static_cast<unsigned>(st.st_mode & 07777));
    return false;
  }
  if (void* h = dlopen(kCuptiLibrary, RTLD_NOW | RTLD_NOLOAD)) {
    link_map* lm = nullptr;
    struct stat loaded;
    const bool named = dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm != nullptr && lm->l_name != nullptr;
    const bool same = named && ::stat(lm->l_name, &loaded) == 0 && loaded.st_dev == st.st_dev &&
                      loaded.st_ino == st.st_ino;
    char where[256];
    std::snprintf(where, sizeof where, "%s", named && lm->l_name[0] != '\0' ? lm->l_name : "unknown file");
    dlclose(h);
    if (!same) {
      std::snprintf(why, whySize, "a %s is already loaded in the process from %s, not the broker's %s", kCuptiLibrary,
                    where, library);
      return false;
    }
  }
  return true;
}

}  // namespace

ActivityBusy& activityBusy() noexcept { return gActivity; }
bool cuptiActive() noexcept { return gActive.load(std::memory_order_acquire); }
void cuptiForgetAfterFork() noexcept {
  gActive.store(false, std::memory_order_release);
  pthread_mutex_init(&gPoolMutex, nullptr);
}

bool startCupti(const char* library, uint32_t brokerUid, int devices, ActivityBusy::Sink sink,
                ActivityBusy::Metered metered, char* why, size_t whySize) noexcept {
  const auto fail = [&](const char* fmt, const char* a, const char* b) {
    std::snprintf(why, whySize, fmt, a, b);
    return false;
  };
  if (library == nullptr) library = kCuptiLibrary;
  else if (!trustedCupti(library, brokerUid, why, whySize)) return false;
  void* h = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    return fail("dlopen(%s) failed: %s", library, e ? e : "unknown error");
  }
  CuptiApi api;
  const auto sym = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(realDlsym(h, name));
    return slot != nullptr;
  };
  const char* missing = nullptr;
  if (!sym(api.getNextRecord, "cuptiActivityGetNextRecord")) missing = "cuptiActivityGetNextRecord";
  else if (!sym(api.getNumDroppedRecords, "cuptiActivityGetNumDroppedRecords")) missing = "cuptiActivityGetNumDroppedRecords";
  else if (!sym(api.registerCallbacks, "cuptiActivityRegisterCallbacks")) missing = "cuptiActivityRegisterCallbacks";
  else if (!sym(api.enable, "cuptiActivityEnable")) missing = "cuptiActivityEnable";
  else if (!sym(api.disable, "cuptiActivityDisable")) missing = "cuptiActivityDisable";
  else if (!sym(api.flushAll, "cuptiActivityFlushAll")) missing = "cuptiActivityFlushAll";
  sym(api.getResultString, "cuptiGetResultString");
  if (missing != nullptr) {
    dlclose(h);
    return fail("%s has no %s", library, missing);
  }
  gActivity.configure(api, devices, sink, metered);
  if (const CUptiResult r = api.registerCallbacks(bufferRequested, bufferCompleted); r != CUPTI_SUCCESS)
    return fail("cuptiActivityRegisterCallbacks: %s%s", resultText(api, r), "");
  for (size_t i = 0; i < sizeof kKinds / sizeof kKinds[0]; ++i) {
    if (const CUptiResult r = api.enable(kKinds[i]); r != CUPTI_SUCCESS) {
      for (size_t k = 0; k < i; ++k) api.disable(kKinds[k]);
      static const char* const names[] = {"CONCURRENT_KERNEL", "MEMCPY", "MEMCPY2", "MEMSET"};
      char what[64];
      std::snprintf(what, sizeof what, "cuptiActivityEnable(CUPTI_ACTIVITY_KIND_%s)", names[i]);
      return fail("%s: %s", what, resultText(api, r));
    }
  }
  // The library stays loaded: CUPTI's threads and callbacks live in it.
  gActive.store(true, std::memory_order_release);
  return true;
}

void flushCupti(bool forced) noexcept {
  if (!gActive.load(std::memory_order_acquire)) return;
  gActivity.api().flushAll(forced ? CUPTI_ACTIVITY_FLAG_FLUSH_FORCED : 0);
}

}  // namespace cushare::shim
