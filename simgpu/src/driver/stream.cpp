// Streams, events, host functions and the engine's single entry point, submit().
// See driver.h for the execution model: work runs synchronously when submitted, unless its
// stream is capturing, in which case it is recorded into the capture graph (graph.cpp).
#include <pthread.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <thread>

#include "driver.h"

namespace simgpu {
namespace {
thread_local bool tlsPerThreadDefault = false;
thread_local Stream* tlsPerThreadStream[kMaxDevices];
}  // namespace

PerThreadStreamScope::PerThreadStreamScope() : prev(tlsPerThreadDefault) { tlsPerThreadDefault = true; }
PerThreadStreamScope::~PerThreadStreamScope() { tlsPerThreadDefault = prev; }

CUresult resolveStream(CUstream h, Stream** out) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(h);
  if (v == 0 || v == reinterpret_cast<uintptr_t>(CU_STREAM_LEGACY) ||
      v == reinterpret_cast<uintptr_t>(CU_STREAM_PER_THREAD)) {
    Context* c;
    CU_TRY(requireContext(&c));
    const bool perThread = v == reinterpret_cast<uintptr_t>(CU_STREAM_PER_THREAD) || (v == 0 && tlsPerThreadDefault);
    if (!perThread) {
      *out = c->legacy;
      return CUDA_SUCCESS;
    }
    Stream*& s = tlsPerThreadStream[c->device];
    if (!s || s->ctx != c) {
      s = new Stream;  // leaked with the thread: it may be referenced by recorded events
      s->ctx = c;
      s->id = nextId();
      s->flags = 0;  // the per-thread default stream synchronises with the legacy stream
      streamRegister(s);
    }
    *out = s;
    return CUDA_SUCCESS;
  }
  Stream* s = handleGet<Stream>(h, HandleType::kStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  *out = s;
  return CUDA_SUCCESS;
}

namespace {
std::mutex& progressMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}
std::condition_variable& progressCv() {
  static auto* cv = new std::condition_variable;
  return *cv;
}
// Bumped in a forked child: the parent's worker threads do not exist there.
std::atomic<int> gForkGen{0};
[[maybe_unused]] const int kAtFork = pthread_atfork(nullptr, nullptr, [] { gForkGen.fetch_add(1); });

void workerLoop(Stream* s) {
  for (;;) {
    std::function<void()> f;
    {
      std::unique_lock l(s->qmu);
      s->qcv.wait(l, [s] { return !s->queue.empty(); });
      f = std::move(s->queue.front());
      s->queue.pop_front();
    }
    f();
    {
      std::lock_guard l(progressMutex());
      const uint64_t n = s->completed.load(std::memory_order_relaxed) + 1;
      s->doneAt[n % Stream::kDoneRing].store(s->lastDoneNs.load(std::memory_order_relaxed), std::memory_order_relaxed);
      s->completed.store(n, std::memory_order_release);
    }
    progressCv().notify_all();
  }
}

// Caller holds s->qmu.
void ensureWorker(Stream* s) {
  const int gen = gForkGen.load();
  if (s->workerGen == gen) return;
  if (s->workerGen != -1) {
    // A forked child: the parent's queue and counters describe work this process will never run.
    s->queue.clear();
    s->completed.store(s->submitted);
  }
  s->workerGen = gen;
  std::thread(workerLoop, s).detach();
}

uint64_t enqueue(Stream* s, std::function<void()> f) {
  std::lock_guard l(s->qmu);
  ensureWorker(s);
  s->queue.push_back(std::move(f));
  const uint64_t seq = ++s->submitted;
  s->qcv.notify_one();
  return seq;
}

uint64_t lastSubmitted(Stream* s) {
  std::lock_guard l(s->qmu);
  return s->submitted;
}

// Queues on s a wait until `other` has completed operation `seq`.
void enqueueWaitFor(Stream* s, Stream* other, uint64_t seq) {
  if (other == s || other->completed.load(std::memory_order_acquire) >= seq) return;
  const uint64_t t0 = deviceNowNs();
  enqueue(s, [s, other, seq, t0] {
    streamExecBegin(s, std::max(t0, s->lastDoneNs.load(std::memory_order_relaxed)));
    waitStream(other, seq);
    // Where the awaited operation ended: this stream continues there (not where the other stream
    // got to since, which a waiter woken late would otherwise wait for too: two kernels meant to
    // run side by side then ran one after the other). Where the other stream has completed a ring
    // of operations since, its entry is reused: then (later) where the other stream is now.
    uint64_t at;
    {
      std::lock_guard l(progressMutex());
      at = other->completed.load(std::memory_order_relaxed) < seq + Stream::kDoneRing
               ? other->doneAt[seq % Stream::kDoneRing].load(std::memory_order_relaxed)
               : other->lastDoneNs.load(std::memory_order_acquire);
    }
    streamPositionAtLeast(at);
    s->lastDoneNs.store(streamPositionNs(), std::memory_order_release);
  });
}

// The legacy stream waits for all blocking streams of its context, and they wait for it.
void implicitOrder(Stream* s) {
  Context* c = s->ctx;
  if (s == c->legacy) {
    std::vector<Stream*> streams;
    {
      std::lock_guard l(c->streamsMu);
      streams = c->streams;
    }
    for (Stream* b : streams)
      if (b != s && b->blocking()) enqueueWaitFor(s, b, lastSubmitted(b));
  } else if (s->blocking()) {
    enqueueWaitFor(s, c->legacy, lastSubmitted(c->legacy));
  }
}
}  // namespace

