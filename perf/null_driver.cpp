// A null CUDA driver for measuring the shim's own cost: every call does the least a driver could
// (a bump-pointer allocation, a no-op launch), so what the shim adds is not lost in the noise of
// simgpu's real work (mmap, worker threads). Only the entry points shim_bench and the shim use.
#include <cuda.h>

#include <atomic>
#include <cstring>

#define NULL_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
std::atomic<CUdeviceptr> gNext{1ull << 40};
thread_local CUcontext tCtx = nullptr;
int gCtxStorage;
int gFnStorage;
int gModStorage;
int gStreamStorage;
}  // namespace

NULL_EXPORT CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuDeviceGet(CUdevice* d, int o) {
  *d = o;
  return o == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
NULL_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid* u, CUdevice) {
  std::memset(u->bytes, 0x42, sizeof u->bytes);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  *c = reinterpret_cast<CUcontext>(&gCtxStorage);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuCtxSetCurrent(CUcontext c) {
  tCtx = c;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
  if (!tCtx) return CUDA_ERROR_INVALID_CONTEXT;
  *d = 0;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  *p = gNext.fetch_add((n + 255) & ~size_t{255}, std::memory_order_relaxed);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuMemFree_v2(CUdeviceptr) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuMemGetInfo_v2(size_t* f, size_t* t) {
  *f = *t = 80ull << 30;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuModuleLoadData(CUmodule* m, const void*) {
  *m = reinterpret_cast<CUmodule>(&gModStorage);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char*) {
  *f = reinterpret_cast<CUfunction>(&gFnStorage);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuStreamCreate(CUstream* s, unsigned) {
  *s = reinterpret_cast<CUstream>(&gStreamStorage);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuStreamSynchronize(CUstream) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**) {
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void**, void**) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                               unsigned, unsigned, CUstream, void**) {
  return CUDA_SUCCESS;
}
// Timing events for the shim's pacer: complete at once, no time between them.
int gEventStorage;
NULL_EXPORT CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = tCtx;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuEventCreate(CUevent* e, unsigned) {
  *e = reinterpret_cast<CUevent>(&gEventStorage);
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuEventRecord(CUevent, CUstream) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuEventQuery(CUevent) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuEventDestroy_v2(CUevent) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuEventElapsedTime(float* ms, CUevent, CUevent) {
  *ms = 0;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuStreamDestroy_v2(CUstream) { return CUDA_SUCCESS; }
NULL_EXPORT CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus* s) {
  *s = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
NULL_EXPORT CUresult cuGetProcAddress_v2(const char*, void** p, int, cuuint64_t, CUdriverProcAddressQueryResult* s) {
  *p = nullptr;
  if (s) *s = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_SUCCESS;
}
