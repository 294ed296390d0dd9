// A library whose constructor calls the driver, as a C++ library with a global object that
// touches CUDA does. Linked into shim_early_call_test as an ordinary dependency, it is
// initialised before the preloaded libcushare.so (glibc runs the constructors of a program's
// dependencies before those of LD_PRELOAD objects, which nothing depends on), so the hooked call
// reaches the shim before any of the shim's own dynamic initialisers has run. The shim must answer
// it (DESIGN: everything usable before constructors), never crash the process.
#include <cuda.h>

namespace {
CUresult gInitResult = CUDA_ERROR_UNKNOWN;
CUresult gProcResult = CUDA_ERROR_UNKNOWN;
void* gProcFn = nullptr;

__attribute__((constructor)) void callTheDriverEarly() {
  gInitResult = cuInit(0);
  CUdriverProcAddressQueryResult st;
  gProcResult = cuGetProcAddress("cuMemAlloc", &gProcFn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st);
}
}  // namespace

extern "C" __attribute__((visibility("default"))) CUresult cushare_early_init_result() {
  return gInitResult;
}
extern "C" __attribute__((visibility("default"))) CUresult cushare_early_proc_result(void** fn) {
  *fn = gProcFn;
  return gProcResult;
}
