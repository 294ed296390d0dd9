// Streams and events through the CUDA runtime API: priorities, asynchronous copies and memsets on
// several streams, events and timing, cross-stream waits, host functions, stream queries, and the
// default-stream semantics (legacy and per-thread).
//
// CMakeLists.txt builds this file twice more with `--default-stream per-thread`
// (CUDA_API_PER_THREAD_DEFAULT_STREAM defined): cudart then routes every call through the
// driver's _ptsz/_ptds entry points, and stream 0 means the calling thread's default stream.
#include <atomic>
#include <cstring>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_check.h"

using namespace simtest;
using Clock = std::chrono::steady_clock;

namespace {

// A host function that blocks its stream until open() is called (or 5 s pass, so that a broken
// implementation fails instead of hanging). The state lives in storage that is never freed, and a
// Gate opens itself when it goes out of scope: a test that fails early leaves no host function
// waiting on, or reading, a dead stack frame.
struct GateState {
  std::atomic<bool> opened{false};
  std::atomic<bool> started{false};
  std::atomic<bool> finished{false};
  std::atomic<bool> timedOut{false};
};

std::deque<GateState>& gateStates() {
  static auto* states = new std::deque<GateState>;  // leaked on purpose (reachable)
  return *states;
}

class Gate {
 public:
  Gate() : s_(&gateStates().emplace_back()) {}
  ~Gate() { open(); }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  static void CUDART_CB wait(void* p) {
    auto* g = static_cast<GateState*>(p);
    g->started = true;
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (!g->opened.load()) {
      if (Clock::now() > deadline) {
        g->timedOut = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    g->finished = true;
  }
  void* arg() const { return s_; }
  void open() { s_->opened = true; }
  bool finished() const { return s_->finished; }
  bool timedOut() const { return s_->timedOut; }

 private:
  GateState* s_;
};

// Declared after the locals that queued work refers to: at scope exit (also after a failed
// ASSERT) it opens every gate and drains the device before those locals die.
struct Drain {
  Drain() = default;
  Drain(const Drain&) = delete;
  ~Drain() {
    for (auto& g : gateStates()) g.opened = true;
    (void)cudaDeviceSynchronize();
    (void)cudaGetLastError();
  }
};

void CUDART_CB sleep20ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }

struct Recorder {
  std::mutex mu;
  std::vector<int> seen;
  const volatile int* watch = nullptr;  // pinned host memory a copy writes before the host function
};

struct RecordArg {
  Recorder* r;
  int value;  // < 0: record *watch instead
};

void CUDART_CB record(void* p) {
  auto* a = static_cast<RecordArg*>(p);
  std::lock_guard<std::mutex> lock(a->r->mu);
  const int v = a->value >= 0 ? a->value : static_cast<int>(*a->r->watch);
  a->r->seen.push_back(v);
}

template <typename T>
struct Pinned {
  T* p = nullptr;
  explicit Pinned(size_t n) {
    if (cudaMallocHost(reinterpret_cast<void**>(&p), n * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Pinned() {
    if (p) cudaFreeHost(p);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

}  // namespace

TEST(Streams, PriorityRange) {
  int least = 12345, greatest = 12345;
  CUDA_ASSERT(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  EXPECT_LT(greatest, least) << "the greatest (highest) priority is numerically lowest";

  cudaStream_t hi, lo, tooHigh, tooLow;
  CUDA_ASSERT(cudaStreamCreateWithPriority(&hi, cudaStreamNonBlocking, greatest));
  CUDA_ASSERT(cudaStreamCreateWithPriority(&lo, cudaStreamDefault, least));
  CUDA_ASSERT(cudaStreamCreateWithPriority(&tooHigh, cudaStreamDefault, greatest - 10));
  CUDA_ASSERT(cudaStreamCreateWithPriority(&tooLow, cudaStreamDefault, least + 10));
  int p = 999;
  CUDA_ASSERT(cudaStreamGetPriority(hi, &p));
  EXPECT_EQ(greatest, p);
  CUDA_ASSERT(cudaStreamGetPriority(lo, &p));
  EXPECT_EQ(least, p);
  CUDA_ASSERT(cudaStreamGetPriority(tooHigh, &p));
  EXPECT_EQ(greatest, p) << "out-of-range priorities are clamped";
  CUDA_ASSERT(cudaStreamGetPriority(tooLow, &p));
  EXPECT_EQ(least, p) << "out-of-range priorities are clamped";

  unsigned flags = 999;
  CUDA_ASSERT(cudaStreamGetFlags(hi, &flags));
  EXPECT_EQ(static_cast<unsigned>(cudaStreamNonBlocking), flags);
  CUDA_ASSERT(cudaStreamGetFlags(lo, &flags));
  EXPECT_EQ(static_cast<unsigned>(cudaStreamDefault), flags);

  // Priority streams carry work like any other.
  int* d = nullptr;
  Pinned<int> h(256);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  CUDA_ASSERT(cudaMalloc(&d, 256 * sizeof(int)));
  CUDA_ASSERT(cudaMemsetAsync(d, 0x01, 256 * sizeof(int), hi));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, d, 256 * sizeof(int), cudaMemcpyDeviceToHost, hi));
  CUDA_ASSERT(cudaStreamSynchronize(hi));
  for (int i = 0; i < 256; ++i) ASSERT_EQ(0x01010101, h.p[i]) << i;

  for (cudaStream_t s : {hi, lo, tooHigh, tooLow}) CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Streams, StreamIdsAndDevice) {
  cudaStream_t a, b;
  CUDA_ASSERT(cudaStreamCreate(&a));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  unsigned long long ida = 0, idb = 0;
  CUDA_ASSERT(cudaStreamGetId(a, &ida));
  CUDA_ASSERT(cudaStreamGetId(b, &idb));
  EXPECT_NE(ida, idb);
  int dev = -1;
  CUDA_ASSERT(cudaStreamGetDevice(a, &dev));
  EXPECT_EQ(0, dev);
  CUDA_ASSERT(cudaStreamDestroy(a));
  CUDA_ASSERT(cudaStreamDestroy(b));
}

TEST(Streams, AsyncCopiesOnSeveralStreams) {
  constexpr int kStreams = 4;
  constexpr size_t n = 1 << 20;  // bytes per stream
  cudaStream_t s[kStreams];
  uint8_t* d[kStreams];
  uint8_t* d2[kStreams];
  Pinned<uint8_t> in(n * kStreams), out(n * kStreams);
  Drain drain;  // after the locals queued work uses
  ASSERT_TRUE(in.p && out.p);
  for (size_t i = 0; i < n * kStreams; ++i) {
    in.p[i] = patternByte(i, 31);
    out.p[i] = 0;
  }
  for (int k = 0; k < kStreams; ++k) {
    CUDA_ASSERT(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
    CUDA_ASSERT(cudaMalloc(&d[k], n));
    CUDA_ASSERT(cudaMalloc(&d2[k], n));
  }
  for (int k = 0; k < kStreams; ++k) {
    uint8_t* src = in.p + k * n;
    CUDA_ASSERT(cudaMemcpyAsync(d[k], src, n, cudaMemcpyHostToDevice, s[k]));
    CUDA_ASSERT(cudaMemsetAsync(d[k] + 1000 * k, 0xe0 + k, 500, s[k]));  // per-stream marker
    CUDA_ASSERT(cudaMemcpyAsync(d2[k], d[k], n, cudaMemcpyDeviceToDevice, s[k]));
    CUDA_ASSERT(cudaMemcpyAsync(out.p + k * n, d2[k], n, cudaMemcpyDeviceToHost, s[k]));
  }
  for (int k = 0; k < kStreams; ++k) CUDA_ASSERT(cudaStreamSynchronize(s[k]));
  for (int k = 0; k < kStreams; ++k) {
    for (size_t i = 0; i < n; ++i) {
      const bool marked = i >= 1000u * k && i < 1000u * k + 500;
      const uint8_t want = marked ? static_cast<uint8_t>(0xe0 + k) : in.p[k * n + i];
      ASSERT_EQ(want, out.p[k * n + i]) << "stream " << k << " byte " << i;
    }
    EXPECT_EQ(cudaSuccess, cudaStreamQuery(s[k]));
  }
  for (int k = 0; k < kStreams; ++k) {
    CUDA_ASSERT(cudaStreamDestroy(s[k]));
    CUDA_ASSERT(cudaFree(d[k]));
    CUDA_ASSERT(cudaFree(d2[k]));
  }
}

TEST(Streams, DeviceSynchronizeWaitsForEveryStream) {
  constexpr int kStreams = 3;
  cudaStream_t s[kStreams];
  int* d = nullptr;
  Pinned<int> h(kStreams);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  CUDA_ASSERT(cudaMalloc(&d, kStreams * sizeof(int)));
  for (int k = 0; k < kStreams; ++k) {
    h.p[k] = 0;
    CUDA_ASSERT(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
    CUDA_ASSERT(cudaLaunchHostFunc(s[k], sleep20ms, nullptr));
    CUDA_ASSERT(cudaMemsetAsync(d + k, k + 1, sizeof(int), s[k]));
    CUDA_ASSERT(cudaMemcpyAsync(h.p + k, d + k, sizeof(int), cudaMemcpyDeviceToHost, s[k]));
  }
  CUDA_ASSERT(cudaDeviceSynchronize());
  for (int k = 0; k < kStreams; ++k) {
    const int b = k + 1;
    EXPECT_EQ(b | b << 8 | b << 16 | b << 24, h.p[k]) << k;
    EXPECT_EQ(cudaSuccess, cudaStreamQuery(s[k]));
    CUDA_ASSERT(cudaStreamDestroy(s[k]));
  }
  CUDA_ASSERT(cudaFree(d));
}

TEST(Streams, QueryReportsPendingWork) {
  Drain drain;
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(s)) << "a new stream is idle";
  Gate gate;
  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreate(&e));
  CUDA_ASSERT(cudaLaunchHostFunc(s, Gate::wait, gate.arg()));
  CUDA_ASSERT(cudaEventRecord(e, s));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(s));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(e));
  // cudaErrorNotReady is not an error state.
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  gate.open();
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_FALSE(gate.timedOut());
  EXPECT_EQ(cudaSuccess, cudaStreamQuery(s));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(e));
  CUDA_ASSERT(cudaEventDestroy(e));
  CUDA_ASSERT(cudaStreamDestroy(s));
}

TEST(Streams, HostFuncsRunInStreamOrder) {
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* d = nullptr;
  Pinned<int> h(1);
  ASSERT_NE(nullptr, h.p);
  *h.p = -1;
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  Recorder rec;
  rec.watch = h.p;
  std::vector<RecordArg> args;
  args.reserve(40);
  Drain drain;  // after the locals queued work uses
  for (int k = 0; k < 20; ++k) {
    // Each host function sees the copy issued just before it, and none issued after it.
    CUDA_ASSERT(cudaMemsetAsync(d, k, sizeof(int), s));
    CUDA_ASSERT(cudaMemcpyAsync(h.p, d, sizeof(int), cudaMemcpyDeviceToHost, s));
    args.push_back({&rec, -1});
    CUDA_ASSERT(cudaLaunchHostFunc(s, record, &args.back()));
    args.push_back({&rec, 1000 + k});
    CUDA_ASSERT(cudaLaunchHostFunc(s, record, &args.back()));
  }
  CUDA_ASSERT(cudaStreamSynchronize(s));
  ASSERT_EQ(40u, rec.seen.size());
  for (int k = 0; k < 20; ++k) {
    EXPECT_EQ(k | k << 8 | k << 16 | k << 24, rec.seen[2 * k]) << k;
    EXPECT_EQ(1000 + k, rec.seen[2 * k + 1]) << k;
  }
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaFree(d));
}

namespace {
std::atomic<int> g_callbackStatus{-1};
void CUDART_CB legacyCallback(cudaStream_t, cudaError_t status, void* user) {
  g_callbackStatus = static_cast<int>(status);
  *static_cast<int*>(user) = 77;
}
}  // namespace

TEST(Streams, StreamAddCallback) {
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreate(&s));
  int value = 0;
  Drain drain;  // after the locals queued work uses
  CUDA_ASSERT(cudaStreamAddCallback(s, legacyCallback, &value, 0));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_EQ(77, value);
  EXPECT_EQ(static_cast<int>(cudaSuccess), g_callbackStatus.load());
  CUDA_ASSERT(cudaStreamDestroy(s));
}

