// libcushare.so under the CUDA runtime: an nvcc-built program, linked once with static cudart and
// once with shared cudart (cudart reaches the driver through cuGetProcAddress in both cases), run
// on simgpu with the shim preloaded under CUSHARE_MEMORY_LIMIT=256MiB (see CMakeLists.txt).
// Every runtime allocation path is limited and counted, the runtime's view is the tenant's, an
// over-limit cudaMalloc is an ordinary non-sticky cudaErrorMemoryAllocation, and driver entry
// points handed out by the runtime (cudaGetDriverEntryPoint[ByVersion]) are the limited ones.
#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "device_used.h"

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kLimit = 256 * kMiB;

#define RT_ASSERT(expr)                                                                        \
  do {                                                                                         \
    const cudaError_t rt_assert_e_ = (expr);                                                   \
    ASSERT_EQ(cudaSuccess, rt_assert_e_) << #expr << " -> " << cudaGetErrorName(rt_assert_e_); \
  } while (0)

// Expects exactly `code`, then takes the (non-sticky) error out of the last-error slot.
#define RT_EXPECT_ERR(code, expr)                                                              \
  do {                                                                                         \
    const cudaError_t rt_expect_e_ = (expr);                                                   \
    EXPECT_EQ((code), rt_expect_e_) << #expr << " -> " << cudaGetErrorName(rt_expect_e_);      \
    (void)cudaGetLastError();                                                                  \
  } while (0)

size_t freeMem() {
  size_t f = 0, t = 0;
  EXPECT_EQ(cudaSuccess, cudaMemGetInfo(&f, &t));
  return f;
}

class RuntimeLimits : public ::testing::Test {
 protected:
  void SetUp() override {
    RT_ASSERT(cudaSetDevice(0));
    RT_ASSERT(cudaFree(nullptr));  // the primary context
    ASSERT_EQ(kLimit, freeMem()) << "the tenant holds memory at the start of the test";
  }
  void TearDown() override {
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(kLimit, freeMem()) << "the test did not give everything back";
  }
};

TEST_F(RuntimeLimits, TheRuntimeSeesTheTenantsDevice) {
  size_t f = 0, t = 0;
  RT_ASSERT(cudaMemGetInfo(&f, &t));
  EXPECT_EQ(kLimit, t);
  EXPECT_EQ(kLimit, f);
  cudaDeviceProp p{};
  RT_ASSERT(cudaGetDeviceProperties(&p, 0));
  EXPECT_EQ(kLimit, p.totalGlobalMem);
}

TEST_F(RuntimeLimits, MallocOverTheLimitIsAnOrdinaryError) {
  void* p = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMalloc(&p, kLimit + 1));
  EXPECT_EQ(nullptr, p);
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaGetLastError()) << "the failure is recorded once";
  EXPECT_EQ(cudaSuccess, cudaGetLastError()) << "and not sticky";
  EXPECT_EQ(cudaSuccess, cudaPeekAtLastError());
  // The context is intact: the whole limit can be allocated, in one piece.
  RT_ASSERT(cudaMalloc(&p, kLimit));
  EXPECT_EQ(0u, freeMem());
  void* q = nullptr;
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaMalloc(&q, 1));
  EXPECT_EQ(cudaErrorMemoryAllocation, cudaGetLastError());
  RT_ASSERT(cudaMemset(p, 0, kMiB));
  RT_ASSERT(cudaDeviceSynchronize());
  RT_ASSERT(cudaFree(p));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST_F(RuntimeLimits, ManagedIsCounted) {
  void* m = nullptr;
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMallocManaged(&m, kLimit + kMiB));
  RT_ASSERT(cudaMallocManaged(&m, 64 * kMiB));
  EXPECT_EQ(kLimit - 64 * kMiB, freeMem());
  void* p = nullptr;
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMalloc(&p, kLimit - 63 * kMiB));
  RT_ASSERT(cudaFree(m));
}

TEST_F(RuntimeLimits, PitchedIsCounted) {
  void* p = nullptr;
  size_t pitch = 0;
  RT_ASSERT(cudaMallocPitch(&p, &pitch, 1000, 1024));
  ASSERT_GE(pitch, 1000u);
  EXPECT_EQ(kLimit - pitch * 1024, freeMem());
  void* q = nullptr;
  size_t pitch2 = 0;
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMallocPitch(&q, &pitch2, 64 * 1024, 4096));  // 256 MiB more
  cudaPitchedPtr pp{};
  RT_ASSERT(cudaMalloc3D(&pp, make_cudaExtent(4096, 1024, 16)));  // 64 MiB, pitched
  EXPECT_EQ(kLimit - pitch * 1024 - pp.pitch * 1024 * 16, freeMem());
  RT_ASSERT(cudaFree(pp.ptr));
  RT_ASSERT(cudaFree(p));
}

