// The shim called from a constructor that runs before its own (early_call_lib.cpp): cuInit and
// cuGetProcAddress from there must work, and cuMemAlloc obtained that way must be the shim's
// wrapper. A crash before main (ctest: SEGFAULT) means the shim used a global that its dynamic
// initialiser had not yet set up.
#include <cuda.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>

extern "C" CUresult cushare_early_init_result();
extern "C" CUresult cushare_early_proc_result(void** fn);

namespace {

TEST(EarlyCall, DriverCallsFromAnEarlierConstructorWork) {
  EXPECT_EQ(CUDA_SUCCESS, cushare_early_init_result());
  void* fn = nullptr;
  EXPECT_EQ(CUDA_SUCCESS, cushare_early_proc_result(&fn));
  Dl_info i{};
  ASSERT_NE(0, dladdr(fn, &i));
  EXPECT_NE(nullptr, std::strstr(i.dli_fname, "libcushare.so")) << i.dli_fname;
  EXPECT_EQ(dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"), fn);
}

}  // namespace