void streamRegister(Stream* s) {
  std::lock_guard l(s->ctx->streamsMu);
  s->ctx->streams.push_back(s);
}

void waitStream(Stream* s, uint64_t seq) {
  std::unique_lock l(progressMutex());
  progressCv().wait(l, [s, seq] { return s->completed.load(std::memory_order_acquire) >= seq; });
}

CUresult submit(Stream* s, Op&& op, uint64_t* seq) {
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return captureRecord(s, std::move(op));
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_INVALIDATED) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  // Work on the legacy stream while another stream captures in global mode is an implicit
  // dependency the real driver refuses.
  if (s == s->ctx->legacy && anyGlobalCaptureActive()) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  implicitOrder(s);
  auto run = std::move(op.run);
  const uint64_t t0 = deviceNowNs();
  const uint64_t n = enqueue(s, [s, t0, run = std::move(run)] {
    // The operation starts on the device when it was submitted or when the stream's previous
    // one ended, whichever is later; a kernel moves the position to its modelled end.
    streamExecBegin(s, std::max(t0, s->lastDoneNs.load(std::memory_order_relaxed)));
    const CUresult r = run ? run() : CUDA_SUCCESS;
    s->lastDoneNs.store(streamPositionNs(), std::memory_order_release);
    if (r != CUDA_SUCCESS) {
      std::lock_guard l(s->qmu);
      if (s->error == CUDA_SUCCESS) s->error = r;
    }
  });
  if (seq) *seq = n;
  return CUDA_SUCCESS;
}

CUresult submitAndWait(Stream* s, Op&& op) {
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) {
    // A synchronous call on a capturing stream is illegal and ends the capture's validity.
    s->captureStatus = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  auto result = std::make_shared<std::atomic<CUresult>>(CUDA_SUCCESS);
  auto run = std::move(op.run);
  op.run = [run = std::move(run), result] {
    const CUresult r = run ? run() : CUDA_SUCCESS;
    result->store(r);
    return CUDA_SUCCESS;
  };
  uint64_t seq = 0;
  CU_TRY(submit(s, std::move(op), &seq));
  waitStream(s, seq);
  return result->load();
}

CUresult streamSync(Stream* s) {
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) {
    // Synchronising a capturing stream is illegal and invalidates the capture.
    s->captureStatus = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  waitStream(s, lastSubmitted(s));
  poolsOnSync(s->ctx->device);
  std::lock_guard l(s->qmu);
  const CUresult r = s->error;
  s->error = CUDA_SUCCESS;
  return r;
}

CUresult contextSync(Context* c) {
  if (anyGlobalCaptureActive()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  std::vector<Stream*> streams;
  {
    std::lock_guard l(c->streamsMu);
    streams = c->streams;
  }
  CUresult first = CUDA_SUCCESS;
  for (Stream* s : streams) {
    if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) continue;
    waitStream(s, lastSubmitted(s));
    std::lock_guard l(s->qmu);
    if (first == CUDA_SUCCESS) first = s->error;
    s->error = CUDA_SUCCESS;
  }
  poolsOnSync(c->device);
  return first;
}

}  // namespace simgpu

using namespace simgpu;

