// CUDA graphs through the runtime API: stream capture (single stream and fork/join across
// streams), instantiation and replay, the explicit node API, exec updates, destruction.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "cuda_check.h"
#include "simgpu/simgpu.h"

using namespace simtest;

__global__ void saxpy(int n, float a, const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

namespace {
std::atomic<int> g_saxpyLaunches{0};
}

// Host body of saxpy(int, float, const float*, float*) on simgpu.
extern "C" void simgpu_host__Z5saxpyifPKfPf(const simgpu_launch* l) {
  int n;
  float a;
  const float* x;
  float* y;
  std::memcpy(&n, l->params[0], sizeof n);
  std::memcpy(&a, l->params[1], sizeof a);
  std::memcpy(&x, l->params[2], sizeof x);
  std::memcpy(&y, l->params[3], sizeof y);
  const long long m = std::min<long long>(n, static_cast<long long>(l->grid[0]) * l->block[0]);
  for (long long i = 0; i < m; ++i) y[i] = a * x[i] + y[i];
  ++g_saxpyLaunches;
}

namespace {

template <typename T>
struct Pinned {
  T* p = nullptr;
  explicit Pinned(size_t n) {
    if (cudaMallocHost(reinterpret_cast<void**>(&p), n * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Pinned() {
    if (p) cudaFreeHost(p);
  }
  T& operator[](size_t i) { return p[i]; }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

std::map<cudaGraphNodeType, int> nodeTypes(cudaGraph_t g, size_t* count) {
  std::map<cudaGraphNodeType, int> types;
  *count = 0;
  if (cudaGraphGetNodes(g, nullptr, count) != cudaSuccess) return types;
  std::vector<cudaGraphNode_t> nodes(*count);
  if (*count && cudaGraphGetNodes(g, nodes.data(), count) != cudaSuccess) return types;
  for (auto n : nodes) {
    cudaGraphNodeType t;
    if (cudaGraphNodeGetType(n, &t) == cudaSuccess) ++types[t];
  }
  return types;
}

struct HostProbe {
  const float* watch = nullptr;
  std::mutex mu;
  std::vector<float> seen;
};

void CUDART_CB probe(void* p) {
  auto* h = static_cast<HostProbe*>(p);
  std::lock_guard<std::mutex> lock(h->mu);
  h->seen.push_back(*h->watch);
}

}  // namespace

TEST(Graphs, StreamCaptureAndReplay) {
  const int n = 2048;
  const size_t bytes = n * sizeof(float);
  Pinned<float> hx(n), hout(n);
  ASSERT_TRUE(hx.p && hout.p);
  DeviceDrain drain;
  for (int i = 0; i < n; ++i) {
    hx[i] = static_cast<float>(i);
    hout[i] = -1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  CUDA_ASSERT(cudaMalloc(&dx, bytes));
  CUDA_ASSERT(cudaMalloc(&dy, bytes));
  CUDA_ASSERT(cudaMemset(dy, 0x7f, bytes));  // garbage the graph's memset must clear
  CUDA_ASSERT(cudaDeviceSynchronize());
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  cudaStreamCaptureStatus status = cudaStreamCaptureStatusInvalidated;
  CUDA_ASSERT(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(cudaStreamCaptureStatusNone, status);

  const int launchesBefore = g_saxpyLaunches.load();
  CUDA_ASSERT(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CUDA_ASSERT(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(cudaStreamCaptureStatusActive, status);
  unsigned long long captureId = 0;
  CUDA_ASSERT(cudaStreamGetCaptureInfo(s, &status, &captureId));
  EXPECT_EQ(cudaStreamCaptureStatusActive, status);
  CUDA_ASSERT(cudaMemsetAsync(dy, 0, bytes, s));
  CUDA_ASSERT(cudaMemcpyAsync(dx, hx.p, bytes, cudaMemcpyHostToDevice, s));
  saxpy<<<n / 256, 256, 0, s>>>(n, 2.0f, dx, dy);
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaMemcpyAsync(hout.p, dy, bytes, cudaMemcpyDeviceToHost, s));
  cudaGraph_t graph = nullptr;
  CUDA_ASSERT(cudaStreamEndCapture(s, &graph));
  ASSERT_NE(nullptr, graph);
  CUDA_ASSERT(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(cudaStreamCaptureStatusNone, status);

  // Capturing records the work; it does not run it.
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_EQ(-1.0f, hout[0]);
  EXPECT_EQ(-1.0f, hout[n - 1]);
  if (onSimgpu()) EXPECT_EQ(launchesBefore, g_saxpyLaunches.load());

  size_t count = 0;
  auto types = nodeTypes(graph, &count);
  EXPECT_EQ(4u, count);
  EXPECT_EQ(1, types[cudaGraphNodeTypeMemset]);
  EXPECT_EQ(2, types[cudaGraphNodeTypeMemcpy]);
  EXPECT_EQ(1, types[cudaGraphNodeTypeKernel]);

  cudaGraphExec_t exec = nullptr;
  CUDA_ASSERT(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_NE(nullptr, exec);

  CUDA_ASSERT(cudaGraphLaunch(exec, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (int i = 0; i < n; ++i) ASSERT_EQ(2.0f * i, hout[i]) << "first launch, i " << i;

  // Replay with new input in the captured host buffer: the copy reads it again.
  for (int i = 0; i < n; ++i) {
    hx[i] = static_cast<float>(3 * i + 1);
    hout[i] = -1.0f;
  }
  CUDA_ASSERT(cudaGraphLaunch(exec, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (int i = 0; i < n; ++i) ASSERT_EQ(2.0f * (3 * i + 1), hout[i]) << "second launch, i " << i;
  if (onSimgpu()) EXPECT_EQ(launchesBefore + 2, g_saxpyLaunches.load());

  // A launch on another stream, ordered with ordinary work there.
  cudaStream_t s2;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (int i = 0; i < n; ++i) hx[i] = 1.0f;
  CUDA_ASSERT(cudaGraphLaunch(exec, s2));
  CUDA_ASSERT(cudaMemsetAsync(dy, 0, bytes, s2));  // after the graph: hout keeps the graph's result
  CUDA_ASSERT(cudaStreamSynchronize(s2));
  for (int i = 0; i < n; ++i) ASSERT_EQ(2.0f, hout[i]) << i;

  CUDA_ASSERT(cudaGraphExecDestroy(exec));
  CUDA_ASSERT(cudaGraphDestroy(graph));
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaStreamDestroy(s2));
  CUDA_ASSERT(cudaFree(dx));
  CUDA_ASSERT(cudaFree(dy));
}

TEST(Graphs, CaptureForkJoinAcrossStreams) {
  const size_t n = 1 << 16;
  uint8_t *a = nullptr, *b = nullptr;
  CUDA_ASSERT(cudaMalloc(&a, n));
  CUDA_ASSERT(cudaMalloc(&b, n));
  Pinned<uint8_t> h(2 * n);
  ASSERT_NE(nullptr, h.p);
  DeviceDrain drain;
  cudaStream_t s1, s2;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CUDA_ASSERT(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_ASSERT(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

  CUDA_ASSERT(cudaStreamBeginCapture(s1, cudaStreamCaptureModeThreadLocal));
  CUDA_ASSERT(cudaEventRecord(fork, s1));
  CUDA_ASSERT(cudaStreamWaitEvent(s2, fork, 0));  // s2 joins the capture
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_ASSERT(cudaStreamIsCapturing(s2, &status));
  EXPECT_EQ(cudaStreamCaptureStatusActive, status);
  CUDA_ASSERT(cudaMemsetAsync(a, 0x12, n, s1));
  CUDA_ASSERT(cudaMemsetAsync(b, 0x34, n, s2));
  CUDA_ASSERT(cudaEventRecord(join, s2));
  CUDA_ASSERT(cudaStreamWaitEvent(s1, join, 0));
  CUDA_ASSERT(cudaMemcpyAsync(h.p, a, n, cudaMemcpyDeviceToHost, s1));
  CUDA_ASSERT(cudaMemcpyAsync(h.p + n, b, n, cudaMemcpyDeviceToHost, s1));
  cudaGraph_t graph = nullptr;
  CUDA_ASSERT(cudaStreamEndCapture(s1, &graph));
  CUDA_ASSERT(cudaStreamIsCapturing(s2, &status));
  EXPECT_EQ(cudaStreamCaptureStatusNone, status) << "s2 leaves the capture when it ends";

  size_t count = 0;
  auto types = nodeTypes(graph, &count);
  EXPECT_EQ(4u, count);
  EXPECT_EQ(2, types[cudaGraphNodeTypeMemset]);
  EXPECT_EQ(2, types[cudaGraphNodeTypeMemcpy]);
  size_t edges = 0;
  CUDA_ASSERT(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges));
  // Both memsets are roots; the first copy waits for both (the join), the second for the first.
  EXPECT_EQ(3u, edges);
  size_t roots = 0;
  CUDA_ASSERT(cudaGraphGetRootNodes(graph, nullptr, &roots));
  EXPECT_EQ(2u, roots);

  cudaGraphExec_t exec = nullptr;
  CUDA_ASSERT(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 2; ++round) {
    std::memset(h.p, 0, 2 * n);
    CUDA_ASSERT(cudaGraphLaunch(exec, s1));
    CUDA_ASSERT(cudaStreamSynchronize(s1));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(0x12, h.p[i]) << "round " << round << " i " << i;
      ASSERT_EQ(0x34, h.p[n + i]) << "round " << round << " i " << i;
    }
  }
  CUDA_ASSERT(cudaGraphExecDestroy(exec));
  CUDA_ASSERT(cudaGraphDestroy(graph));
  CUDA_ASSERT(cudaEventDestroy(fork));
  CUDA_ASSERT(cudaEventDestroy(join));
  CUDA_ASSERT(cudaStreamDestroy(s1));
  CUDA_ASSERT(cudaStreamDestroy(s2));
  CUDA_ASSERT(cudaFree(a));
  CUDA_ASSERT(cudaFree(b));
}

TEST(Graphs, SynchronizeDuringCaptureInvalidatesIt) {
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, 4096));
  CUDA_ASSERT(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CUDA_ASSERT(cudaMemsetAsync(d, 1, 4096, s));
  CUDA_EXPECT_ERR(cudaErrorStreamCaptureUnsupported, cudaStreamSynchronize(s));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_ASSERT(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(cudaStreamCaptureStatusInvalidated, status);
  cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(0x1);
  CUDA_EXPECT_ERR(cudaErrorStreamCaptureInvalidated, cudaStreamEndCapture(s, &graph));
  EXPECT_EQ(nullptr, graph);
  CUDA_ASSERT(cudaStreamIsCapturing(s, &status));
  EXPECT_EQ(cudaStreamCaptureStatusNone, status);
  // The stream works normally afterwards.
  CUDA_ASSERT(cudaMemsetAsync(d, 2, 4096, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Graphs, ExplicitGraphApi) {
  const int n = 1024;
  const size_t bytes = n * sizeof(float);
  Pinned<float> hx(n), hout(n);
  ASSERT_TRUE(hx.p && hout.p);
  for (int i = 0; i < n; ++i) {
    hx[i] = static_cast<float>(i % 100);
    hout[i] = -1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  CUDA_ASSERT(cudaMalloc(&dx, bytes));
  CUDA_ASSERT(cudaMalloc(&dy, bytes));

  cudaGraph_t graph = nullptr;
  CUDA_ASSERT(cudaGraphCreate(&graph, 0));

  // y = 1.0f everywhere (32-bit memset of the float's bit pattern).
  float one = 1.0f;
  unsigned oneBits;
  std::memcpy(&oneBits, &one, sizeof oneBits);
  cudaMemsetParams ms{};
  ms.dst = dy;
  ms.value = oneBits;
  ms.elementSize = 4;
  ms.width = n;
  ms.height = 1;
  cudaGraphNode_t memsetNode, copyInNode, joinNode, kernelNode, copyOutNode, hostNode;
  CUDA_ASSERT(cudaGraphAddMemsetNode(&memsetNode, graph, nullptr, 0, &ms));

  // x from the host.
  CUDA_ASSERT(cudaGraphAddMemcpyNode1D(&copyInNode, graph, nullptr, 0, dx, hx.p, bytes, cudaMemcpyHostToDevice));

  // Join both, then the kernel.
  const cudaGraphNode_t both[] = {memsetNode, copyInNode};
  CUDA_ASSERT(cudaGraphAddEmptyNode(&joinNode, graph, both, 2));
  int nn = n;
  float a = 3.0f;
  void* args[] = {&nn, &a, &dx, &dy};
  cudaKernelNodeParams kp{};
  kp.func = reinterpret_cast<void*>(&saxpy);
  kp.gridDim = dim3(n / 128);
  kp.blockDim = dim3(128);
  kp.sharedMemBytes = 0;
  kp.kernelParams = args;
  kp.extra = nullptr;
  CUDA_ASSERT(cudaGraphAddKernelNode(&kernelNode, graph, &joinNode, 1, &kp));
  a = 100.0f;  // parameters were copied when the node was added

  // y back to the host with the 3D memcpy node.
  cudaMemcpy3DParms cp{};
  cp.srcPtr = make_cudaPitchedPtr(dy, bytes, bytes, 1);
  cp.dstPtr = make_cudaPitchedPtr(hout.p, bytes, bytes, 1);
  cp.extent = make_cudaExtent(bytes, 1, 1);
  cp.kind = cudaMemcpyDeviceToHost;
  CUDA_ASSERT(cudaGraphAddMemcpyNode(&copyOutNode, graph, &kernelNode, 1, &cp));

  // A host node that sees the copied result.
  HostProbe hp;
  hp.watch = hout.p + 7;
  DeviceDrain drain;  // after everything the graph's nodes refer to
  cudaHostNodeParams hn{};
  hn.fn = probe;
  hn.userData = &hp;
  CUDA_ASSERT(cudaGraphAddHostNode(&hostNode, graph, &copyOutNode, 1, &hn));

  size_t count = 0;
  auto types = nodeTypes(graph, &count);
  EXPECT_EQ(6u, count);
  EXPECT_EQ(1, types[cudaGraphNodeTypeMemset]);
  EXPECT_EQ(2, types[cudaGraphNodeTypeMemcpy]);
  EXPECT_EQ(1, types[cudaGraphNodeTypeKernel]);
  EXPECT_EQ(1, types[cudaGraphNodeTypeEmpty]);
  EXPECT_EQ(1, types[cudaGraphNodeTypeHost]);
  size_t edges = 0;
  CUDA_ASSERT(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges));
  EXPECT_EQ(5u, edges);
  size_t roots = 0;
  CUDA_ASSERT(cudaGraphGetRootNodes(graph, nullptr, &roots));
  EXPECT_EQ(2u, roots);

  cudaGraphExec_t exec = nullptr;
  CUDA_ASSERT(cudaGraphInstantiate(&exec, graph, 0));
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaGraphUpload(exec, s));

  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < n; ++i) hout[i] = -1.0f;
    CUDA_ASSERT(cudaGraphLaunch(exec, s));
    CUDA_ASSERT(cudaStreamSynchronize(s));
    for (int i = 0; i < n; ++i) ASSERT_EQ(3.0f * (i % 100) + 1.0f, hout[i]) << "round " << round << " i " << i;
  }
  {
    std::lock_guard<std::mutex> lock(hp.mu);
    ASSERT_EQ(2u, hp.seen.size());
    EXPECT_EQ(3.0f * 7 + 1.0f, hp.seen[0]);
    EXPECT_EQ(3.0f * 7 + 1.0f, hp.seen[1]);
  }

  // Change the kernel's scale factor in the executable graph only.
  a = 5.0f;
  CUDA_ASSERT(cudaGraphExecKernelNodeSetParams(exec, kernelNode, &kp));
  CUDA_ASSERT(cudaGraphLaunch(exec, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (int i = 0; i < n; ++i) ASSERT_EQ(5.0f * (i % 100) + 1.0f, hout[i]) << i;

  // A second instantiation of the unchanged graph still uses the original factor.
  cudaGraphExec_t exec2 = nullptr;
  CUDA_ASSERT(cudaGraphInstantiate(&exec2, graph, 0));
  CUDA_ASSERT(cudaGraphLaunch(exec2, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (int i = 0; i < n; ++i) ASSERT_EQ(3.0f * (i % 100) + 1.0f, hout[i]) << i;

  CUDA_ASSERT(cudaGraphExecDestroy(exec));
  CUDA_ASSERT(cudaGraphExecDestroy(exec2));
  CUDA_ASSERT(cudaGraphDestroy(graph));
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaFree(dx));
  CUDA_ASSERT(cudaFree(dy));
}

TEST(Graphs, DestroyGraphAfterInstantiate) {
  // An executable graph outlives the graph it was made from.
  void* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, 256));
  Pinned<uint8_t> h(256);
  ASSERT_NE(nullptr, h.p);
  DeviceDrain drain;
  cudaGraph_t graph = nullptr;
  CUDA_ASSERT(cudaGraphCreate(&graph, 0));
  cudaMemsetParams ms{};
  ms.dst = d;
  ms.value = 0xc4;
  ms.elementSize = 1;
  ms.width = 256;
  ms.height = 1;
  cudaGraphNode_t m, c;
  CUDA_ASSERT(cudaGraphAddMemsetNode(&m, graph, nullptr, 0, &ms));
  CUDA_ASSERT(cudaGraphAddMemcpyNode1D(&c, graph, &m, 1, h.p, d, 256, cudaMemcpyDeviceToHost));
  cudaGraphExec_t exec = nullptr;
  CUDA_ASSERT(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_ASSERT(cudaGraphDestroy(graph));
  std::memset(h.p, 0, 256);
  CUDA_ASSERT(cudaGraphLaunch(exec, 0));
  CUDA_ASSERT(cudaDeviceSynchronize());
  for (int i = 0; i < 256; ++i) ASSERT_EQ(0xc4, h.p[i]) << i;
  CUDA_ASSERT(cudaGraphExecDestroy(exec));
  CUDA_ASSERT(cudaFree(d));
}
