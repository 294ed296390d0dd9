// Contexts: primary contexts (one per device, reference counted, what cudart uses) and created
// contexts, and the per-thread context stack. The stack is a fixed thread-local array so it is
// trivially destructible: cudart reads it during its exit-time teardown.
#include <pthread.h>

#include <mutex>
#include <set>

#include "driver.h"
#include "mps_client.h"

namespace simgpu {
namespace {
constexpr int kStackDepth = 32;
thread_local Context* tlsStack[kStackDepth];
thread_local int tlsDepth = 0;

std::mutex& ctxMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

// Live contexts per device (an active primary context counts one), under ctxMutex(). The first
// and the last are published in the host-wide state: NVML lists a process with a context on a
// device, as the real driver does, memory or not.
int liveContexts[kMaxDevices];
// A forked child has none of its parent's contexts (CUDA's rule): its count starts from zero, so
// its own first context on a device is published.
[[maybe_unused]] const int kForgetContextsInChild = pthread_atfork(nullptr, nullptr, [] {
  for (int& n : liveContexts) n = 0;
});
void contextLiveLocked(int dev, int delta) {
  const int before = liveContexts[dev];
  liveContexts[dev] += delta;
  if ((before == 0) != (liveContexts[dev] == 0) && drv().state)
    drv().state->setContext(hostDevice(dev), liveContexts[dev] != 0);
}

Context* newContext(int dev, bool primary, unsigned flags) {
  auto* c = new Context;
  c->device = dev;
  c->primary = primary;
  c->flags = flags;
  c->id = nextId();
  c->limits[CU_LIMIT_STACK_SIZE] = 1024;
  c->limits[CU_LIMIT_PRINTF_FIFO_SIZE] = 1 << 20;
  c->limits[CU_LIMIT_MALLOC_HEAP_SIZE] = 8 << 20;
  c->limits[CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT] = 2048;
  c->limits[CU_LIMIT_MAX_L2_FETCH_GRANULARITY] = 32;
  c->legacy = new Stream;
  c->legacy->ctx = c;
  c->legacy->id = nextId();
  c->streams.push_back(c->legacy);
  handleAdd(c, HandleType::kContext);
  return c;
}

// Frees what a context owns when it is destroyed or (primary) reset, after its queued work.
void releaseContextMemory(Context* c) {
  contextSync(c);
  std::vector<uintptr_t> bases;
  registryForEach([&](const Allocation& a) {
    if (a.ctx == c && (a.kind == MemKind::kDevice || a.kind == MemKind::kManaged)) bases.push_back(a.base);
  });
  for (uintptr_t b : bases) freeDevice(b);
}
}  // namespace

Context* currentContext() { return tlsDepth > 0 ? tlsStack[tlsDepth - 1] : nullptr; }

CUresult requireContext(Context** out) {
  Context* c = currentContext();
  if (!c || (c->primary && !c->active)) return CUDA_ERROR_INVALID_CONTEXT;
  *out = c;
  return CUDA_SUCCESS;
}

void setCurrent(Context* c) {
  if (tlsDepth == 0) {
    if (!c) return;
    tlsDepth = 1;
  }
  tlsStack[tlsDepth - 1] = c;
  if (!c) --tlsDepth;
}

Context* primaryContext(int dev) {
  std::lock_guard g(ctxMutex());
  Context*& p = drv().primary[dev];
  if (!p) p = newContext(dev, true, 0);
  return p;
}

CUresult retainPrimary(int dev, Context** out) {
  CU_TRY(mpsContextStatus());  // an MPS client the daemon refused gets no context
  Context* p = primaryContext(dev);
  std::lock_guard g(ctxMutex());
  ++p->refs;
  if (!p->active) contextLiveLocked(dev, +1);
  p->active = true;
  *out = p;
  return CUDA_SUCCESS;
}

}  // namespace simgpu

using namespace simgpu;