TEST_F(RuntimeLimits, StreamOrderedIsCounted) {
  cudaStream_t s;
  RT_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *a = nullptr, *b = nullptr;
  RT_ASSERT(cudaMallocAsync(&a, 128 * kMiB, s));
  EXPECT_EQ(kLimit - 128 * kMiB, freeMem());
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMallocAsync(&b, 129 * kMiB, s));
  cudaMemPool_t pool;
  RT_ASSERT(cudaDeviceGetDefaultMemPool(&pool, 0));
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMallocFromPoolAsync(&b, 129 * kMiB, pool, s));
  RT_ASSERT(cudaMallocFromPoolAsync(&b, 128 * kMiB, pool, s));
  EXPECT_EQ(0u, freeMem());
  RT_ASSERT(cudaFreeAsync(a, s));
  RT_ASSERT(cudaFreeAsync(b, s));
  RT_ASSERT(cudaStreamSynchronize(s));
  // On the default stream (the per-thread one in the _ptds build: cuMemAllocAsync_ptsz).
  void* c = nullptr;
  RT_ASSERT(cudaMallocAsync(&c, 200 * kMiB, cudaStreamPerThread));
  EXPECT_EQ(kLimit - 200 * kMiB, freeMem());
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMallocAsync(&a, 57 * kMiB, 0));
  RT_ASSERT(cudaFreeAsync(c, cudaStreamPerThread));
  RT_ASSERT(cudaStreamSynchronize(cudaStreamPerThread));
  RT_ASSERT(cudaMemPoolTrimTo(pool, 0));
  RT_ASSERT(cudaStreamDestroy(s));
}

TEST_F(RuntimeLimits, ArraysAreCounted) {
  const cudaChannelFormatDesc f = cudaCreateChannelDesc<float>();
  cudaArray_t arr = nullptr;
  RT_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMalloc3DArray(&arr, &f, make_cudaExtent(4096, 4096, 8)));  // 512 MiB
  RT_ASSERT(cudaMalloc3DArray(&arr, &f, make_cudaExtent(4096, 4096, 2)));                                 // 128 MiB
  EXPECT_EQ(kLimit - 128 * kMiB, freeMem());
  cudaArray_t arr2 = nullptr;
  RT_ASSERT(cudaMallocArray(&arr2, &f, 4096, 4096));  // 64 MiB, 2D
  EXPECT_EQ(kLimit - 192 * kMiB, freeMem());
  RT_ASSERT(cudaFreeArray(arr2));
  RT_ASSERT(cudaFreeArray(arr));
}

using MemAllocFn = CUresult (*)(CUdeviceptr*, size_t);
using MemFreeFn = CUresult (*)(CUdeviceptr);
using MemGetInfoFn = CUresult (*)(size_t*, size_t*);

// Checks driver entry points the runtime handed out: cuMemAlloc is limited and counted,
// cuMemGetInfo reports the tenant's view.
void checkEntryPoints(void* allocFn, void* freeFn, void* infoFn) {
  ASSERT_NE(nullptr, allocFn);
  ASSERT_NE(nullptr, freeFn);
  ASSERT_NE(nullptr, infoFn);
  auto alloc = reinterpret_cast<MemAllocFn>(allocFn);
  auto release = reinterpret_cast<MemFreeFn>(freeFn);
  auto info = reinterpret_cast<MemGetInfoFn>(infoFn);
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, alloc(&p, kLimit + 1)) << "the entry point is not limited";
  ASSERT_EQ(CUDA_SUCCESS, alloc(&p, 100 * kMiB));
  size_t f = 0, t = 0;
  ASSERT_EQ(CUDA_SUCCESS, info(&f, &t));
  EXPECT_EQ(kLimit, t);
  EXPECT_EQ(kLimit - 100 * kMiB, f);
  EXPECT_EQ(kLimit - 100 * kMiB, freeMem()) << "the runtime's view misses the driver allocation";
  CUdeviceptr q = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, alloc(&q, 157 * kMiB));
  ASSERT_EQ(CUDA_SUCCESS, release(p));
}

#pragma nv_diag_suppress 1444  // cudaGetDriverEntryPoint is deprecated: still what many programs call
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST_F(RuntimeLimits, DriverEntryPointIsLimited) {
  void *a = nullptr, *f = nullptr, *i = nullptr;
  cudaDriverEntryPointQueryResult st{};
  RT_ASSERT(cudaGetDriverEntryPoint("cuMemAlloc", &a, cudaEnableDefault, &st));
  EXPECT_EQ(cudaDriverEntryPointSuccess, st);
  RT_ASSERT(cudaGetDriverEntryPoint("cuMemFree", &f, cudaEnableDefault, &st));
  RT_ASSERT(cudaGetDriverEntryPoint("cuMemGetInfo", &i, cudaEnableDefault, &st));
  checkEntryPoints(a, f, i);
}
#pragma GCC diagnostic pop

