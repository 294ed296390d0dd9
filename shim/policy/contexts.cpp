// Context teardown: destroying a context, resetting a primary context (cudaDeviceReset) or
// releasing its last reference frees everything the context owned, without a free call per
// allocation. After each, the shim asks the driver which of its counted allocations still exist
// and returns the charges of the others (memory.cpp), then settles the pools (pools.cpp).
#include "interpose/hooks.h"
#include "interpose/real.h"
#include "policy/probe_thread.h"
#include "runtime/state.h"

namespace cushare::shim {

// memory.cpp, pools.cpp
void settleFreedAllocations() noexcept;
void settleAllPools() noexcept;
void pacerForgetContexts() noexcept;  // pacer.cpp
void burstForgetContexts(CUcontext ctx, int ordinal) noexcept;  // memory.cpp

namespace {

// gone: the context was destroyed (its streams with it: ctx, or the primary context of dev), so its
// burst prefetch stream is forgotten (memory.cpp); after the driver's call, so that none is made
// again in the dying context.
CUresult afterTeardown(CUresult r, bool gone = false, CUcontext ctx = nullptr, CUdevice dev = -1) noexcept {
  if (r != CUDA_SUCCESS) return r;
  if (gone) burstForgetContexts(ctx, dev);
  settleFreedAllocations();
  settleAllPools();
  return r;
}

// A primary context's release frees its memory only when it drops the last reference.
CUresult afterRelease(CUresult r, CUdevice dev) noexcept {
  if (r != CUDA_SUCCESS) return r;
  unsigned flags = 0;
  int active = 1;
  RealDriver& d = realDriver();
  if (d.p_cuDevicePrimaryCtxGetState &&
      d.p_cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS && !active)
    pacerForgetContexts(), burstForgetContexts(nullptr, dev);  // the context is gone: its streams too
  return afterTeardown(r);
}

}  // namespace

CUresult hook_cuCtxDestroy(CUcontext ctx) noexcept {
  pacerForgetContexts();
  return afterTeardown(realDriver().p_cuCtxDestroy(ctx), /*gone=*/true, ctx);
}
CUresult hook_cuCtxDestroy_v2(CUcontext ctx) noexcept {
  pacerForgetContexts();
  return afterTeardown(realDriver().p_cuCtxDestroy_v2(ctx), /*gone=*/true, ctx);
}
// The probe thread is kept off the context across the program's call, and lets go of its own
// reference (ProbeContextGuard, probe_thread.h): a reset finds no probe using the context, and the
// program's last release destroys it as the program asked.
CUresult hook_cuDevicePrimaryCtxReset(CUdevice dev) noexcept {
  ProbeContextGuard probes(dev);
  probes.letGoBeforeReset();
  pacerForgetContexts();
  return afterTeardown(realDriver().p_cuDevicePrimaryCtxReset(dev), /*gone=*/true, nullptr, dev);
}
CUresult hook_cuDevicePrimaryCtxReset_v2(CUdevice dev) noexcept {
  ProbeContextGuard probes(dev);
  probes.letGoBeforeReset();
  pacerForgetContexts();
  return afterTeardown(realDriver().p_cuDevicePrimaryCtxReset_v2(dev), /*gone=*/true, nullptr, dev);
}
CUresult hook_cuDevicePrimaryCtxRelease(CUdevice dev) noexcept {
  ProbeContextGuard probes(dev);
  pacerForgetContexts();
  const CUresult r = realDriver().p_cuDevicePrimaryCtxRelease(dev);
  probes.afterRelease(r);
  return afterRelease(r, dev);
}
CUresult hook_cuDevicePrimaryCtxRelease_v2(CUdevice dev) noexcept {
  ProbeContextGuard probes(dev);
  const CUresult r = realDriver().p_cuDevicePrimaryCtxRelease_v2(dev);
  probes.afterRelease(r);
  return afterRelease(r, dev);
}

}  // namespace cushare::shim
