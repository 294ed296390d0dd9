// Road 4: dlmopen into another link-map namespace. A preloaded library is loaded into the base
// namespace only, so a driver or NVML loaded into a new namespace (dlmopen(LM_ID_NEWLM, ...)) would
// be a second copy the shim never sees: its allocations and its memory view would bypass the limit.
// The shim's dlmopen (dlsym_x86_64.S) leaves base-namespace loads to glibc untouched and checks
// every other one after glibc has loaded it, by what the loaded object exports (cuInit, nvmlInit),
// not by its file name, so a renamed copy is found too:
//  - the object itself is the driver (or NVML): it is unloaded and the caller gets a handle to the
//    process's own copy in the base namespace, the one the shim wraps: dlsym and dlvsym on it answer
//    the shim's entry points, and the process keeps one driver state and one ledger slot;
//  - the driver or NVML came in as a dependency (a library linked against libcuda): its calls would
//    bind to that copy inside the namespace, out of the shim's reach, so the load is undone and
//    refused: null, a dlerror naming the reason, one log line.
// Not seen from here (docs/security.md): code already running inside another namespace that loads
// the driver with that namespace's own dlopen, or that resolves entry points without the dynamic
// linker.
#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "interpose/real.h"
#include "runtime/log.h"

extern "C" void* cushare_dlmopen_other(Lmid_t nsid, const char* file, int mode) noexcept;

namespace cushare::shim {
namespace {

void* realDlmopenFn() noexcept {
  static void* real = nullptr;
  void* p = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
  if (!p) {
    p = realDlsym(RTLD_NEXT, "dlmopen");  // after the shim: another interposer's, else glibc's
    __atomic_store_n(&real, p, __ATOMIC_RELEASE);
  }
  return p;
}

// glibc searches for a bare library name along the calling object's RPATH and RUNPATH, which it
// finds from the return address: the shim's C code calling glibc would search along the shim's.
// So the caller's search path (without the system directories, which come after ld.so.cache and
// are the same for everyone) is walked here first, and a hit is loaded by its path.
bool findAlongCallersPath(const char* file, void* caller, std::string* path) noexcept {
  Dl_info info;
  link_map* map = nullptr;
  if (!dladdr1(caller, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) || !map) return false;
  Dl_serinfo size;
  if (dlinfo(map, RTLD_DI_SERINFOSIZE, &size) != 0) return false;
  std::vector<char> buffer(size.dls_size);
  auto* list = reinterpret_cast<Dl_serinfo*>(buffer.data());
  *list = size;
  if (dlinfo(map, RTLD_DI_SERINFO, list) != 0) return false;
  for (unsigned i = 0; i < list->dls_cnt; ++i) {
    if (list->dls_serpath[i].dls_flags & LA_SER_DEFAULT) continue;
    std::string candidate = std::string(list->dls_serpath[i].dls_name) + "/" + file;
    if (access(candidate.c_str(), F_OK) == 0) {
      *path = std::move(candidate);
      return true;
    }
  }
  return false;
}

enum class Found { kNone, kOwn, kDependency };

// Whether the scope of handle (the object and its dependencies) defines `marker`, and where: in the
// object itself or in a dependency. The shim's own export (found when the scope reaches the base
// namespace's global scope) is not a copy of anything.
Found definedIn(void* handle, const char* marker) noexcept {
  void* p = realDlsym(handle, marker);
  if (!p || p == wrapperForSymbol(marker)) return Found::kNone;
  Dl_info info;
  link_map* map = nullptr;
  if (!dladdr1(p, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) || !map) return Found::kDependency;
  return map == static_cast<link_map*>(handle) ? Found::kOwn : Found::kDependency;
}

// Leaves a dlerror message for a refused load: glibc keeps the message of the last failed call, so
// the shim fails one whose message names the reason (a path that cannot exist).
void failWithReason(const char* what) noexcept {
  const std::string path = std::string("/proc/self/cushare: ") + what + " in another link-map namespace is refused";
  if (void* h = dlopen(path.c_str(), RTLD_LAZY)) dlclose(h);
}

void* refuse(void* loaded, const char* file, const char* what) noexcept {
  if (loaded) dlclose(loaded);
  CUSHARE_LOG(LogLevel::kError,
              "dlmopen of %s into another link-map namespace refused: it brings %s there, out of the "
              "shim's reach (load it with dlopen instead)",
              file ? file : "(null)", what);
  failWithReason(what);
  return nullptr;
}

}  // namespace
}  // namespace cushare::shim

// Where the shim's dlmopen goes (dlsym_x86_64.S): glibc's for the base namespace, the check below
// for any other.
extern "C" __attribute__((visibility("hidden"))) void* cushare_dlmopen_route(Lmid_t nsid, const char*, int) {
  if (nsid == LM_ID_BASE) return cushare::shim::realDlmopenFn();
  return reinterpret_cast<void*>(&cushare_dlmopen_other);
}

extern "C" __attribute__((visibility("hidden"))) void* cushare_dlmopen_other(Lmid_t nsid, const char* file,
                                                                           int mode) noexcept {
  using namespace cushare::shim;
  auto real = reinterpret_cast<void* (*)(Lmid_t, const char*, int)>(realDlmopenFn());
  std::string path;  // jumped to from dlmopen: the return address is the caller's
  const bool bare = file && !std::strchr(file, '/');
  void* h = real(nsid, bare && findAlongCallersPath(file, __builtin_return_address(0), &path) ? path.c_str() : file, mode);
  if (!h) return nullptr;  // glibc's own error
  const Found driver = definedIn(h, "cuInit");
  const Found nvml = definedIn(h, "nvmlInit");
  dlerror();  // the probes above leave "undefined symbol" errors; the load succeeded
  if (driver == Found::kNone && nvml == Found::kNone) return h;
  if (driver != Found::kNone && nvml != Found::kNone)
    return refuse(h, file, "the CUDA driver and NVML");
  if (driver == Found::kDependency) return refuse(h, file, "the CUDA driver");
  if (nvml == Found::kDependency) return refuse(h, file, "NVML");
  // The object is the driver (or NVML) itself: answer with the process's own copy.
  dlclose(h);
  std::string error;
  const bool isDriver = driver == Found::kOwn;
  if (isDriver ? !loadRealDriver(&error) : !loadRealNvml()) {
    CUSHARE_LOG(LogLevel::kError, "the process's own %s cannot be loaded: %s", isDriver ? "CUDA driver" : "NVML",
                isDriver ? error.c_str() : "libnvidia-ml.so.1 not found");
    return refuse(nullptr, file, isDriver ? "the CUDA driver" : "NVML");
  }
  void* own = dlopen(isDriver ? "libcuda.so.1" : "libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  CUSHARE_LOG(LogLevel::kInfo, "dlmopen of %s into another link-map namespace answered with the process's %s",
              file ? file : "(null)", isDriver ? "CUDA driver" : "NVML");
  return own;
}
