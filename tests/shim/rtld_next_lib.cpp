// A tiny library for the RTLD_NEXT checks of conformance_test.cpp, built twice (CMakeLists.txt):
// cushare_rtld_next_a (CUSHARE_PROBE_VALUE 2) and cushare_rtld_next_b (3), linked into the test in
// that order, so the global search order is: test executable (probe 1), libcushare.so
// (preloaded, no probe), A (2), B (3), libcuda.so.1. Each library asks dlsym(RTLD_NEXT, ...) from
// its own code: glibc resolves RTLD_NEXT from the caller's return address, so through the shim's
// dlsym A must see B's probe and B must see none. A shim whose dlsym forwarded with an ordinary
// call would make every RTLD_NEXT relative to the shim: A would then find its own probe (2).
#include <dlfcn.h>

#ifndef CUSHARE_PROBE_VALUE
#error "build with -DCUSHARE_PROBE_VALUE=<n> -DCUSHARE_PROBE_LIB=<suffix>"
#endif

#define CUSHARE_CAT2(a, b) a##b
#define CUSHARE_CAT(a, b) CUSHARE_CAT2(a, b)
#define CUSHARE_LIB_FN(name) CUSHARE_CAT(name, CUSHARE_PROBE_LIB)

extern "C" {

__attribute__((visibility("default"))) int cushare_test_probe() { return CUSHARE_PROBE_VALUE; }

// The value of the next cushare_test_probe after this library, or -1 if there is none. The
// dlsym call must not be a tail call: the caller's return address has to be in this library.
__attribute__((visibility("default"), noinline)) int CUSHARE_LIB_FN(cushare_test_next_probe_)() {
  void* volatile p = dlsym(RTLD_NEXT, "cushare_test_probe");
  return p ? reinterpret_cast<int (*)()>(p)() : -1;
}

// dlsym(RTLD_NEXT, name) asked from this library (hooked and unhooked driver names).
__attribute__((visibility("default"), noinline)) void* CUSHARE_LIB_FN(cushare_test_next_)(
    const char* name) {
  void* volatile p = dlsym(RTLD_NEXT, name);
  return p;
}

}  // extern "C"
