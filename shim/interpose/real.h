// The real driver and NVML behind the shim: loaded with dlopen (libcuda.so.1, and lazily
// libnvidia-ml.so.1), entry points resolved through the real dlsym on those handles, so the shim
// never calls one of its own wrappers by accident. Every pointer may be null (a symbol the
// installed driver lacks): callers check, and nothing ever calls through null.
#pragma once

#include <cuda.h>

#include <string>

#include "cushare/nvml_api.h"

namespace cushare::shim {

struct RealDriver {
  void* handle = nullptr;
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args) CUresult(*p_##sym) params = nullptr;
#include "hooks.def"
#undef CUSHARE_DRIVER_HOOK
  // Unhooked entry points the policy needs.
  CUresult (*p_cuCtxGetDevice)(CUdevice*) = nullptr;
  CUresult (*p_cuDeviceGetCount)(int*) = nullptr;
  CUresult (*p_cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*p_cuDeviceGetUuid_v2)(CUuuid*, CUdevice) = nullptr;
  CUresult (*p_cuDeviceGetUuid)(CUuuid*, CUdevice) = nullptr;  // the first ABI: a MIG device's GPU (optional)
  CUresult (*p_cuStreamIsCapturing)(CUstream, CUstreamCaptureStatus*) = nullptr;
  CUresult (*p_cuStreamIsCapturing_ptsz)(CUstream, CUstreamCaptureStatus*) = nullptr;
  CUresult (*p_cuDeviceGetMemPool)(CUmemoryPool*, CUdevice) = nullptr;
  CUresult (*p_cuMemPoolGetAttribute)(CUmemoryPool, CUmemPool_attribute, void*) = nullptr;
  CUresult (*p_cuGraphGetNodes)(CUgraph, CUgraphNode*, size_t*) = nullptr;
  CUresult (*p_cuGraphNodeGetType)(CUgraphNode, CUgraphNodeType*) = nullptr;
  CUresult (*p_cuGraphMemAllocNodeGetParams)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS*) = nullptr;
  CUresult (*p_cuGraphChildGraphNodeGetGraph)(CUgraphNode, CUgraph*) = nullptr;
  CUresult (*p_cuGraphNodeGetParams)(CUgraphNode, CUgraphNodeParams*) = nullptr;
  CUresult (*p_cuArrayGetMemoryRequirements)(CUDA_ARRAY_MEMORY_REQUIREMENTS*, CUarray, CUdevice) = nullptr;
  CUresult (*p_cuMipmappedArrayGetMemoryRequirements)(CUDA_ARRAY_MEMORY_REQUIREMENTS*, CUmipmappedArray,
                                                      CUdevice) = nullptr;
  CUresult (*p_cuArray3DGetDescriptor_v2)(CUDA_ARRAY3D_DESCRIPTOR*, CUarray) = nullptr;
  CUresult (*p_cuMipmappedArrayGetLevel)(CUarray*, CUmipmappedArray, unsigned) = nullptr;
  CUresult (*p_cuPointerGetAttribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*p_cuDevicePrimaryCtxGetState)(CUdevice, unsigned*, int*) = nullptr;
  CUresult (*p_cuStreamGetDevice)(CUstream, CUdevice*) = nullptr;
  CUresult (*p_cuDeviceGetDefaultMemPool)(CUmemoryPool*, CUdevice) = nullptr;
  CUresult (*p_cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
  // The pacer (launch.cpp): timing events on the tenant's streams, from its own thread.
  CUresult (*p_cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*p_cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*p_cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*p_cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*p_cuEventQuery)(CUevent) = nullptr;
  CUresult (*p_cuEventDestroy_v2)(CUevent) = nullptr;
  CUresult (*p_cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  CUresult (*p_cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*p_cuCtxGetStreamPriorityRange)(int*, int*) = nullptr;
  // The probe thread (probe_thread.cpp, through probe_driver.h): the runner's unhooked calls.
  CUresult (*p_cuCtxPushCurrent_v2)(CUcontext) = nullptr;
  CUresult (*p_cuCtxPopCurrent_v2)(CUcontext*) = nullptr;
  CUresult (*p_cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*p_cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*p_cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*p_cuMemcpyDtoHAsync_v2)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*p_cuMemsetD8_v2)(CUdeviceptr, unsigned char, size_t) = nullptr;
  CUresult (*p_cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*p_cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*p_cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*p_cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*p_cuMemPrefetchAsync_v2)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream) = nullptr;
};

struct RealNvml {
  void* handle = nullptr;
#define CUSHARE_NVML_HOOK(sym, params, args) nvmlReturn_t(*p_##sym) params = nullptr;
#include "nvml_hooks.def"
#undef CUSHARE_NVML_HOOK
  nvmlReturn_t (*p_nvmlDeviceGetUUID)(nvmlDevice_t, char*, unsigned) = nullptr;
};

// constinit (every pointer null until loaded): usable before any constructor runs (dlsym can be
// called that early). Inline accessors: they are on every hooked call.
extern RealDriver gRealDriver;
extern RealNvml gRealNvml;
inline RealDriver& realDriver() { return gRealDriver; }
inline RealNvml& realNvml() { return gRealNvml; }

// The real dlsym and dlvsym (the shim exports its own).
void* realDlsym(void* handle, const char* name) noexcept;
void* realDlvsym(void* handle, const char* name, const char* version) noexcept;

// Loads libcuda.so.1 and resolves every hooked and needed symbol. Idempotent.
bool loadRealDriver(std::string* error) noexcept;
// Whether the wrapper of the real entry point named `real` ("p_<symbol>") answers in a process
// the shim refused (a bad variable, no ledger): cuGetProcAddress does, once the real driver is
// loaded, so that the CUDA runtime finds the entry points and reports cuInit's refusal; refused
// otherwise, the runtime took a driver that resolves nothing for one too old
// (cudaErrorInsufficientDriver). Nothing runs on the device: cuInit stays refused.
bool resolvesWhenRefused(const char* real) noexcept;
// Loads libnvidia-ml.so.1 if present; false if NVML is not installed (the shim works without it).
bool loadRealNvml() noexcept;

// Lookup used by cuGetProcAddress and dlsym: the shim's wrapper for a real entry point, or null
// when the pointer is not one the shim hooks.
void* wrapperForReal(void* realFn) noexcept;
// The shim's wrapper for an exported symbol name, or null.
void* wrapperForSymbol(const char* name) noexcept;

}  // namespace cushare::shim