TEST(Streams, WaitEventOrdersStreams) {
  cudaStream_t a, b;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  const size_t n = 4096;
  uint8_t* d = nullptr;
  Pinned<uint8_t> h(n);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  std::memset(h.p, 0, n);
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemset(d, 1, n));
  CUDA_ASSERT(cudaDeviceSynchronize());

  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(a, Gate::wait, gate.arg()));
  CUDA_ASSERT(cudaMemsetAsync(d, 7, n, a));
  CUDA_ASSERT(cudaEventRecord(e, a));
  CUDA_ASSERT(cudaStreamWaitEvent(b, e, 0));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, d, n, cudaMemcpyDeviceToHost, b));
  // b's copy depends on a's memset, which sits behind the closed gate.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(b));
  EXPECT_EQ(0, h.p[0]) << "the copy ran before the event it waits for";
  gate.open();
  CUDA_ASSERT(cudaStreamSynchronize(b));
  EXPECT_FALSE(gate.timedOut());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(7, h.p[i]) << i;

  // Waiting on an event that was never recorded is a no-op.
  cudaEvent_t fresh;
  CUDA_ASSERT(cudaEventCreate(&fresh));
  CUDA_ASSERT(cudaStreamWaitEvent(b, fresh, 0));
  CUDA_ASSERT(cudaStreamSynchronize(b));

  // Re-recording the event moves the wait point.
  Gate gate2;
  CUDA_ASSERT(cudaLaunchHostFunc(a, Gate::wait, gate2.arg()));
  CUDA_ASSERT(cudaMemsetAsync(d, 9, n, a));
  CUDA_ASSERT(cudaEventRecord(e, a));
  CUDA_ASSERT(cudaStreamWaitEvent(b, e, 0));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, d, n, cudaMemcpyDeviceToHost, b));
  gate2.open();
  CUDA_ASSERT(cudaStreamSynchronize(b));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(9, h.p[i]) << i;

  CUDA_ASSERT(cudaEventDestroy(e));
  CUDA_ASSERT(cudaEventDestroy(fresh));
  CUDA_ASSERT(cudaStreamDestroy(a));
  CUDA_ASSERT(cudaStreamDestroy(b));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Streams, DestroyWithPendingWorkCompletesIt) {
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* d = nullptr;
  Pinned<int> h(1);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  *h.p = 0;
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(s, Gate::wait, gate.arg()));
  CUDA_ASSERT(cudaMemsetAsync(d, 0x2a, sizeof(int), s));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, d, sizeof(int), cudaMemcpyDeviceToHost, s));
  CUDA_ASSERT(cudaStreamDestroy(s));  // returns at once; the work still runs
  gate.open();
  CUDA_ASSERT(cudaDeviceSynchronize());
  EXPECT_FALSE(gate.timedOut());
  EXPECT_EQ(0x2a2a2a2a, *h.p);
  CUDA_ASSERT(cudaFree(d));
}

