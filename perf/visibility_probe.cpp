// What a CUDA process sees under the current environment (CUDA_VISIBLE_DEVICES, ...), from
// whichever libcuda.so.1 the loader finds: a real driver or simgpu (perf/gpu_check.sh runs it
// against both and compares). Prints one line:
//   init=<cuInit's code> count=<n> uuids=<GPU-...,GPU-...> [alloc=<code>/<code>...]
// With arguments, each a byte count, it allocates them in order on every visible ordinal (in its
// primary context, nothing freed until exit) and reports each code, ordinal by ordinal: under the
// shim with a limit this shows where the limit falls. Loads the driver with dlopen, so it builds
// and links without one.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
struct CUuuid {
  unsigned char bytes[16];
};

template <class F>
F sym(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

int main(int argc, char** argv) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::printf("error=no-libcuda %s\n", dlerror());
    return 2;
  }
  auto init = sym<CUresult (*)(unsigned)>(lib, "cuInit");
  auto count = sym<CUresult (*)(int*)>(lib, "cuDeviceGetCount");
  auto get = sym<CUresult (*)(CUdevice*, int)>(lib, "cuDeviceGet");
  auto uuid = sym<CUresult (*)(CUuuid*, CUdevice)>(lib, "cuDeviceGetUuid");
  auto retain = sym<CUresult (*)(CUcontext*, CUdevice)>(lib, "cuDevicePrimaryCtxRetain");
  auto setCurrent = sym<CUresult (*)(CUcontext)>(lib, "cuCtxSetCurrent");
  auto alloc = sym<CUresult (*)(CUdeviceptr*, size_t)>(lib, "cuMemAlloc_v2");
  if (!init || !count || !get || !uuid || !retain || !setCurrent || !alloc) {
    std::printf("error=missing-symbols\n");
    return 2;
  }
  const CUresult r = init(0);
  int n = -1;
  const CUresult rc = r == 0 ? count(&n) : r;
  std::string uuids, allocs;
  for (int i = 0; rc == 0 && i < n; ++i) {
    CUdevice d;
    CUuuid u{};
    if (get(&d, i) != 0 || uuid(&u, d) != 0) {
      uuids += std::string(uuids.empty() ? "" : ",") + "?";
      continue;
    }
    char s[48];
    std::snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u.bytes[0],
                  u.bytes[1], u.bytes[2], u.bytes[3], u.bytes[4], u.bytes[5], u.bytes[6], u.bytes[7], u.bytes[8],
                  u.bytes[9], u.bytes[10], u.bytes[11], u.bytes[12], u.bytes[13], u.bytes[14], u.bytes[15]);
    uuids += std::string(uuids.empty() ? "" : ",") + s;
    if (argc < 2) continue;
    CUcontext ctx;
    if (retain(&ctx, d) != 0 || setCurrent(ctx) != 0) {
      allocs += " ctx-failed";
      continue;
    }
    allocs += " ";
    for (int a = 1; a < argc; ++a) {
      CUdeviceptr p;
      allocs += (a > 1 ? "/" : "") + std::to_string(alloc(&p, std::strtoull(argv[a], nullptr, 10)));
    }
  }
  std::printf("init=%d count=%d uuids=%s%s%s\n", r, rc == 0 ? n : -1, uuids.c_str(), allocs.empty() ? "" : " alloc=",
              allocs.empty() ? "" : allocs.c_str() + 1);
  return 0;
}