// ---- streams ----
namespace {
CUresult createStream(CUstream* ph, unsigned flags, int priority) {
  if (!ph || (flags & ~1u)) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  auto* s = new Stream;
  s->ctx = c;
  s->flags = flags;
  s->priority = priority < -5 ? -5 : (priority > 0 ? 0 : priority);  // clamped, as documented
  s->id = nextId();
  streamRegister(s);
  handleAdd(s, HandleType::kStream);
  *ph = reinterpret_cast<CUstream>(s);
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuStreamCreate(CUstream* ph, unsigned int flags) {
  API_ENTER(ph, flags);
  return createStream(ph, flags, 0);
}

CU_EXPORT CUresult cuStreamCreateWithPriority(CUstream* ph, unsigned int flags, int priority) {
  API_ENTER(ph, flags, priority);
  return createStream(ph, flags, priority);
}

CU_EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
  API_ENTER(h);
  Stream* s = handleGet<Stream>(h, HandleType::kStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  handleRemove(s);
  // Leaked: events recorded on it may still name it.
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetPriority(CUstream h, int* priority) {
  API_ENTER(h, priority);
  if (!priority) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *priority = s->priority;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetFlags(CUstream h, unsigned int* flags) {
  API_ENTER(h, flags);
  if (!flags) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *flags = s->flags;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetId(CUstream h, unsigned long long* id) {
  API_ENTER(h, id);
  if (!id) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *id = s->id;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetDevice(CUstream h, CUdevice* dev) {
  API_ENTER(h, dev);
  if (!dev) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *dev = s->ctx->device;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext* pctx) {
  API_ENTER(h, pctx);
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *pctx = reinterpret_cast<CUcontext>(s->ctx);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetCtx_v2(CUstream h, CUcontext* pctx, CUgreenCtx* pGreen) {
  API_ENTER(h, pctx, pGreen);
  if (!pctx || !pGreen) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *pctx = reinterpret_cast<CUcontext>(s->ctx);
  *pGreen = nullptr;
  return CUDA_SUCCESS;
}

// simgpu has no green contexts (cuGreenCtxCreate is not modelled): every stream, and every special
// stream under the current context, belongs to a regular context, for which the driver answers
// success and NULL (cuda.h). cuBLAS from 13.5.1.27 and cuDNN from 9.23.2.1 ask this as a handle is
// created or set to a stream, and fail to start on anything but success.
CU_EXPORT CUresult cuStreamGetGreenCtx(CUstream h, CUgreenCtx* phCtx) {
  API_ENTER(h, phCtx);
  if (!phCtx) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *phCtx = nullptr;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamQuery(CUstream h) {
  API_ENTER(h);
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  std::lock_guard l(s->qmu);
  return s->completed.load(std::memory_order_acquire) >= s->submitted ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CU_EXPORT CUresult cuStreamSynchronize(CUstream h) {
  API_ENTER(h);
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  return streamSync(s);
}

CU_EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags) {
  API_ENTER(h, ev, flags);
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  Event* e = handleGet<Event>(ev, HandleType::kEvent);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
  if (e->captureGraph) {
    // Fork/join of a capture: the waiting stream joins the capture with the event's frontier.
    if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_NONE) {
      s->captureStatus = CU_STREAM_CAPTURE_STATUS_ACTIVE;
      s->captureGraph = e->captureGraph;
      s->captureDeps = e->captureDeps;
      s->captureMode = CU_STREAM_CAPTURE_MODE_RELAXED;
      s->captureOrigin = e->captureOrigin;
      captureJoin(e->captureGraph, s);
    } else if (s->captureGraph == e->captureGraph) {
      for (GraphNode* n : e->captureDeps) s->captureDeps.push_back(n);
    } else {
      return CUDA_ERROR_STREAM_CAPTURE_MERGE;
    }
    return CUDA_SUCCESS;
  }
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return CUDA_SUCCESS;  // outside work is already ordered
  if (e->stream) enqueueWaitFor(s, e->stream, e->seq);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void* userData) {
  API_ENTER(h, fn, userData);
  if (!fn) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  Op op;
  op.type = Op::kHost;
  op.host.fn = fn;
  op.host.userData = userData;
  op.run = [fn, userData] {
    fn(userData);
    streamPositionAtLeast(deviceNowNs());  // the stream waited for the host function
    return CUDA_SUCCESS;
  };
  return submit(s, std::move(op));
}

CU_EXPORT CUresult cuStreamAddCallback(CUstream h, CUstreamCallback cb, void* userData, unsigned int flags) {
  API_ENTER(h, cb, userData, flags);
  if (!cb || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  Op op;
  op.type = Op::kHost;
  op.run = [cb, userData, h] {
    cb(h, CUDA_SUCCESS, userData);
    streamPositionAtLeast(deviceNowNs());
    return CUDA_SUCCESS;
  };
  return submit(s, std::move(op));
}

CU_EXPORT CUresult cuStreamAttachMemAsync(CUstream h, CUdeviceptr p, size_t length, unsigned int flags) {
  API_ENTER(h, p, length, flags);
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  Allocation a;
  if (!registryFind(p, &a) || a.kind != MemKind::kManaged) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamCopyAttributes(CUstream dst, CUstream src) {
  API_ENTER(dst, src);
  Stream *d, *s;
  CU_TRY(resolveStream(dst, &d));
  CU_TRY(resolveStream(src, &s));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamGetAttribute(CUstream h, CUstreamAttrID attr, CUstreamAttrValue* v) {
  API_ENTER(h, attr, v);
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  *v = {};
  if (attr == CU_LAUNCH_ATTRIBUTE_PRIORITY) v->priority = s->priority;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuStreamSetAttribute(CUstream h, CUstreamAttrID attr, const CUstreamAttrValue* v) {
  API_ENTER(h, attr, v);
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (attr == CU_LAUNCH_ATTRIBUTE_PRIORITY) s->priority = v->priority < -5 ? -5 : (v->priority > 0 ? 0 : v->priority);
  return CUDA_SUCCESS;
}

// ---- events ----
CU_EXPORT CUresult cuEventCreate(CUevent* ph, unsigned int flags) {
  API_ENTER(ph, flags);
  if (!ph || (flags & ~0xfu)) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  auto* e = new Event;
  e->ctx = c;
  e->flags = flags;
  handleAdd(e, HandleType::kEvent);
  *ph = reinterpret_cast<CUevent>(e);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuEventDestroy_v2(CUevent h) {
  API_ENTER(h);
  Event* e = handleGet<Event>(h, HandleType::kEvent);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  handleRemove(e);
  delete e;
  return CUDA_SUCCESS;
}

namespace {
CUresult recordEvent(Event* e, Stream* s) {
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    e->captureGraph = s->captureGraph;
    e->captureDeps = s->captureDeps;
    e->captureOrigin = s->captureOrigin;
    return CUDA_SUCCESS;
  }
  e->captureGraph = nullptr;
  e->captureDeps.clear();
  Op op;
  op.type = Op::kEventRecord;
  op.run = [time = e->timeMs] {
    time->store(static_cast<double>(streamPositionNs()) / 1e6);
    return CUDA_SUCCESS;
  };
  uint64_t seq = 0;
  CU_TRY(submit(s, std::move(op), &seq));
  e->stream = s;
  e->seq = seq;
  e->recorded = true;
  return CUDA_SUCCESS;
}

bool eventDone(Event* e) { return !e->stream || e->stream->completed.load(std::memory_order_acquire) >= e->seq; }
}  // namespace

CU_EXPORT CUresult cuEventRecord(CUevent h, CUstream hs) {
  API_ENTER(h, hs);
  Event* e = handleGet<Event>(h, HandleType::kEvent);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  return recordEvent(e, s);
}

CU_EXPORT CUresult cuEventRecordWithFlags(CUevent h, CUstream hs, unsigned int flags) {
  API_ENTER(h, hs, flags);
  Event* e = handleGet<Event>(h, HandleType::kEvent);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (flags & ~1u) return CUDA_ERROR_INVALID_VALUE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  return recordEvent(e, s);
}

CU_EXPORT CUresult cuEventQuery(CUevent h) {
  API_ENTER(h);
  Event* e = handleGet<Event>(h, HandleType::kEvent);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (e->captureGraph) return CUDA_ERROR_CAPTURED_EVENT;
  return eventDone(e) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CU_EXPORT CUresult cuEventSynchronize(CUevent h) {
  API_ENTER(h);
  Event* e = handleGet<Event>(h, HandleType::kEvent);
  if (!e) return CUDA_ERROR_INVALID_HANDLE;
  if (e->captureGraph) return CUDA_ERROR_CAPTURED_EVENT;
  if (e->stream) waitStream(e->stream, e->seq);
  poolsOnSync(e->ctx->device);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
  API_ENTER(ms, start, end);
  if (!ms) return CUDA_ERROR_INVALID_VALUE;
  Event* a = handleGet<Event>(start, HandleType::kEvent);
  Event* b = handleGet<Event>(end, HandleType::kEvent);
  if (!a || !b) return CUDA_ERROR_INVALID_HANDLE;
  if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
  if (!a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
  if (!eventDone(a) || !eventDone(b)) return CUDA_ERROR_NOT_READY;
  // Quantised to 0.5 us, the resolution NVIDIA documents for event timing.
  const double halfUs = std::round((b->timeMs->load() - a->timeMs->load()) * 2000.0);
  *ms = static_cast<float>(halfUs / 2000.0);
  return CUDA_SUCCESS;
}
extern "C" SIMGPU_EXPORT CUresult simgpu_cuEventElapsedTime(float* ms, CUevent a, CUevent b) __asm__("cuEventElapsedTime");
CUresult simgpu_cuEventElapsedTime(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime_v2(ms, a, b); }