TEST(Events, ElapsedTime) {
  Drain drain;
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CUDA_ASSERT(cudaEventCreate(&start));
  CUDA_ASSERT(cudaEventCreateWithFlags(&stop, cudaEventBlockingSync));
  void* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, 8 * MiB));
  CUDA_ASSERT(cudaEventRecord(start, s));
  CUDA_ASSERT(cudaMemsetAsync(d, 3, 8 * MiB, s));
  CUDA_ASSERT(cudaLaunchHostFunc(s, sleep20ms, nullptr));
  CUDA_ASSERT(cudaEventRecord(stop, s));
  CUDA_ASSERT(cudaEventSynchronize(stop));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(stop));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(start));
  float ms = -1.0f;
  CUDA_ASSERT(cudaEventElapsedTime(&ms, start, stop));
  EXPECT_GE(ms, 0.0f);
  EXPECT_GE(ms, 15.0f) << "the stop event completes after the 20 ms host function";
  EXPECT_LT(ms, 5000.0f);
  float same = -1.0f;
  CUDA_ASSERT(cudaEventElapsedTime(&same, start, start));
  EXPECT_EQ(0.0f, same);

  // Back-to-back events on an idle stream.
  CUDA_ASSERT(cudaEventRecord(start, s));
  CUDA_ASSERT(cudaEventRecord(stop, s));
  CUDA_ASSERT(cudaEventSynchronize(stop));
  CUDA_ASSERT(cudaEventElapsedTime(&ms, start, stop));
  EXPECT_GE(ms, 0.0f);
  EXPECT_LT(ms, 1000.0f);

  CUDA_ASSERT(cudaEventDestroy(start));
  CUDA_ASSERT(cudaEventDestroy(stop));
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Events, ElapsedTimeErrors) {
  cudaEvent_t timed, untimed, never;
  CUDA_ASSERT(cudaEventCreate(&timed));
  CUDA_ASSERT(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming));
  CUDA_ASSERT(cudaEventCreate(&never));
  EXPECT_EQ(cudaSuccess, cudaEventQuery(never)) << "an unrecorded event counts as complete";
  CUDA_ASSERT(cudaEventSynchronize(never));
  CUDA_ASSERT(cudaEventRecord(timed, 0));
  CUDA_ASSERT(cudaEventRecord(untimed, 0));
  CUDA_ASSERT(cudaDeviceSynchronize());
  float ms = 0;
  CUDA_EXPECT_ERR(cudaErrorInvalidResourceHandle, cudaEventElapsedTime(&ms, timed, untimed));
  CUDA_EXPECT_ERR(cudaErrorInvalidResourceHandle, cudaEventElapsedTime(&ms, timed, never));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  CUDA_ASSERT(cudaEventDestroy(timed));
  CUDA_ASSERT(cudaEventDestroy(untimed));
  CUDA_ASSERT(cudaEventDestroy(never));
}

