// The three roads into the driver, generated from hooks.def:
//  1. exported symbols with the driver's real ABI names (programs linked with -lcuda);
//  2. cuGetProcAddress / _v2 (cudart, cudaGetDriverEntryPoint): the real driver answers the
//     request (so the ABI and stream variant are exactly the driver's choice) and the shim swaps
//     the answer for its wrapper when that real function is one it hooks;
//  3. dlsym (cudart's own dlsym of cuGetProcAddress_v2, cuBLASLt and cuFFT looking up ~90 names
//     on their handle to libcuda): the shim's dlsym swaps hooked answers the same way and leaves
//     every other lookup to the real dlsym, called so that RTLD_NEXT keeps meaning "after the
//     caller" (dlsym.S).
#include <dlfcn.h>
#include <pthread.h>

#include <cstring>

#include "hooks.h"
#include "real.h"
#include "runtime/state.h"

#define CUSHARE_EXPORT __attribute__((visibility("default")))
// The dlsym path runs inside the sanitizer runtimes' own start-up (their interceptors look up the
// real functions with dlsym(RTLD_NEXT, ...), which binds to this library's dlsym): it must not be
// instrumented, or a sanitizer build of the shim crashes before main.
#define CUSHARE_NO_SANITIZE __attribute__((no_sanitize("address", "thread", "undefined")))

// ---- road 1: exported wrappers ----
// Every wrapper first makes sure the shim is initialised (one acquire load once it is) and that
// the real driver has the entry point: nothing ever calls through a null pointer.
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args)                                      \
  extern "C" CUSHARE_EXPORT CUresult cushare_wrap_##sym params __asm__(#sym);                      \
  CUresult cushare_wrap_##sym params {                                                             \
    if (CUresult r_ = ::cushare::shim::processReady(); r_ != CUDA_SUCCESS) return r_;              \
    if (!::cushare::shim::realDriver().p_##sym) return CUDA_ERROR_NOT_SUPPORTED;                   \
    return ::cushare::shim::hook_##sym args;                                                       \
  }
#include "hooks.def"
#undef CUSHARE_DRIVER_HOOK
#define CUSHARE_NVML_HOOK(sym, params, args)                                                       \
  extern "C" CUSHARE_EXPORT nvmlReturn_t cushare_wrap_##sym params __asm__(#sym);                  \
  nvmlReturn_t cushare_wrap_##sym params {                                                         \
    if (::cushare::shim::processReady() != CUDA_SUCCESS) return NVML_ERROR_UNKNOWN;                \
    if (!::cushare::shim::loadRealNvml() || !::cushare::shim::realNvml().p_##sym)                  \
      return NVML_ERROR_FUNCTION_NOT_FOUND;                                                        \
    return ::cushare::shim::hook_##sym args;                                                       \
  }
#include "nvml_hooks.def"
#undef CUSHARE_NVML_HOOK

