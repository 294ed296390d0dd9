// Kernel launches through the CUDA runtime API: <<<>>>, cudaLaunchKernel, cudaLaunchKernelEx,
// cudaLaunchCooperativeKernel, function attributes, occupancy, ordering with copies, errors.
//
// Every kernel that produces data has a simgpu host body (simgpu_host_<mangled name>) with the
// same semantics as its device code, including which indices the launched grid covers, so the
// data checks hold on simgpu and on a real GPU alike. Checks of what the host body observed
// (launch records) only run on simgpu.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "simgpu/simgpu.h"

using namespace simtest;

// ---- Kernels ------------------------------------------------------------------------------------

__global__ void saxpy(int n, float a, const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

__global__ void fill2d(int* out, int w, int h) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  if (x < w && y < h) out[y * w + x] = x * 1000 + y;
}

template <typename T>
__global__ void scale(T* p, T factor, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] *= factor;
}
template __global__ void scale<float>(float*, float, int);

struct Params {
  int a;
  double b;
  short c;
  char tag[3];
};

__global__ void struct_param(Params p, int* out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    out[0] = p.a;
    out[1] = static_cast<int>(p.b * 10.0);
    out[2] = p.c;
    out[3] = p.tag[0] + p.tag[1] + p.tag[2];
  }
}

// Writes gridDim.x into out[i] for every launched thread i < n.
__global__ void grid_stamp(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<int>(gridDim.x);
}

// Uses dynamic shared memory; writes its size (in ints) to out[0].
__global__ void dyn_shared(int* out) {
  extern __shared__ int smem[];
  smem[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    out[0] = static_cast<int>(bytes);
  }
}

// No host body: simgpu launches it successfully and runs nothing.
__global__ void no_host_body(int* p, int v) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  p[i] = v;
}

// ---- Host bodies (simgpu) -----------------------------------------------------------------------

namespace {

struct LaunchRecord {
  std::string name;
  unsigned grid[3] = {0, 0, 0};
  unsigned block[3] = {0, 0, 0};
  unsigned sharedMem = 0;
  int device = -1;
};

std::mutex g_mu;
std::vector<LaunchRecord> g_launches;

void remember(const simgpu_launch* l) {
  LaunchRecord r;
  r.name = l->name ? l->name : "";
  std::memcpy(r.grid, l->grid, sizeof r.grid);
  std::memcpy(r.block, l->block, sizeof r.block);
  r.sharedMem = l->shared_mem;
  r.device = l->device;
  std::lock_guard<std::mutex> lock(g_mu);
  g_launches.push_back(r);
}

std::vector<LaunchRecord> launchesOf(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<LaunchRecord> out;
  for (const auto& r : g_launches)
    if (r.name == name) out.push_back(r);
  return out;
}

void clearLaunches() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_launches.clear();
}

// Number of threads a 1-D launch covers.
long long threads1d(const simgpu_launch* l) {
  return static_cast<long long>(l->grid[0]) * l->block[0];
}

template <typename T>
T arg(const simgpu_launch* l, int i) {
  T v;
  std::memcpy(&v, l->params[i], sizeof v);
  return v;
}

}  // namespace

extern "C" {

// saxpy(int, float, const float*, float*)
void simgpu_host__Z5saxpyifPKfPf(const simgpu_launch* l) {
  remember(l);
  const int n = arg<int>(l, 0);
  const float a = arg<float>(l, 1);
  const float* x = arg<const float*>(l, 2);
  float* y = arg<float*>(l, 3);
  const long long m = std::min<long long>(n, threads1d(l));
  for (long long i = 0; i < m; ++i) y[i] = a * x[i] + y[i];
}

// fill2d(int*, int, int)
void simgpu_host__Z6fill2dPiii(const simgpu_launch* l) {
  remember(l);
  int* out = arg<int*>(l, 0);
  const int w = arg<int>(l, 1), h = arg<int>(l, 2);
  const long long xs = static_cast<long long>(l->grid[0]) * l->block[0];
  const long long ys = static_cast<long long>(l->grid[1]) * l->block[1];
  for (long long y = 0; y < std::min<long long>(h, ys); ++y)
    for (long long x = 0; x < std::min<long long>(w, xs); ++x) out[y * w + x] = static_cast<int>(x * 1000 + y);
}

// scale<float>(float*, float, int)
void simgpu_host__Z5scaleIfEvPT_S0_i(const simgpu_launch* l) {
  remember(l);
  float* p = arg<float*>(l, 0);
  const float f = arg<float>(l, 1);
  const int n = arg<int>(l, 2);
  const long long m = std::min<long long>(n, threads1d(l));
  for (long long i = 0; i < m; ++i) p[i] *= f;
}

// struct_param(Params, int*)
void simgpu_host__Z12struct_param6ParamsPi(const simgpu_launch* l) {
  remember(l);
  const Params p = arg<Params>(l, 0);
  int* out = arg<int*>(l, 1);
  out[0] = p.a;
  out[1] = static_cast<int>(p.b * 10.0);
  out[2] = p.c;
  out[3] = p.tag[0] + p.tag[1] + p.tag[2];
}

// grid_stamp(int*, int)
void simgpu_host__Z10grid_stampPii(const simgpu_launch* l) {
  remember(l);
  int* out = arg<int*>(l, 0);
  const int n = arg<int>(l, 1);
  const long long m = std::min<long long>(n, threads1d(l));
  for (long long i = 0; i < m; ++i) out[i] = static_cast<int>(l->grid[0]);
}

// dyn_shared(int*)
void simgpu_host__Z10dyn_sharedPi(const simgpu_launch* l) {
  remember(l);
  arg<int*>(l, 0)[0] = static_cast<int>(l->shared_mem);
}

}  // extern "C"