TEST(Events, EventsAcrossStreams) {
  Drain drain;
  cudaStream_t a, b;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t ea, eb;
  CUDA_ASSERT(cudaEventCreate(&ea));
  CUDA_ASSERT(cudaEventCreate(&eb));
  CUDA_ASSERT(cudaEventRecord(ea, a));
  CUDA_ASSERT(cudaStreamWaitEvent(b, ea, 0));
  CUDA_ASSERT(cudaLaunchHostFunc(b, sleep20ms, nullptr));
  CUDA_ASSERT(cudaEventRecord(eb, b));
  CUDA_ASSERT(cudaEventSynchronize(eb));
  float ms = -1;
  CUDA_ASSERT(cudaEventElapsedTime(&ms, ea, eb));
  EXPECT_GE(ms, 15.0f);
  for (auto e : {ea, eb}) CUDA_ASSERT(cudaEventDestroy(e));
  for (auto s : {a, b}) CUDA_ASSERT(cudaStreamDestroy(s));
}

// --- Default streams --------------------------------------------------------------------------

// Work on the legacy default stream waits for earlier work in every blocking stream.
TEST(DefaultStream, LegacyWaitsForBlockingStreams) {
  cudaStream_t blocking;
  CUDA_ASSERT(cudaStreamCreate(&blocking));
  int* d = nullptr;
  Pinned<int> h(1);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  *h.p = 0;
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  CUDA_ASSERT(cudaMemset(d, 0, sizeof(int)));
  CUDA_ASSERT(cudaDeviceSynchronize());
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(blocking, Gate::wait, gate.arg()));
  CUDA_ASSERT(cudaMemsetAsync(d, 5, sizeof(int), blocking));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, d, sizeof(int), cudaMemcpyDeviceToHost, cudaStreamLegacy));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(cudaStreamLegacy));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    gate.open();
  });
  CUDA_EXPECT(cudaStreamSynchronize(cudaStreamLegacy));
  opener.join();
  EXPECT_FALSE(gate.timedOut());
  EXPECT_EQ(0x05050505, *h.p) << "the legacy stream's copy ran before the blocking stream's memset";
  CUDA_ASSERT(cudaStreamDestroy(blocking));
  CUDA_ASSERT(cudaFree(d));
}

