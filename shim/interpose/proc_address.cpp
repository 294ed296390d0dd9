// cuInit (the point where the shim learns the devices) and road 2, cuGetProcAddress: the real
// driver resolves the request, so the ABI, the version rule and the per-thread stream variant are
// exactly the driver's; the shim only swaps a hooked real function for its wrapper.
#include <cstring>

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

namespace {
// The driver's answer with the shim's wrapper for a hooked entry point. cuInit is the shim's by
// name too, whatever address the driver hands out for it: a process the shim refused answers
// cuGetProcAddress (the runtime then reports the refusal), and must never get the real cuInit.
void swapForWrapper(const char* symbol, void** pfn) noexcept {
  if (void* w = wrapperForReal(*pfn)) {
    *pfn = w;
  } else if (symbol != nullptr && std::strcmp(symbol, "cuInit") == 0) {
    *pfn = wrapperForReal(reinterpret_cast<void*>(realDriver().p_cuInit));
  }
}
}  // namespace

CUresult hook_cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult* status) noexcept {
  const CUresult r = realDriver().p_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
  if (r == CUDA_SUCCESS && pfn && *pfn) swapForWrapper(symbol, pfn);
  return r;
}

CUresult hook_cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) noexcept {
  const CUresult r = realDriver().p_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
  if (r == CUDA_SUCCESS && pfn && *pfn) swapForWrapper(symbol, pfn);
  return r;
}

}  // namespace cushare::shim