// ---- Tests --------------------------------------------------------------------------------------

namespace {

struct SaxpyBuffers {
  int n;
  std::vector<float> x, y;
  float *dx = nullptr, *dy = nullptr;
  explicit SaxpyBuffers(int count) : n(count), x(count), y(count) {
    for (int i = 0; i < n; ++i) {
      x[i] = 0.5f * i;
      y[i] = 1000.0f - i;
    }
  }
  cudaError_t upload() {
    cudaError_t e = cudaMalloc(&dx, n * sizeof(float));
    if (e == cudaSuccess) e = cudaMalloc(&dy, n * sizeof(float));
    if (e == cudaSuccess) e = cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    return e;
  }
  ~SaxpyBuffers() {
    cudaFree(dx);
    cudaFree(dy);
  }
};

}  // namespace

TEST(Kernels, SaxpyTripleChevron) {
  clearLaunches();
  SaxpyBuffers b(10000);
  CUDA_ASSERT(b.upload());
  const int block = 256, grid = (b.n + block - 1) / block;
  saxpy<<<grid, block>>>(b.n, 2.0f, b.dx, b.dy);
  CUDA_ASSERT(cudaGetLastError());
  std::vector<float> out(b.n);
  CUDA_ASSERT(cudaMemcpy(out.data(), b.dy, b.n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < b.n; ++i) ASSERT_EQ(2.0f * b.x[i] + b.y[i], out[i]) << i;
  CUDA_ASSERT(cudaDeviceSynchronize());
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  EXPECT_EQ(cudaSuccess, cudaPeekAtLastError());
  if (onSimgpu()) {
    const auto rec = launchesOf("_Z5saxpyifPKfPf");
    ASSERT_EQ(1u, rec.size());
    EXPECT_EQ(static_cast<unsigned>(grid), rec[0].grid[0]);
    EXPECT_EQ(1u, rec[0].grid[1]);
    EXPECT_EQ(1u, rec[0].grid[2]);
    EXPECT_EQ(static_cast<unsigned>(block), rec[0].block[0]);
    EXPECT_EQ(1u, rec[0].block[1]);
    EXPECT_EQ(0u, rec[0].sharedMem);
    EXPECT_EQ(0, rec[0].device);
  }
}

TEST(Kernels, GridCoverageIsRespected) {
  // A grid smaller than n updates only the threads it launches.
  SaxpyBuffers b(1000);
  CUDA_ASSERT(b.upload());
  saxpy<<<2, 256>>>(b.n, 3.0f, b.dx, b.dy);
  CUDA_ASSERT(cudaGetLastError());
  std::vector<float> out(b.n);
  CUDA_ASSERT(cudaMemcpy(out.data(), b.dy, b.n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < b.n; ++i) ASSERT_EQ(i < 512 ? 3.0f * b.x[i] + b.y[i] : b.y[i], out[i]) << i;
}

TEST(Kernels, MultiDimensionalLaunch) {
  clearLaunches();
  const int w = 30, h = 11;
  int* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, w * h * sizeof(int)));
  CUDA_ASSERT(cudaMemset(d, 0xff, w * h * sizeof(int)));
  const dim3 block(8, 4, 1), grid((w + 7) / 8, (h + 3) / 4, 1);
  fill2d<<<grid, block>>>(d, w, h);
  CUDA_ASSERT(cudaGetLastError());
  std::vector<int> out(w * h);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, out.size() * sizeof(int), cudaMemcpyDeviceToHost));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) ASSERT_EQ(x * 1000 + y, out[y * w + x]) << x << "," << y;
  if (onSimgpu()) {
    const auto rec = launchesOf("_Z6fill2dPiii");
    ASSERT_EQ(1u, rec.size());
    EXPECT_EQ(grid.x, rec[0].grid[0]);
    EXPECT_EQ(grid.y, rec[0].grid[1]);
    EXPECT_EQ(block.x, rec[0].block[0]);
    EXPECT_EQ(block.y, rec[0].block[1]);
    EXPECT_EQ(1u, rec[0].block[2]);
  }
  CUDA_ASSERT(cudaFree(d));
}