// Work in a blocking stream waits for earlier work on the legacy default stream.
TEST(DefaultStream, BlockingStreamsWaitForLegacy) {
  Drain drain;
  cudaStream_t blocking;
  CUDA_ASSERT(cudaStreamCreate(&blocking));
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(cudaStreamLegacy, Gate::wait, gate.arg()));
  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreate(&e));
  CUDA_ASSERT(cudaEventRecord(e, blocking));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(e));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(blocking));
  gate.open();
  CUDA_ASSERT(cudaEventSynchronize(e));
  EXPECT_FALSE(gate.timedOut());
  CUDA_ASSERT(cudaEventDestroy(e));
  CUDA_ASSERT(cudaStreamDestroy(blocking));
}

// A non-blocking stream does not synchronise with the legacy default stream.
TEST(DefaultStream, NonBlockingStreamIsIndependentOfLegacy) {
  cudaStream_t nb;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking));
  // Allocate before closing the gate: cudaFree/cudaFreeHost may synchronise the whole device.
  int* d = nullptr;
  Pinned<int> h(1);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(nb, Gate::wait, gate.arg()));
  CUDA_ASSERT(cudaMemsetAsync(d, 3, sizeof(int), cudaStreamLegacy));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, d, sizeof(int), cudaMemcpyDeviceToHost, cudaStreamLegacy));
  const auto t0 = Clock::now();
  CUDA_EXPECT(cudaStreamSynchronize(cudaStreamLegacy));
  const auto waited = Clock::now() - t0;
  EXPECT_FALSE(gate.finished()) << "the legacy stream waited for a non-blocking stream";
  EXPECT_LT(waited, std::chrono::seconds(2));
  EXPECT_EQ(0x03030303, *h.p);
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(nb));
  gate.open();
  CUDA_ASSERT(cudaStreamSynchronize(nb));
  CUDA_ASSERT(cudaStreamDestroy(nb));
  CUDA_ASSERT(cudaFree(d));
}

