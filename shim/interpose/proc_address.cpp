// cuInit (the point where the shim learns the devices) and road 2, cuGetProcAddress: the real
// driver resolves the request, so the ABI, the version rule and the per-thread stream variant are
// exactly the driver's; the shim only swaps a hooked real function for its wrapper.
#include "interpose/hooks.h"
#include "interpose/real.h"
#include "runtime/state.h"

namespace cushare::shim {

CUresult hook_cuInit(unsigned int flags) noexcept {
  // The driver reads CUDA_MPS_* here: the tenant's settings again, whatever the program did to
  // its environment since the shim's constructor.
  if (const CUresult p = prepareDriverInit(); p != CUDA_SUCCESS) return p;
  const CUresult r = realDriver().p_cuInit(flags);
  if (r != CUDA_SUCCESS) return r;
  return initDevices();  // fails closed: a bad limit for these devices makes cuInit fail
}

CUresult hook_cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult* status) noexcept {
  const CUresult r = realDriver().p_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
  if (r == CUDA_SUCCESS && pfn && *pfn)
    if (void* w = wrapperForReal(*pfn)) *pfn = w;
  return r;
}

CUresult hook_cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) noexcept {
  const CUresult r = realDriver().p_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
  if (r == CUDA_SUCCESS && pfn && *pfn)
    if (void* w = wrapperForReal(*pfn)) *pfn = w;
  return r;
}

}  // namespace cushare::shim