TEST(Kernels, TemplateAndStructArguments) {
  const int n = 300;
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<float>(i);
  float* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(float)));
  CUDA_ASSERT(cudaMemcpy(d, v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  scale<float><<<(n + 127) / 128, 128>>>(d, 1.5f, n);
  CUDA_ASSERT(cudaGetLastError());
  std::vector<float> out(n);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) ASSERT_EQ(1.5f * i, out[i]) << i;
  CUDA_ASSERT(cudaFree(d));

  Params p{};
  p.a = -42;
  p.b = 3.25;
  p.c = 1234;
  p.tag[0] = 1;
  p.tag[1] = 2;
  p.tag[2] = 3;
  int* o = nullptr;
  CUDA_ASSERT(cudaMalloc(&o, 4 * sizeof(int)));
  CUDA_ASSERT(cudaMemset(o, 0, 4 * sizeof(int)));
  struct_param<<<1, 32>>>(p, o);
  CUDA_ASSERT(cudaGetLastError());
  int res[4] = {};
  CUDA_ASSERT(cudaMemcpy(res, o, sizeof res, cudaMemcpyDeviceToHost));
  EXPECT_EQ(-42, res[0]);
  EXPECT_EQ(32, res[1]);
  EXPECT_EQ(1234, res[2]);
  EXPECT_EQ(6, res[3]);
  CUDA_ASSERT(cudaFree(o));
}

TEST(Kernels, KernelWithoutHostBodyLaunches) {
  const int n = 64;
  int* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(int)));
  CUDA_ASSERT(cudaMemset(d, 0, n * sizeof(int)));
  no_host_body<<<1, n>>>(d, 7);
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<int> out(n, -1);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
  // simgpu runs nothing for a kernel without a host body; a real GPU runs the device code.
  const int want = onSimgpu() ? 0 : 7;
  for (int i = 0; i < n; ++i) ASSERT_EQ(want, out[i]) << i;
  CUDA_ASSERT(cudaFree(d));
}