namespace cushare::shim {
namespace {

struct Entry {
  const char* symbol;
  void* wrapper;
  void** real;  // where the real pointer is stored once loaded
  bool nvml;
};

constinit RealDriver& gDriver = gRealDriver;  // short names for the tables below
constinit RealNvml& gNvml = gRealNvml;
// Serialises loading (dlsym's first hooked lookup, cuInit, NVML's first call can race). Recursive:
// dlopen runs the library's constructors, which may call dlsym, which may come back here.
pthread_mutex_t gLoadMutex = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
struct LoadLock {
  LoadLock() { pthread_mutex_lock(&gLoadMutex); }
  ~LoadLock() { pthread_mutex_unlock(&gLoadMutex); }
};

const Entry* entries(size_t* n) {
  static const Entry kEntries[] = {
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args) \
  {#sym, reinterpret_cast<void*>(&cushare_wrap_##sym), reinterpret_cast<void**>(&gDriver.p_##sym), false},
#include "hooks.def"
#undef CUSHARE_DRIVER_HOOK
#define CUSHARE_NVML_HOOK(sym, params, args) \
  {#sym, reinterpret_cast<void*>(&cushare_wrap_##sym), reinterpret_cast<void**>(&gNvml.p_##sym), true},
#include "nvml_hooks.def"
#undef CUSHARE_NVML_HOOK
  };
  *n = sizeof kEntries / sizeof kEntries[0];
  return kEntries;
}

}  // namespace

constinit RealDriver gRealDriver;
constinit RealNvml gRealNvml;

void* wrapperForReal(void* realFn) noexcept {
  if (!realFn) return nullptr;
  // Real pointers are read only once their library's load has been published (the release store
  // of its handle): another thread may be filling them in right now.
  const bool driver = __atomic_load_n(&gDriver.handle, __ATOMIC_ACQUIRE) != nullptr;
  const bool nvml = __atomic_load_n(&gNvml.handle, __ATOMIC_ACQUIRE) != nullptr;
  size_t n;
  const Entry* e = entries(&n);
  for (size_t i = 0; i < n; ++i) {
    if (e[i].wrapper == realFn) return e[i].wrapper;
    if ((e[i].nvml ? nvml : driver) && *e[i].real == realFn) return e[i].wrapper;
  }
  return nullptr;
}

void* wrapperForSymbol(const char* name) noexcept {
  size_t n;
  const Entry* e = entries(&n);
  for (size_t i = 0; i < n; ++i)
    if (std::strcmp(e[i].symbol, name) == 0) return e[i].wrapper;
  return nullptr;
}

bool loadRealDriver(std::string* error) noexcept {
  if (__atomic_load_n(&gDriver.handle, __ATOMIC_ACQUIRE)) return true;
  LoadLock lock;
  if (gDriver.handle) return true;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    if (error) *error = std::string("cannot load the CUDA driver libcuda.so.1: ") + dlerror();
    return false;
  }
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args) \
  gDriver.p_##sym = reinterpret_cast<decltype(gDriver.p_##sym)>(realDlsym(h, #sym));
#include "hooks.def"
#undef CUSHARE_DRIVER_HOOK
  gDriver.p_cuCtxGetDevice = reinterpret_cast<decltype(gDriver.p_cuCtxGetDevice)>(realDlsym(h, "cuCtxGetDevice"));
  gDriver.p_cuDeviceGetCount = reinterpret_cast<decltype(gDriver.p_cuDeviceGetCount)>(realDlsym(h, "cuDeviceGetCount"));
  gDriver.p_cuDeviceGet = reinterpret_cast<decltype(gDriver.p_cuDeviceGet)>(realDlsym(h, "cuDeviceGet"));
  gDriver.p_cuDeviceGetUuid_v2 =
      reinterpret_cast<decltype(gDriver.p_cuDeviceGetUuid_v2)>(realDlsym(h, "cuDeviceGetUuid_v2"));
#define CUSHARE_RESOLVE(name) gDriver.p_##name = reinterpret_cast<decltype(gDriver.p_##name)>(realDlsym(h, #name))
  CUSHARE_RESOLVE(cuStreamIsCapturing);
  CUSHARE_RESOLVE(cuStreamIsCapturing_ptsz);
  CUSHARE_RESOLVE(cuDeviceGetMemPool);
  CUSHARE_RESOLVE(cuMemPoolGetAttribute);
  CUSHARE_RESOLVE(cuGraphGetNodes);
  CUSHARE_RESOLVE(cuGraphNodeGetType);
  CUSHARE_RESOLVE(cuGraphMemAllocNodeGetParams);
  CUSHARE_RESOLVE(cuGraphChildGraphNodeGetGraph);
  CUSHARE_RESOLVE(cuGraphNodeGetParams);
  CUSHARE_RESOLVE(cuArrayGetMemoryRequirements);
  CUSHARE_RESOLVE(cuMipmappedArrayGetMemoryRequirements);
  CUSHARE_RESOLVE(cuArray3DGetDescriptor_v2);
  CUSHARE_RESOLVE(cuMipmappedArrayGetLevel);
  CUSHARE_RESOLVE(cuPointerGetAttribute);
  CUSHARE_RESOLVE(cuDevicePrimaryCtxGetState);
  CUSHARE_RESOLVE(cuStreamGetDevice);
  CUSHARE_RESOLVE(cuDeviceGetDefaultMemPool);
  CUSHARE_RESOLVE(cuMemGetAllocationPropertiesFromHandle);
#undef CUSHARE_RESOLVE
  if (!gDriver.p_cuInit || !gDriver.p_cuGetProcAddress_v2 || !gDriver.p_cuCtxGetDevice || !gDriver.p_cuDeviceGetUuid_v2) {
    if (error) *error = "the CUDA driver libcuda.so.1 lacks entry points the shim needs (driver older than CUDA 12?)";
    return false;
  }
  __atomic_store_n(&gDriver.handle, h, __ATOMIC_RELEASE);
  return true;
}

