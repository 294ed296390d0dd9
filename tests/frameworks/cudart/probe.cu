// A first CUDA program, run by scripts/test-frameworks.sh against every libcudart 13.x that PyPI's
// nvidia-cuda-runtime wheels carry (shared: found first on LD_LIBRARY_PATH; static: linked in),
// on simgpu. It exercises what a framework does at start: device count and properties, memory
// info, allocation, copies both ways, a kernel launch (with a simgpu host body, so the result is
// checked), a stream, an event and a captured graph. Prints "probe ok <runtime version>" and
// exits 0, or names the first call that failed and exits 1.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "simgpu/simgpu.h"

#define CHECK(call)                                                                     \
  do {                                                                                  \
    const cudaError_t e_ = (call);                                                      \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "probe: %s failed: %d (%s)\n", #call, static_cast<int>(e_), \
                   cudaGetErrorName(e_));                                               \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

#define EXPECT(cond)                                             \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "probe: expected %s\n", #cond);      \
      return 1;                                                  \
    }                                                            \
  } while (0)

__global__ void add_one(int* p, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

extern "C" void simgpu_host__Z7add_onePii(const simgpu_launch* l) {
  int* p = *static_cast<int**>(l->params[0]);
  const int n = *static_cast<int*>(l->params[1]);
  const long long threads = static_cast<long long>(l->grid[0]) * l->block[0];
  for (long long i = 0; i < n && i < threads; ++i) p[i] += 1;
}

int main() {
  int runtime = 0, driver = 0, count = 0;
  CHECK(cudaRuntimeGetVersion(&runtime));
  CHECK(cudaDriverGetVersion(&driver));
  CHECK(cudaGetDeviceCount(&count));
  EXPECT(count >= 1);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  EXPECT(prop.totalGlobalMem > 0);
  CHECK(cudaSetDevice(0));
  size_t freeBytes = 0, totalBytes = 0;
  CHECK(cudaMemGetInfo(&freeBytes, &totalBytes));
  EXPECT(totalBytes == prop.totalGlobalMem && freeBytes <= totalBytes);

  constexpr int n = 1000;
  int host[n];
  for (int i = 0; i < n; ++i) host[i] = i;
  int* dev = nullptr;
  CHECK(cudaMalloc(&dev, sizeof host));
  size_t freeAfter = 0;
  CHECK(cudaMemGetInfo(&freeAfter, &totalBytes));
  EXPECT(freeAfter + sizeof host <= freeBytes);
  CHECK(cudaMemcpy(dev, host, sizeof host, cudaMemcpyHostToDevice));
  add_one<<<(n + 255) / 256, 256>>>(dev, n);
  CHECK(cudaGetLastError());

  // A stream, an event and a graph captured from the stream, replayed twice.
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t done = nullptr;
  CHECK(cudaEventCreate(&done));
  CHECK(cudaDeviceSynchronize());
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  add_one<<<(n + 255) / 256, 256, 0, stream>>>(dev, n);
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(done, stream));
  CHECK(cudaEventSynchronize(done));

  CHECK(cudaMemcpy(host, dev, sizeof host, cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) {
    if (host[i] != i + 3) {
      std::fprintf(stderr, "probe: element %d is %d, expected %d\n", i, host[i], i + 3);
      return 1;
    }
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(done));
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaFree(dev));
  std::printf("probe ok runtime %d driver %d\n", runtime, driver);
  return 0;
}