CU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  API_ENTER(pctx, dev);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Context* c;
  CU_TRY(retainPrimary(dev, &c));
  *pctx = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  API_ENTER(dev);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Context* p = primaryContext(dev);
  bool reset = false;
  {
    std::lock_guard g(ctxMutex());
    if (p->refs <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (--p->refs == 0) {
      if (p->active) contextLiveLocked(dev, -1);
      p->active = false;
      reset = true;
    }
  }
  if (reset) releaseContextMemory(p);
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuDevicePrimaryCtxRelease(CUdevice dev) __asm__("cuDevicePrimaryCtxRelease");
CUresult simgpu_cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

CU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  API_ENTER(dev);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Context* p = primaryContext(dev);
  releaseContextMemory(p);
  // No longer current to the calling thread (cudaDeviceReset's caller), so the runtime's next
  // call finds no context and retains the primary context again, as it does on a real driver.
  if (currentContext() == p) setCurrent(nullptr);
  std::lock_guard g(ctxMutex());
  p->refs = 0;
  if (p->active) contextLiveLocked(dev, -1);
  p->active = false;
  p->flags = 0;
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuDevicePrimaryCtxReset(CUdevice dev) __asm__("cuDevicePrimaryCtxReset");
CUresult simgpu_cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }

CU_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  API_ENTER(dev, flags, active);
  if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Context* p = primaryContext(dev);
  std::lock_guard g(ctxMutex());
  *flags = p->flags;
  *active = p->active ? 1 : 0;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
  API_ENTER(dev, flags);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (flags & ~0x1fu) return CUDA_ERROR_INVALID_VALUE;
  Context* p = primaryContext(dev);
  std::lock_guard g(ctxMutex());
  p->flags = flags;
  return CUDA_SUCCESS;
}