bool loadRealNvml() noexcept {
  if (__atomic_load_n(&gNvml.handle, __ATOMIC_ACQUIRE)) return true;
  LoadLock lock;
  if (gNvml.handle) return true;
  void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return false;
#define CUSHARE_NVML_HOOK(sym, params, args) \
  gNvml.p_##sym = reinterpret_cast<decltype(gNvml.p_##sym)>(realDlsym(h, #sym));
#include "nvml_hooks.def"
#undef CUSHARE_NVML_HOOK
  gNvml.p_nvmlDeviceGetUUID = reinterpret_cast<decltype(gNvml.p_nvmlDeviceGetUUID)>(realDlsym(h, "nvmlDeviceGetUUID"));
  __atomic_store_n(&gNvml.handle, h, __ATOMIC_RELEASE);
  return true;
}

}  // namespace cushare::shim

// ---- road 3: dlsym ----
// The real dlsym, resolved lazily (dlsym can be called before this library's constructors).
extern "C" {
__attribute__((visibility("hidden"))) void* cushare_real_dlsym = nullptr;
}

namespace cushare::shim {
CUSHARE_NO_SANITIZE void* realDlsym(void* handle, const char* name) noexcept {
  if (!cushare_real_dlsym) {
    void* p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&cushare_real_dlsym, p, __ATOMIC_RELEASE);
  }
  return reinterpret_cast<void* (*)(void*, const char*)>(cushare_real_dlsym)(handle, name);
}
}  // namespace cushare::shim

// Called by the dlsym trampoline (dlsym.S) with the caller's arguments: the shim's wrapper if the
// name is a hooked symbol and the lookup would have found the real one, else null (the
// trampoline then tail-jumps to the real dlsym, so the caller's RTLD_NEXT position is kept).
extern "C" __attribute__((visibility("hidden"))) CUSHARE_NO_SANITIZE void* cushare_dlsym_intercept(void* handle,
                                                                                             const char* name) {
  if (!cushare_real_dlsym) cushare::shim::realDlsym(RTLD_DEFAULT, "dlsym");  // resolve it, result unused
  if (!name || ((name[0] != 'c' || name[1] != 'u') && std::strncmp(name, "nvml", 4) != 0)) return nullptr;
  void* wrapper = cushare::shim::wrapperForSymbol(name);
  if (!wrapper) return nullptr;
  // Ask the real dlsym what this handle resolves the name to; substitute only a hooked real
  // function (or our own wrapper, which RTLD_DEFAULT finds first).
  void* found = cushare::shim::realDlsym(handle == RTLD_NEXT ? RTLD_DEFAULT : handle, name);
  if (!found) return nullptr;
  if (found == wrapper) return wrapper;
  std::string ignored;
  if (name[0] == 'c') cushare::shim::loadRealDriver(&ignored);
  else cushare::shim::loadRealNvml();
  if (cushare::shim::wrapperForReal(found) != wrapper) return nullptr;
  dlerror();  // loading may have left an error from an optional lookup; this lookup succeeded
  return wrapper;
}