// Each thread's cudaStreamPerThread is its own stream (in either compilation mode).
TEST(DefaultStream, PerThreadStreamsAreIndependent) {
  // Allocate before closing the gate: cudaFree/cudaFreeHost may synchronise the whole device.
  int* d = nullptr;
  Pinned<int> h(1);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  *h.p = 0;
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  CUDA_ASSERT(cudaDeviceSynchronize());
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(cudaStreamPerThread, Gate::wait, gate.arg()));
  std::atomic<int> result{0};
  std::atomic<bool> independent{false};
  std::thread other([&] {
    cudaMemsetAsync(d, 0x11, sizeof(int), cudaStreamPerThread);
    cudaMemcpyAsync(h.p, d, sizeof(int), cudaMemcpyDeviceToHost, cudaStreamPerThread);
    if (cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess) result = *h.p;
    independent = !gate.finished();  // done while the main thread's gate was still closed
  });
  other.join();
  EXPECT_EQ(0x11111111, result.load());
  EXPECT_TRUE(independent.load()) << "another thread's per-thread stream waited for this one's";
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(cudaStreamPerThread));
  gate.open();
  CUDA_ASSERT(cudaStreamSynchronize(cudaStreamPerThread));
  EXPECT_FALSE(gate.timedOut());
  CUDA_ASSERT(cudaFree(d));
}