namespace {
CUresult createContext(CUcontext* pctx, unsigned flags, CUdevice dev) {
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  CU_TRY(mpsContextStatus());
  if (tlsDepth >= kStackDepth) return CUDA_ERROR_OUT_OF_MEMORY;
  Context* c = newContext(dev, false, flags);
  c->refs = 1;
  c->active = true;
  {
    std::lock_guard g(ctxMutex());
    contextLiveLocked(dev, +1);
  }
  // A created context is pushed onto the calling thread's stack.
  tlsStack[tlsDepth++] = c;
  *pctx = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuCtxCreate_v4(CUcontext* pctx, CUctxCreateParams* params, unsigned int flags, CUdevice dev) {
  API_ENTER(pctx, params, flags, dev);
  // Execution affinity and CIG parameters describe partitions simgpu does not model; accept none.
  if (params && (params->numExecAffinityParams > 0 || params->cigParams)) return CUDA_ERROR_NOT_SUPPORTED;
  return createContext(pctx, flags, dev);
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* p, int n, unsigned flags,
                                                      CUdevice dev) __asm__("cuCtxCreate_v3");
CUresult simgpu_cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* p, int n, unsigned flags, CUdevice dev) {
  API_ENTER(pctx, p, n, flags, dev);
  if (n > 0) return CUDA_ERROR_NOT_SUPPORTED;
  return createContext(pctx, flags, dev);
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuCtxCreate_v2(CUcontext* pctx, unsigned flags, CUdevice dev) __asm__("cuCtxCreate_v2");
CUresult simgpu_cuCtxCreate_v2(CUcontext* pctx, unsigned flags, CUdevice dev) {
  API_ENTER(pctx, flags, dev);
  return createContext(pctx, flags, dev);
}

CU_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
  API_ENTER(ctx);
  Context* c = handleGet<Context>(ctx, HandleType::kContext);
  if (!c || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
  contextSync(c);
  releaseContextMemory(c);
  // Remove it from this thread's stack; other threads holding it see an invalid handle.
  for (int i = 0; i < tlsDepth; ++i)
    if (tlsStack[i] == c) {
      for (int j = i; j + 1 < tlsDepth; ++j) tlsStack[j] = tlsStack[j + 1];
      --tlsDepth;
      --i;
    }
  handleRemove(c);
  {
    std::lock_guard g(ctxMutex());
    contextLiveLocked(c->device, -1);
  }
  // The Context object itself is leaked: a stale handle must stay readable, never reused.
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  API_ENTER(ctx);
  Context* c = handleGet<Context>(ctx, HandleType::kContext);
  if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  if (tlsDepth >= kStackDepth) return CUDA_ERROR_OUT_OF_MEMORY;
  tlsStack[tlsDepth++] = c;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
  API_ENTER(pctx);
  if (tlsDepth == 0) return CUDA_ERROR_INVALID_CONTEXT;
  Context* c = tlsStack[--tlsDepth];
  if (pctx) *pctx = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  API_ENTER(ctx);
  if (ctx && !handleIs(ctx, HandleType::kContext)) return CUDA_ERROR_INVALID_CONTEXT;
  setCurrent(reinterpret_cast<Context*>(ctx));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetCurrent(CUcontext* pctx) {
  API_ENTER(pctx);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  *pctx = reinterpret_cast<CUcontext>(currentContext());
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetDevice(CUdevice* dev) {
  API_ENTER(dev);
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  *dev = c->device;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetDevice_v2(CUdevice* dev, CUcontext ctx) {
  API_ENTER(dev, ctx);
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  if (ctx) {
    c = handleGet<Context>(ctx, HandleType::kContext);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  } else {
    CU_TRY(requireContext(&c));
  }
  *dev = c->device;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetFlags(unsigned int* flags) {
  API_ENTER(flags);
  if (!flags) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  *flags = c->flags;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxSetFlags(unsigned int flags) {
  API_ENTER(flags);
  Context* c;
  CU_TRY(requireContext(&c));
  c->flags = flags;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long* id) {
  API_ENTER(ctx, id);
  if (!id) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  if (ctx) {
    c = handleGet<Context>(ctx, HandleType::kContext);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  } else {
    CU_TRY(requireContext(&c));
  }
  *id = c->id;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int* version) {
  API_ENTER(ctx, version);
  if (!version) return CUDA_ERROR_INVALID_VALUE;
  *version = 3020;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxSynchronize() {
  API_ENTER();
  Context* c;
  CU_TRY(requireContext(&c));
  return contextSync(c);
}

CU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  API_ENTER(ctx);
  Context* c;
  if (ctx) {
    c = handleGet<Context>(ctx, HandleType::kContext);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
  } else {
    CU_TRY(requireContext(&c));
  }
  return contextSync(c);
}

CU_EXPORT CUresult cuCtxGetLimit(size_t* value, CUlimit limit) {
  API_ENTER(value, limit);
  if (!value || limit < 0 || limit >= 16) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  *value = c->limits[limit];
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
  API_ENTER(limit, value);
  if (limit < 0 || limit >= CU_LIMIT_MAX) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  c->limits[limit] = value;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache* cfg) {
  API_ENTER(cfg);
  if (!cfg) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  *cfg = c->cacheConfig;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache cfg) {
  API_ENTER(cfg);
  Context* c;
  CU_TRY(requireContext(&c));
  c->cacheConfig = cfg;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetSharedMemConfig(CUsharedconfig* cfg) {
  API_ENTER(cfg);
  if (!cfg) return CUDA_ERROR_INVALID_VALUE;
  *cfg = CU_SHARED_MEM_CONFIG_FOUR_BYTE_BANK_SIZE;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxSetSharedMemConfig(CUsharedconfig cfg) {
  API_ENTER(cfg);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  API_ENTER(least, greatest);
  // As on real devices: 0 is the lowest (default) priority, -5 the highest; lower is more urgent.
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxResetPersistingL2Cache() {
  API_ENTER();
  return CUDA_SUCCESS;
}

namespace {
std::mutex& peerMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::set<std::pair<unsigned long long, unsigned long long>>& peerEnabled() {
  static auto* s = new std::set<std::pair<unsigned long long, unsigned long long>>;
  return *s;
}
}  // namespace

CU_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
  API_ENTER(peer, flags);
  Context* c;
  CU_TRY(requireContext(&c));
  Context* p = handleGet<Context>(peer, HandleType::kContext);
  if (!p) return CUDA_ERROR_INVALID_CONTEXT;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (p->device == c->device) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard g(peerMutex());
  if (!peerEnabled().insert({c->id, p->id}).second) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peer) {
  API_ENTER(peer);
  Context* c;
  CU_TRY(requireContext(&c));
  Context* p = handleGet<Context>(peer, HandleType::kContext);
  if (!p) return CUDA_ERROR_INVALID_CONTEXT;
  std::lock_guard g(peerMutex());
  if (peerEnabled().erase({c->id, p->id}) == 0) return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxGetExecAffinity(CUexecAffinityParam* p, CUexecAffinityType type) {
  API_ENTER(p, type);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_EXEC_AFFINITY_TYPE_SM_COUNT) return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
  p->type = type;
  p->param.smCount.val = static_cast<unsigned>(mpsVisibleSms(static_cast<int>(drv().cfg.smCount)));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuCtxAttach(CUcontext* pctx, unsigned int flags) {
  API_ENTER(pctx, flags);
  return CUDA_ERROR_NOT_SUPPORTED;
}

CU_EXPORT CUresult cuCtxDetach(CUcontext ctx) {
  API_ENTER(ctx);
  return cuCtxDestroy_v2(ctx);
}
