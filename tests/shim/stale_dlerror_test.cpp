// POSIX's idiom for dlsym is `dlerror(); p = dlsym(h, name); if (dlerror()) fail;` and glibc
// clears any pending error on a successful dlsym. Through the shim, the first dlsym of a hooked
// name on a driver or NVML handle also loads the real library and resolves every entry point the
// shim uses; one the installed library lacks (here nvmlDeviceGetMemoryInfo_v2, missing from an
// older NVML) must not leave its error behind for the caller's successful lookup. (Today a later
// successful lookup inside the shim happens to clear it; a missing name that is the last one the
// shim resolves is left behind.)
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>

#ifndef CUSHARE_OLD_NVML_PATH
#error "build with -DCUSHARE_OLD_NVML_PATH=\"<path of the old libnvidia-ml.so.1>\""
#endif

namespace {

TEST(StaleDlerror, SuccessfulLookupLeavesNoError) {
  // Loaded by path first, so the shim's own dlopen("libnvidia-ml.so.1") finds this one.
  void* nvml = dlopen(CUSHARE_OLD_NVML_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(nullptr, nvml) << dlerror();
  dlerror();
  void* p = dlsym(nvml, "nvmlDeviceGetMemoryInfo");
  const char* err = dlerror();
  ASSERT_NE(nullptr, p);
  Dl_info i{};
  ASSERT_NE(0, dladdr(p, &i));
  EXPECT_NE(nullptr, std::strstr(i.dli_fname, "libcushare.so"))
      << "not the shim's wrapper: " << i.dli_fname;
  EXPECT_EQ(nullptr, err) << "dlsym succeeded but dlerror() says: " << err;
  // The same for a name the shim does not hook, after the shim has loaded NVML.
  dlerror();
  EXPECT_NE(nullptr, dlsym(nvml, "nvmlInit_v2"));
  EXPECT_EQ(nullptr, dlerror());
}

}  // namespace
