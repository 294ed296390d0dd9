// An ordinary CUDA program: nothing in it knows about simgpu except the optional host body for
// its kernel (without one the launch still succeeds and the check below reports it).
//   usage: vector_add [MiB to hold] [seconds to hold it]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

__global__ void vectorAdd(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

// simgpu runs this when the kernel above is launched (device memory is host memory there).
struct SimLaunch {
  const char* name;
  unsigned grid[3], block[3], shared_mem;
  int device;
  void** params;
  void** extra;
};
extern "C" void simgpu_host__Z9vectorAddPKfS0_Pfi(const SimLaunch* l) {
  const float* a = *static_cast<const float**>(l->params[0]);
  const float* b = *static_cast<const float**>(l->params[1]);
  float* c = *static_cast<float**>(l->params[2]);
  int n = *static_cast<int*>(l->params[3]);
  for (int i = 0; i < n; ++i) c[i] = a[i] + b[i];
}

int main(int argc, char** argv) {
  const size_t holdMiB = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0;
  const int holdSeconds = argc > 2 ? std::atoi(argv[2]) : 0;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device 0: %s, compute capability %d.%d, %d SMs, %.1f GiB\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30));

  const int n = 1 << 20;
  std::vector<float> a(n), b(n), c(n);
  for (int i = 0; i < n; ++i) {
    a[i] = float(i);
    b[i] = 2.0f * i;
  }
  float *da, *db, *dc;
  CHECK(cudaMalloc(&da, n * sizeof(float)));
  CHECK(cudaMalloc(&db, n * sizeof(float)));
  CHECK(cudaMalloc(&dc, n * sizeof(float)));
  CHECK(cudaMemcpy(da, a.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, b.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  vectorAdd<<<(n + 255) / 256, 256>>>(da, db, dc, n);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(c.data(), dc, n * sizeof(float), cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < n; ++i) wrong += c[i] != 3.0f * i;
  std::printf("vectorAdd of %d floats: %s\n", n, wrong ? "WRONG" : "correct");

  void* hold = nullptr;
  if (holdMiB) {
    CHECK(cudaMalloc(&hold, holdMiB << 20));
    size_t freeB, totalB;
    CHECK(cudaMemGetInfo(&freeB, &totalB));
    std::printf("holding %zu MiB: the device has %zu of %zu MiB free\n", holdMiB, freeB >> 20, totalB >> 20);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(holdSeconds));
  }
  CHECK(cudaFree(hold));
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dc));
  return wrong ? 1 : 0;
}
