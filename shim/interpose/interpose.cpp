// The three roads into the driver, generated from hooks.def:
//  1. exported symbols with the driver's real ABI names (programs linked with -lcuda);
//  2. cuGetProcAddress / _v2 (cudart, cudaGetDriverEntryPoint): the real driver answers the
//     request (so the ABI and stream variant are exactly the driver's choice) and the shim swaps
//     the answer for its wrapper when that real function is one it hooks;
//  3. dlsym and dlvsym (cudart's own dlsym of cuGetProcAddress_v2, cuBLASLt and cuFFT looking up
//     ~90 names on their handle to libcuda): the shim swaps hooked answers the same way, answers
//     for the process's driver when a handle holds a second copy of it, and leaves every other
//     lookup to the real function, called so that RTLD_NEXT keeps meaning "after the caller"
//     (dlsym_x86_64.S). Road 4, dlmopen into another link-map namespace: namespaces.cpp.
#include <dlfcn.h>
#include <gnu/libc-version.h>
#include <link.h>
#include <pthread.h>

#include <cstddef>
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
// The first call (or a failed start) goes through a cold function, so that the common case is
// one load, two compares and a tail jump to the policy (no frame, arguments left in place).
// CUSHARE_CHECKED_WRAPPER defines `name` so, with its cold first-call function `first`. The names
// come pasted (cuda.h defines some hooked names as macros, which a bare argument would expand).
#define CUSHARE_CHECKED_WRAPPER(name, first, hook, real, params, args)                             \
  __attribute__((noinline, cold)) static CUresult first params {                                   \
    if (CUresult r_ = ::cushare::shim::processReady(); r_ != CUDA_SUCCESS &&                       \
                                                      !::cushare::shim::resolvesWhenRefused(#real)) \
      return r_;                                                                                   \
    if (!::cushare::shim::realDriver().real) return CUDA_ERROR_NOT_SUPPORTED;                      \
    return ::cushare::shim::hook args;                                                             \
  }                                                                                                \
  CUresult name params {                                                                           \
    if (__builtin_expect(::cushare::shim::detail::gProcessPhase.load(std::memory_order_acquire) != 1, 0)) \
      return first args;                                                                           \
    if (!::cushare::shim::realDriver().real) return CUDA_ERROR_NOT_SUPPORTED;                      \
    return ::cushare::shim::hook args;                                                             \
  }
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args)                                      \
  extern "C" CUSHARE_EXPORT CUresult cushare_wrap_##sym params __asm__(#sym);                      \
  CUSHARE_CHECKED_WRAPPER(cushare_wrap_##sym, cushare_first_##sym, hook_##sym, p_##sym, params, args)
// Launches: the exported symbol is a trampoline (no frame, the caller's arguments, stack ones
// included, left untouched; rax and r11 are scratch at a call). It loads the launch word
// (launch.cpp: the single device's compute mode word once the devices are ready) and, with no
// compute mode in force, jumps to the real launch: two loads, a test and two branches more than
// without the shim. Otherwise it jumps to the hook (which meters and paces) once the devices are
// ready and the driver has the entry point, and to the checked wrapper (cushare_slow_*) before
// that (the first call, a failed start, a missing entry point).
#define CUSHARE_LAUNCH_HOOK(sym, base, ver, pt, params, args)                                      \
  extern "C" CUSHARE_EXPORT CUresult cushare_wrap_##sym params __asm__(#sym);                      \
  extern "C" CUresult cushare_slow_##sym params __asm__("cushare_slow_" #sym);                     \
  CUSHARE_CHECKED_WRAPPER(cushare_slow_##sym, cushare_first_##sym, hook_##sym, p_##sym, params, args) \
  __attribute__((naked)) CUresult cushare_wrap_##sym params {                                      \
    __asm__("movq cushare_launch_word(%%rip), %%rax\n\t"                                           \
            "testl %0, (%%rax)\n\t"                                                               \
            "jnz 1f\n\t"                                                                          \
            "movq %p1+%c2(%%rip), %%rax\n\t"                                                      \
            "testq %%rax, %%rax\n\t"                                                              \
            "jz 2f\n\t"                                                                           \
            "jmp *%%rax\n"                                                                         \
            "1:\n\t"                                                                              \
            "leaq cushare_launch_unready(%%rip), %%r11\n\t"                                        \
            "cmpq %%r11, %%rax\n\t"                                                               \
            "je 2f\n\t"                                                                           \
            "cmpq $0, %p1+%c2(%%rip)\n\t"                                                         \
            "je 2f\n\t"                                                                           \
            "jmp cushare_hook_" #sym "\n"                                                          \
            "2:\n\t"                                                                              \
            "jmp cushare_slow_" #sym                                                               \
            :                                                                                      \
            : "i"(::cushare::kComputeModeMask), "i"(&::cushare::shim::gRealDriver),                \
              "i"(offsetof(::cushare::shim::RealDriver, p_##sym)));                                \
  }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"  // the trampolines' parameters are the asm's
#include "hooks.def"
#pragma GCC diagnostic pop
#undef CUSHARE_LAUNCH_HOOK
#undef CUSHARE_DRIVER_HOOK
#undef CUSHARE_CHECKED_WRAPPER
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
  gDriver.p_cuDeviceGetUuid = reinterpret_cast<decltype(gDriver.p_cuDeviceGetUuid)>(realDlsym(h, "cuDeviceGetUuid"));
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
  CUSHARE_RESOLVE(cuMemPrefetchAsync_v2);
  CUSHARE_RESOLVE(cuDeviceGetDefaultMemPool);
  CUSHARE_RESOLVE(cuMemGetAllocationPropertiesFromHandle);
  CUSHARE_RESOLVE(cuCtxGetCurrent);
  CUSHARE_RESOLVE(cuCtxSetCurrent);
  CUSHARE_RESOLVE(cuEventCreate);
  CUSHARE_RESOLVE(cuEventRecord);
  CUSHARE_RESOLVE(cuEventQuery);
  CUSHARE_RESOLVE(cuEventDestroy_v2);
  // cuda.h of CUDA 13 names cuEventElapsedTime_v2 so; older drivers export only the first.
  gDriver.p_cuEventElapsedTime = reinterpret_cast<decltype(gDriver.p_cuEventElapsedTime)>(realDlsym(h, "cuEventElapsedTime_v2"));
  if (!gDriver.p_cuEventElapsedTime) CUSHARE_RESOLVE(cuEventElapsedTime);
  CUSHARE_RESOLVE(cuStreamCreate);
  CUSHARE_RESOLVE(cuCtxGetStreamPriorityRange);
  CUSHARE_RESOLVE(cuCtxPushCurrent_v2);
  CUSHARE_RESOLVE(cuCtxPopCurrent_v2);
  CUSHARE_RESOLVE(cuDeviceGetAttribute);
  CUSHARE_RESOLVE(cuDevicePrimaryCtxRetain);
  CUSHARE_RESOLVE(cuGetErrorName);
  CUSHARE_RESOLVE(cuGetErrorString);
  CUSHARE_RESOLVE(cuMemcpyDtoHAsync_v2);
  CUSHARE_RESOLVE(cuMemsetD8_v2);
  CUSHARE_RESOLVE(cuMemsetD8Async);
  CUSHARE_RESOLVE(cuModuleGetFunction);
  CUSHARE_RESOLVE(cuModuleLoadData);
  CUSHARE_RESOLVE(cuModuleUnload);
#undef CUSHARE_RESOLVE
  if (!gDriver.p_cuInit || !gDriver.p_cuGetProcAddress_v2 || !gDriver.p_cuCtxGetDevice || !gDriver.p_cuDeviceGetUuid_v2) {
    if (error) *error = "the CUDA driver libcuda.so.1 lacks entry points the shim needs (driver older than CUDA 12?)";
    return false;
  }
  __atomic_store_n(&gDriver.handle, h, __ATOMIC_RELEASE);
  return true;
}

bool resolvesWhenRefused(const char* real) noexcept {
  return (std::strcmp(real, "p_cuGetProcAddress") == 0 || std::strcmp(real, "p_cuGetProcAddress_v2") == 0) &&
         loadRealDriver(nullptr);
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

// ---- road 3: dlsym and dlvsym ----
// The real dlsym and dlvsym, resolved lazily (dlsym can be called before this library's
// constructors). The shim defines both, and every reference to either, versioned or not, binds to
// the shim's own (an unversioned definition satisfies versioned references): glibc's dlvsym is
// found in libc.so.6's own symbol table (GNU hash), and the real dlsym through it as before.
extern "C" {
__attribute__((visibility("hidden"))) void* cushare_real_dlsym = nullptr;
__attribute__((visibility("hidden"))) void* cushare_real_dlvsym = nullptr;
}

namespace cushare::shim {
namespace {
// Whether a starts with (whole: equals) b. The lookup path compares names with this, not with
// libc's string functions: sanitizer runtimes look functions up through dlsym before their own
// strcmp interceptor can call the real one.
CUSHARE_NO_SANITIZE bool startsWith(const char* a, const char* b, bool whole = false) noexcept {
  for (; *b; ++a, ++b)
    if (*a != *b) return false;
  return !whole || *a == '\0';
}

CUSHARE_NO_SANITIZE void* libcSymbol(const char* name) noexcept {
  // libc's link map, from a function only libc defines (no dlopen: this runs inside sanitizer
  // runtimes' start-up, whose dlopen interceptor is not ready).
  Dl_info info;
  link_map* lm = nullptr;
  if (!dladdr1(reinterpret_cast<void*>(&gnu_get_libc_version), &info, reinterpret_cast<void**>(&lm),
               RTLD_DL_LINKMAP) ||
      !lm)
    return nullptr;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const uint32_t* hash = nullptr;
  // ld.so has relocated these entries in place (x86-64: the dynamic section is writable).
  for (const ElfW(Dyn)* d = lm->l_ld; d->d_tag != DT_NULL; ++d) {
    if (d->d_tag == DT_SYMTAB) symtab = reinterpret_cast<const ElfW(Sym)*>(d->d_un.d_ptr);
    if (d->d_tag == DT_STRTAB) strtab = reinterpret_cast<const char*>(d->d_un.d_ptr);
    if (d->d_tag == DT_GNU_HASH) hash = reinterpret_cast<const uint32_t*>(d->d_un.d_ptr);
  }
  if (!symtab || !strtab || !hash) return nullptr;
  const uint32_t nBuckets = hash[0], symOffset = hash[1], bloomWords = hash[2];
  const uint32_t* buckets =
      reinterpret_cast<const uint32_t*>(reinterpret_cast<const ElfW(Addr)*>(hash + 4) + bloomWords);
  const uint32_t* chain = buckets + nBuckets;
  uint32_t h32 = 5381;
  for (const char* c = name; *c; ++c) h32 = h32 * 33 + static_cast<unsigned char>(*c);
  for (uint32_t i = buckets[h32 % nBuckets]; i >= symOffset; ++i) {
    const uint32_t ch = chain[i - symOffset];
    if ((ch | 1) == (h32 | 1) && symtab[i].st_value &&
        startsWith(strtab + symtab[i].st_name, name, true))
      return reinterpret_cast<void*>(lm->l_addr + symtab[i].st_value);
    if (ch & 1) break;
  }
  return nullptr;
}
}  // namespace

CUSHARE_NO_SANITIZE void* realDlsym(void* handle, const char* name) noexcept {
  if (!cushare_real_dlsym) {
    auto dlvsymFn =
        reinterpret_cast<void* (*)(void*, const char*, const char*)>(libcSymbol("dlvsym"));
    __atomic_store_n(&cushare_real_dlvsym, reinterpret_cast<void*>(dlvsymFn), __ATOMIC_RELEASE);
    void* p = dlvsymFn(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = dlvsymFn(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&cushare_real_dlsym, p, __ATOMIC_RELEASE);
  }
  return reinterpret_cast<void* (*)(void*, const char*)>(cushare_real_dlsym)(handle, name);
}

CUSHARE_NO_SANITIZE void* realDlvsym(void* handle, const char* name, const char* version) noexcept {
  if (!cushare_real_dlvsym) realDlsym(RTLD_DEFAULT, "dlsym");  // resolves both
  return reinterpret_cast<void* (*)(void*, const char*, const char*)>(cushare_real_dlvsym)(
      handle, name, version);
}

namespace {
// A driver API (cuXxx) or NVML (nvmlXxx) entry point's name: not cudart's cudaXxx, cuBLAS's
// cublasXxx or any other library's "cu" names.
CUSHARE_NO_SANITIZE bool entryPointName(const char* name) noexcept {
  if (name[0] == 'c' && name[1] == 'u') return name[2] >= 'A' && name[2] <= 'Z';
  return startsWith(name, "nvml") && name[4] >= 'A' && name[4] <= 'Z';
}

// What the shim answers for a lookup of `name` on `handle`, `lookup` being the real dlsym or
// dlvsym for this call; null leaves the answer to glibc.
//  - A hooked name that would resolve to the real function (or to the shim's own export, which
//    RTLD_DEFAULT finds first): the shim's wrapper.
//  - On a library handle, a driver or NVML entry point that resolves to another definition than
//    the process's driver (a second copy of libcuda loaded under another name or path, or into
//    another link-map namespace, namespaces.cpp): the process's own entry point, the shim's
//    wrapper where hooked. A second copy of the driver never answers: its allocations would be
//    invisible to the shim.
//  - The loader's own dlsym, dlvsym and dlmopen, on any handle (a C-library handle, or dlvsym,
//    which skips the shim's unversioned exports): the shim's. glibc's would look the driver up,
//    or load it into another namespace, past the shim.
CUSHARE_NO_SANITIZE void* loaderFunction(const char* name) noexcept {
  if (name[0] != 'd' || name[1] != 'l') return nullptr;
  if (startsWith(name, "dlsym", true)) return reinterpret_cast<void*>(&dlsym);
  if (startsWith(name, "dlvsym", true)) return reinterpret_cast<void*>(&dlvsym);
  if (startsWith(name, "dlmopen", true)) return reinterpret_cast<void*>(&dlmopen);
  return nullptr;
}

template <typename Lookup>
CUSHARE_NO_SANITIZE void* answerLookup(void* handle, const char* name, Lookup lookup) noexcept {
  if (!name) return nullptr;
  if (void* own = loaderFunction(name))
    return lookup(handle == RTLD_NEXT ? RTLD_DEFAULT : handle, name) ? own : nullptr;
  if (!entryPointName(name)) return nullptr;
  void* wrapper = wrapperForSymbol(name);
  const bool libraryHandle = handle != RTLD_DEFAULT && handle != RTLD_NEXT;
  if (!wrapper && !libraryHandle) return nullptr;
  void* found = lookup(handle == RTLD_NEXT ? RTLD_DEFAULT : handle, name);
  if (!found) return nullptr;  // glibc says so itself, with its own dlerror
  if (found == wrapper) return wrapper;
  const bool nvml = name[0] == 'n';
  std::string ignored;
  const bool loaded = nvml ? loadRealNvml() : loadRealDriver(&ignored);
  void* answer = nullptr;
  if (wrapper && wrapperForReal(found) == wrapper) {
    answer = wrapper;
  } else if (libraryHandle && loaded) {
    void* own = realDlsym(nvml ? realNvml().handle : realDriver().handle, name);
    if (own != found) answer = wrapper ? wrapper : own;
  }
  dlerror();  // loading or the lookups above may have left an error; this lookup succeeded
  return answer;
}
}  // namespace
}  // namespace cushare::shim

// Called by the dlsym and dlvsym trampolines (dlsym_x86_64.S) with the caller's arguments: the
// shim's answer, or null (the trampoline then tail-jumps to the real function, so the caller's
// RTLD_NEXT position is kept).
extern "C" __attribute__((visibility("hidden"))) CUSHARE_NO_SANITIZE void* cushare_dlsym_intercept(void* handle,
                                                                                             const char* name) {
  if (!cushare_real_dlsym) cushare::shim::realDlsym(RTLD_DEFAULT, "dlsym");  // resolve it, result unused
  return cushare::shim::answerLookup(
      handle, name, [](void* h, const char* n) { return cushare::shim::realDlsym(h, n); });
}

extern "C" __attribute__((visibility("hidden"))) CUSHARE_NO_SANITIZE void* cushare_dlvsym_intercept(
    void* handle, const char* name, const char* version) {
  if (!cushare_real_dlvsym) cushare::shim::realDlsym(RTLD_DEFAULT, "dlsym");  // resolves both
  return cushare::shim::answerLookup(handle, name, [version](void* h, const char* n) {
    return cushare::shim::realDlvsym(h, n, version);
  });
}