TEST(Kernels, LaunchKernelCApi) {
  SaxpyBuffers b(1024);
  CUDA_ASSERT(b.upload());
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int n = b.n;
  float a = -1.0f;
  void* args[] = {&n, &a, &b.dx, &b.dy};
  CUDA_ASSERT(cudaLaunchKernel(reinterpret_cast<const void*>(&saxpy), dim3(4), dim3(256), args, 0, s));
  std::vector<float> out(b.n);
  CUDA_ASSERT(cudaMemcpyAsync(out.data(), b.dy, b.n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (int i = 0; i < b.n; ++i) ASSERT_EQ(-b.x[i] + b.y[i], out[i]) << i;
  CUDA_ASSERT(cudaStreamDestroy(s));
}

TEST(Kernels, LaunchKernelEx) {
  clearLaunches();
  SaxpyBuffers b(2048);
  CUDA_ASSERT(b.upload());
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(8);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = 128;
  cfg.stream = s;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  CUDA_ASSERT(cudaLaunchKernelEx(&cfg, saxpy, b.n, 4.0f, static_cast<const float*>(b.dx), b.dy));
  std::vector<float> out(b.n);
  CUDA_ASSERT(cudaMemcpyAsync(out.data(), b.dy, b.n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (int i = 0; i < b.n; ++i) ASSERT_EQ(4.0f * b.x[i] + b.y[i], out[i]) << i;
  if (onSimgpu()) {
    const auto rec = launchesOf("_Z5saxpyifPKfPf");
    ASSERT_EQ(1u, rec.size());
    EXPECT_EQ(8u, rec[0].grid[0]);
    EXPECT_EQ(256u, rec[0].block[0]);
    EXPECT_EQ(128u, rec[0].sharedMem);
  }
  CUDA_ASSERT(cudaStreamDestroy(s));
}

TEST(Kernels, LaunchKernelExWithAttributes) {
  SaxpyBuffers b(2048);
  CUDA_ASSERT(b.upload());
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 2;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributePriority;
  int least = 0, greatest = 0;
  CUDA_ASSERT(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  attrs[1].val.priority = greatest;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(8);
  cfg.blockDim = dim3(256);
  cfg.stream = 0;
  cfg.attrs = attrs;
  cfg.numAttrs = 2;
  CUDA_ASSERT(cudaLaunchKernelEx(&cfg, saxpy, b.n, 0.5f, static_cast<const float*>(b.dx), b.dy));
  std::vector<float> out(b.n);
  CUDA_ASSERT(cudaMemcpy(out.data(), b.dy, b.n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < b.n; ++i) ASSERT_EQ(0.5f * b.x[i] + b.y[i], out[i]) << i;
}

TEST(Kernels, CooperativeLaunch) {
  int coop = 0, sms = 0;
  CUDA_ASSERT(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  CUDA_ASSERT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (!coop) GTEST_SKIP() << "device without cooperative launch";
  int perSm = 0;
  CUDA_ASSERT(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, grid_stamp, 128, 0));
  ASSERT_GE(perSm, 1);
  const int grid = sms;  // one block per SM always fits
  const int n = grid * 128;
  int* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(int)));
  CUDA_ASSERT(cudaMemset(d, 0, n * sizeof(int)));
  int nn = n;
  void* args[] = {&d, &nn};
  CUDA_ASSERT(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(&grid_stamp), dim3(grid), dim3(128), args, 0, 0));
  std::vector<int> out(n);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) ASSERT_EQ(grid, out[i]) << i;

  // The same through cudaLaunchKernelEx with the cooperative attribute.
  CUDA_ASSERT(cudaMemset(d, 0, n * sizeof(int)));
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(128);
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  CUDA_ASSERT(cudaLaunchKernelEx(&cfg, grid_stamp, d, n));
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) ASSERT_EQ(grid, out[i]) << i;
  CUDA_ASSERT(cudaFree(d));
}

TEST(Kernels, FuncAttributes) {
  cudaDeviceProp prop{};
  CUDA_ASSERT(cudaGetDeviceProperties(&prop, 0));
  cudaFuncAttributes a;
  std::memset(&a, 0xff, sizeof a);
  CUDA_ASSERT(cudaFuncGetAttributes(&a, saxpy));
  EXPECT_GT(a.maxThreadsPerBlock, 0);
  EXPECT_LE(a.maxThreadsPerBlock, 1024);
  EXPECT_GE(a.numRegs, 0);
  EXPECT_LE(a.numRegs, 255);
  EXPECT_GE(a.localSizeBytes, 0u);
  EXPECT_EQ(0u, a.sharedSizeBytes);  // saxpy has no static shared memory
  EXPECT_EQ(prop.major * 10 + prop.minor, a.binaryVersion);

  CUDA_ASSERT(cudaFuncSetAttribute(dyn_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
  CUDA_ASSERT(cudaFuncGetAttributes(&a, dyn_shared));
  EXPECT_EQ(64 * 1024, a.maxDynamicSharedSizeBytes);
  CUDA_ASSERT(cudaFuncSetCacheConfig(saxpy, cudaFuncCachePreferL1));

  // A launch that uses the opted-in dynamic shared memory.
  int* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, sizeof(int)));
  CUDA_ASSERT(cudaMemset(d, 0, sizeof(int)));
  dyn_shared<<<1, 64, 64 * 1024>>>(d);
  CUDA_ASSERT(cudaGetLastError());
  int bytes = 0;
  CUDA_ASSERT(cudaMemcpy(&bytes, d, sizeof bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(64 * 1024, bytes);
  CUDA_ASSERT(cudaFree(d));
}

TEST(Kernels, Occupancy) {
  cudaDeviceProp prop{};
  CUDA_ASSERT(cudaGetDeviceProperties(&prop, 0));
  for (int block : {32, 128, 256, 1024}) {
    int blocks = -1;
    CUDA_ASSERT(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, saxpy, block, 0));
    EXPECT_GE(blocks, 1) << "block " << block;
    EXPECT_LE(blocks * block, prop.maxThreadsPerMultiProcessor) << "block " << block;
    EXPECT_LE(blocks, prop.maxBlocksPerMultiProcessor) << "block " << block;
  }
  int minGrid = 0, blockSize = 0;
  CUDA_ASSERT(cudaOccupancyMaxPotentialBlockSize(&minGrid, &blockSize, saxpy, 0, 0));
  EXPECT_GT(blockSize, 0);
  EXPECT_LE(blockSize, 1024);
  EXPECT_EQ(0, blockSize % 32);
  EXPECT_GE(minGrid, prop.multiProcessorCount);
  size_t dyn = 0;
  CUDA_ASSERT(cudaOccupancyAvailableDynamicSMemPerBlock(&dyn, saxpy, 1, 256));
  EXPECT_GT(dyn, 0u);
}

TEST(Kernels, OrderedWithCopiesOnOneStream) {
  const int n = 4096;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 97);
    y[i] = static_cast<float>(i % 13);
  }
  float *px = nullptr, *py = nullptr, *out1 = nullptr, *out2 = nullptr;
  CUDA_ASSERT(cudaMallocHost(&px, n * sizeof(float)));
  CUDA_ASSERT(cudaMallocHost(&py, n * sizeof(float)));
  CUDA_ASSERT(cudaMallocHost(&out1, n * sizeof(float)));
  CUDA_ASSERT(cudaMallocHost(&out2, n * sizeof(float)));
  std::memcpy(px, x.data(), n * sizeof(float));
  std::memcpy(py, y.data(), n * sizeof(float));
  float *dx = nullptr, *dy = nullptr;
  CUDA_ASSERT(cudaMalloc(&dx, n * sizeof(float)));
  CUDA_ASSERT(cudaMalloc(&dy, n * sizeof(float)));
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int round = 0; round < 3; ++round) {
    CUDA_ASSERT(cudaMemcpyAsync(dx, px, n * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_ASSERT(cudaMemcpyAsync(dy, py, n * sizeof(float), cudaMemcpyHostToDevice, s));
    saxpy<<<n / 256, 256, 0, s>>>(n, 2.0f, dx, dy);
    CUDA_ASSERT(cudaMemcpyAsync(out1, dy, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    saxpy<<<n / 256, 256, 0, s>>>(n, 3.0f, dx, dy);
    CUDA_ASSERT(cudaMemsetAsync(dx, 0, n * sizeof(float), s));
    saxpy<<<n / 256, 256, 0, s>>>(n, 5.0f, dx, dy);  // x is zero now: no change
    CUDA_ASSERT(cudaMemcpyAsync(out2, dy, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_ASSERT(cudaGetLastError());
    CUDA_ASSERT(cudaStreamSynchronize(s));
    for (int i = 0; i < n; ++i) {
      const float first = 2.0f * x[i] + y[i];
      ASSERT_EQ(first, out1[i]) << "round " << round << " i " << i;
      ASSERT_EQ(3.0f * x[i] + first, out2[i]) << "round " << round << " i " << i;
    }
  }
  CUDA_ASSERT(cudaStreamDestroy(s));
  for (float* p : {px, py, out1, out2}) CUDA_ASSERT(cudaFreeHost(p));
  CUDA_ASSERT(cudaFree(dx));
  CUDA_ASSERT(cudaFree(dy));
}

TEST(Kernels, LaunchErrorsAreReportedAndCleared) {
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  int* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, 4096));
  no_host_body<<<1, 2048>>>(d, 1);  // more threads per block than any device allows
  const cudaError_t e = cudaPeekAtLastError();
  EXPECT_TRUE(e == cudaErrorInvalidConfiguration || e == cudaErrorInvalidValue) << cudaGetErrorName(e);
  EXPECT_EQ(e, cudaGetLastError()) << "peek does not clear the error";
  EXPECT_EQ(cudaSuccess, cudaGetLastError()) << "get clears it";
  no_host_body<<<0, 32>>>(d, 1);  // empty grid
  EXPECT_NE(cudaSuccess, cudaGetLastError());
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  // The context is still usable: launch errors are not sticky.
  SaxpyBuffers b(256);
  CUDA_ASSERT(b.upload());
  saxpy<<<1, 256>>>(b.n, 1.0f, b.dx, b.dy);
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<float> out(b.n);
  CUDA_ASSERT(cudaMemcpy(out.data(), b.dy, b.n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < b.n; ++i) ASSERT_EQ(b.x[i] + b.y[i], out[i]) << i;
  CUDA_ASSERT(cudaFree(d));
}
