// Forced first into the shim's copy of the probe runner (cuda_kernels/host/probe_runner.cpp,
// compiled into libcushare.so with -include): the runner's driver calls that the shim does not
// hook go to the real driver's entry points (real.h), so they never resolve to nothing; the hooked
// ones (cuMemAlloc, cuMemFree, cuStreamSynchronize, ...) bind to the shim's own wrappers
// (-Bsymbolic): the probes' memory is charged to the tenant. Launches go to probeLaunch: they wait
// at the tenant's gate like its kernels, then run unmetered (docs/probes.md, "In the shim").
#pragma once

#include <cuda.h>

#include "interpose/real.h"
#include "policy/probe_thread.h"

#define CUSHARE_PROBE_REAL(fn, ...) \
  (::cushare::shim::realDriver().p_##fn ? ::cushare::shim::realDriver().p_##fn(__VA_ARGS__) : CUDA_ERROR_NOT_SUPPORTED)

#define cuCtxGetCurrent(...) CUSHARE_PROBE_REAL(cuCtxGetCurrent, __VA_ARGS__)
#define cuCtxGetDevice(...) CUSHARE_PROBE_REAL(cuCtxGetDevice, __VA_ARGS__)
#define cuCtxPushCurrent_v2(...) CUSHARE_PROBE_REAL(cuCtxPushCurrent_v2, __VA_ARGS__)
#define cuCtxPopCurrent_v2(...) CUSHARE_PROBE_REAL(cuCtxPopCurrent_v2, __VA_ARGS__)
#define cuDeviceGetAttribute(...) CUSHARE_PROBE_REAL(cuDeviceGetAttribute, __VA_ARGS__)
#define cuGetErrorName(...) CUSHARE_PROBE_REAL(cuGetErrorName, __VA_ARGS__)
#define cuGetErrorString(...) CUSHARE_PROBE_REAL(cuGetErrorString, __VA_ARGS__)
#define cuMemcpyDtoHAsync_v2(...) CUSHARE_PROBE_REAL(cuMemcpyDtoHAsync_v2, __VA_ARGS__)
#define cuMemsetD8_v2(...) CUSHARE_PROBE_REAL(cuMemsetD8_v2, __VA_ARGS__)
#define cuMemsetD8Async(...) CUSHARE_PROBE_REAL(cuMemsetD8Async, __VA_ARGS__)
#define cuModuleGetFunction(...) CUSHARE_PROBE_REAL(cuModuleGetFunction, __VA_ARGS__)
#define cuModuleLoadData(...) CUSHARE_PROBE_REAL(cuModuleLoadData, __VA_ARGS__)
#define cuModuleUnload(...) CUSHARE_PROBE_REAL(cuModuleUnload, __VA_ARGS__)
#define cuPointerGetAttribute(...) CUSHARE_PROBE_REAL(cuPointerGetAttribute, __VA_ARGS__)
#define cuLaunchKernel(...) ::cushare::shim::probeLaunch(__VA_ARGS__)
