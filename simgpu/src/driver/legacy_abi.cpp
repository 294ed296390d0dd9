// The first ABIs of entry points whose parameters did not change when the driver gave them a _v2
// name (CUDA 3.2 and 4.0 changed 32-bit sizes and context-stack semantics around them, not these
// signatures): each runs today's ABI, with the first ABI's rule where it had another
// (cuDevicePrimaryCtxSetFlags). cuGetProcAddress hands them out for an old requested
// version, and binaries linked by name against an old cuda.h call them. The ABIs whose sizes or
// pointers were 32 bits are classified `legacy` in simgpu/driver_api_cuda13.txt instead.
#include "driver.h"

#define SIMGPU_LEGACY(ret, cname, sym) extern "C" SIMGPU_EXPORT ret cname __asm__(sym)

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuCtxCreate(CUcontext* pctx, unsigned flags, CUdevice dev), "cuCtxCreate");
CUresult simgpu_legacy_cuCtxCreate(CUcontext* pctx, unsigned flags, CUdevice dev) {
  return cuCtxCreate_v4(pctx, nullptr, flags, dev);
}

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuCtxDestroy(CUcontext ctx), "cuCtxDestroy");
CUresult simgpu_legacy_cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuCtxPopCurrent(CUcontext* pctx), "cuCtxPopCurrent");
CUresult simgpu_legacy_cuCtxPopCurrent(CUcontext* pctx) { return cuCtxPopCurrent_v2(pctx); }

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuCtxPushCurrent(CUcontext ctx), "cuCtxPushCurrent");
CUresult simgpu_legacy_cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuEventDestroy(CUevent e), "cuEventDestroy");
CUresult simgpu_legacy_cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuStreamDestroy(CUstream s), "cuStreamDestroy");
CUresult simgpu_legacy_cuStreamDestroy(CUstream s) { return cuStreamDestroy_v2(s); }

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned flags),
              "cuDevicePrimaryCtxSetFlags");
// The first ABI refused to change an active primary context's flags (the _v2 ABI lifted that).
CUresult simgpu_legacy_cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned flags) {
  unsigned current = 0;
  int active = 0;
  if (const CUresult r = cuDevicePrimaryCtxGetState(dev, &current, &active); r != CUDA_SUCCESS) return r;
  if (active) return CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE;
  return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

SIMGPU_LEGACY(CUresult, simgpu_legacy_cuMemHostRegister(void* p, size_t bytes, unsigned flags), "cuMemHostRegister");
CUresult simgpu_legacy_cuMemHostRegister(void* p, size_t bytes, unsigned flags) {
  return cuMemHostRegister_v2(p, bytes, flags);
}

// The profiler control calls: with no profiler attached (simgpu never has one) they have no
// effect and succeed, in a context (cudaProfiler.h: CUDA_SUCCESS, CUDA_ERROR_INVALID_CONTEXT).
CU_EXPORT CUresult cuProfilerStart() {
  API_ENTER();
  simgpu::Context* c;
  return simgpu::requireContext(&c);
}
CU_EXPORT CUresult cuProfilerStop() {
  API_ENTER();
  simgpu::Context* c;
  return simgpu::requireContext(&c);
}