TEST_F(RuntimeLimits, DriverEntryPointByVersionIsLimited) {
  void *a = nullptr, *f = nullptr, *i = nullptr;
  cudaDriverEntryPointQueryResult st{};
  RT_ASSERT(cudaGetDriverEntryPointByVersion("cuMemAlloc", &a, 12000, cudaEnableDefault, &st));
  EXPECT_EQ(cudaDriverEntryPointSuccess, st);
  RT_ASSERT(cudaGetDriverEntryPointByVersion("cuMemFree", &f, 12000, cudaEnableDefault, &st));
  RT_ASSERT(cudaGetDriverEntryPointByVersion("cuMemGetInfo", &i, 12000, cudaEnableDefault, &st));
  checkEntryPoints(a, f, i);
  // The per-thread-default-stream flavour too.
  void* pt = nullptr;
  RT_ASSERT(cudaGetDriverEntryPointByVersion("cuMemAlloc", &pt, 12000, cudaEnablePerThreadDefaultStream, &st));
  checkEntryPoints(pt, f, i);
}

// cudaDeviceReset frees everything of the device's primary context: the tenant's charges for it
// go too, so the room is usable again, and the device's own count agrees.
TEST_F(RuntimeLimits, DeviceResetReturnsTheCharges) {
  const uint64_t base = cushare::test::deviceUsed(0);
  void* p = nullptr;
  RT_ASSERT(cudaMalloc(&p, 200 * kMiB));
  EXPECT_EQ(base + 200 * kMiB, cushare::test::deviceUsed(0));
  RT_ASSERT(cudaDeviceReset());
  EXPECT_EQ(base, cushare::test::deviceUsed(0));
  RT_ASSERT(cudaMalloc(&p, 200 * kMiB));  // the room is back
  RT_ASSERT(cudaFree(p));
}

// A process the shim refuses (here a misspelt variable; as for a bad limit or no ledger) hears
// cudaErrorInitializationError from the runtime, as docs/configuration.md says. Before, the shim
// refused cuGetProcAddress too, the runtime found no entry point and reported
// cudaErrorInsufficientDriver ("CUDA driver version is insufficient for CUDA runtime version"):
// PyTorch users would look for a driver upgrade. The test runs itself again as the refused process.
TEST(RuntimeRefusal, ARefusedProcessHearsAnInitializationError) {
  if (std::getenv("RUNTIME_REFUSAL_CHILD") != nullptr) {
    int n = -1;
    const cudaError_t e = cudaGetDeviceCount(&n);
    void* p = nullptr;
    const cudaError_t m = cudaMalloc(&p, kMiB);
    std::printf("refused: %s, %s, %d devices\n", cudaGetErrorName(e), cudaGetErrorName(m), n);
    // What cuGetProcAddress now answers (found as the runtime finds it: dlsym on libcuda) stays
    // refused: cuInit is the shim's, and the driver is never initialised.
    using GetProc = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW);
    auto getProc = lib ? reinterpret_cast<GetProc>(::dlsym(lib, "cuGetProcAddress_v2")) : nullptr;
    void* init = nullptr;
    void* count = nullptr;
    CUdriverProcAddressQueryResult st;
    if (getProc && getProc("cuInit", &init, 12000, 0, &st) == CUDA_SUCCESS && init &&
        getProc("cuDeviceGetCount", &count, 12000, 0, &st) == CUDA_SUCCESS && count) {
      int devices = -1;
      const CUresult i = reinterpret_cast<CUresult (*)(unsigned)>(init)(0);
      const CUresult c = reinterpret_cast<CUresult (*)(int*)>(count)(&devices);
      std::printf("driver: cuInit %d, cuDeviceGetCount %d\n", static_cast<int>(i), static_cast<int>(c));
    }
    return;
  }
  char self[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  const std::string cmd = std::string("RUNTIME_REFUSAL_CHILD=1 CUSHARE_MEMORY_LIMT=256MiB '") + self +
                          "' --gtest_filter=RuntimeRefusal.* 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[4096];
  for (size_t r; (r = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, r);
  ASSERT_EQ(::pclose(f), 0) << out;
  EXPECT_NE(out.find("refused: cudaErrorInitializationError, cudaErrorInitializationError, -1 devices"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("cushare: unknown variable CUSHARE_MEMORY_LIMT in the environment (misspelt?)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("driver: cuInit 3, cuDeviceGetCount 3"), std::string::npos) << out;
}

}  // namespace
