// What simgpu's NVML answers for a function of NVIDIA's API that it does not model: every such
// function is a weak stub generated from nvml_api_cuda13.txt (gen_nvml_api.py) that lands here.
//
// Invariants: nothing a caller passed is ever written; the answer depends only on the
// initialisation state, the device handle and which pointers are null, in that order (NVML's own
// order: UNINITIALIZED, then INVALID_ARGUMENT, then NOT_SUPPORTED for a feature the device lacks).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "nvml_internal.h"

namespace simgpu::nvml {

int unmodelled(const char* name, const void* device, bool isDevice,
               std::initializer_list<const void*> required) noexcept {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (isDevice) {
    nvmlDevice_st* d = nullptr;
    const nvmlReturn_t r = checkDevice(static_cast<nvmlDevice_t>(const_cast<void*>(device)), &d);
    if (r != NVML_SUCCESS) return r;
  }
  for (const void* p : required) {
    if (p == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  }
  static const bool trace = [] {
    const char* v = std::getenv("SIMGPU_TRACE");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  if (trace) std::fprintf(stderr, "simgpu: %s is not modelled (NVML_ERROR_NOT_SUPPORTED)\n", name);
  return NVML_ERROR_NOT_SUPPORTED;
}

}  // namespace simgpu::nvml