// The per-thread default stream still synchronises with the legacy default stream.
TEST(DefaultStream, PerThreadSynchronizesWithLegacy) {
  Drain drain;
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(cudaStreamPerThread, Gate::wait, gate.arg()));
  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreate(&e));
  CUDA_ASSERT(cudaEventRecord(e, cudaStreamLegacy));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(e));
  gate.open();
  CUDA_ASSERT(cudaEventSynchronize(e));
  EXPECT_FALSE(gate.timedOut());
  CUDA_ASSERT(cudaEventDestroy(e));
}

#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
// Compiled with --default-stream per-thread: stream 0 and the synchronous calls use the calling
// thread's own default stream, so a blocked thread does not block another.
TEST(DefaultStream, ZeroIsPerThread) {
  // Allocate before closing the gate: cudaFree/cudaFreeHost may synchronise the whole device.
  int* d = nullptr;
  Pinned<int> h(2);
  Drain drain;  // after the locals queued work uses
  ASSERT_NE(nullptr, h.p);
  h.p[0] = h.p[1] = 0;
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  CUDA_ASSERT(cudaDeviceSynchronize());
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(0, Gate::wait, gate.arg()));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(cudaStreamPerThread)) << "stream 0 is the per-thread stream";
  std::atomic<int> asyncResult{0}, syncResult{0};
  std::thread other([&] {
    cudaMemsetAsync(d, 0x22, sizeof(int), 0);
    cudaMemcpyAsync(h.p, d, sizeof(int), cudaMemcpyDeviceToHost, 0);
    if (cudaStreamSynchronize(0) == cudaSuccess) asyncResult = h.p[0];
    cudaMemset(d, 0x33, sizeof(int));  // synchronous calls use the per-thread stream too
    if (cudaMemcpy(h.p + 1, d, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess) syncResult = h.p[1];
  });
  other.join();
  EXPECT_FALSE(gate.finished()) << "the other thread's default stream waited for this thread's";
  EXPECT_EQ(0x22222222, asyncResult.load());
  EXPECT_EQ(0x33333333, syncResult.load());
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(0));
  gate.open();
  CUDA_ASSERT(cudaStreamSynchronize(0));
  EXPECT_FALSE(gate.timedOut());
  CUDA_ASSERT(cudaFree(d));
}
#else
// Default compilation: stream 0 is the legacy default stream.
TEST(DefaultStream, ZeroIsLegacy) {
  Drain drain;
  cudaStream_t blocking;
  CUDA_ASSERT(cudaStreamCreate(&blocking));
  Gate gate;
  CUDA_ASSERT(cudaLaunchHostFunc(0, Gate::wait, gate.arg()));
  EXPECT_EQ(cudaErrorNotReady, cudaStreamQuery(cudaStreamLegacy)) << "stream 0 is the legacy stream";
  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreate(&e));
  CUDA_ASSERT(cudaEventRecord(e, blocking));  // waits behind the legacy stream's gate
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(cudaErrorNotReady, cudaEventQuery(e));
  gate.open();
  CUDA_ASSERT(cudaStreamSynchronize(0));
  CUDA_ASSERT(cudaEventSynchronize(e));
  EXPECT_FALSE(gate.timedOut());
  CUDA_ASSERT(cudaEventDestroy(e));
  CUDA_ASSERT(cudaStreamDestroy(blocking));
}
#endif
