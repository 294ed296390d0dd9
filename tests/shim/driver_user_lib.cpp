// A library linked against the driver (as a tenant's own CUDA library is): loaded into another
// link-map namespace with dlmopen, it would bring a copy of libcuda there as a dependency, whose
// calls the shim in the base namespace would never see.
// SecondDriver.DlmopenOfAnyOtherLibraryIsRefused loads it so; the shim must refuse the load.
#include <cuda.h>

extern "C" __attribute__((visibility("default"))) CUresult cushare_test_driver_user_alloc(
    CUdeviceptr* p, size_t bytes) {
  return cuMemAlloc(p, bytes);
}
