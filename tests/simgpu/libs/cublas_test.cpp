// cuBLAS (the real toolkit library) on simgpu: handle life cycle, memory accounting, streams and
// the vector/matrix copy helpers (pure copies, so their data can be checked on simgpu).
//
// cublasCreate probes the largest thread-block cluster the device runs: it loads
// cublas::internal::nopClusterDiscoveryTool, allows non-portable cluster sizes, and calls
// cuOccupancyMaxActiveClusters (cudaOccupancyMaxActiveClusters) with cluster sizes 1, 2, 3, ...
// (grid = cluster size, 128 threads, 233472 bytes of dynamic shared memory) until a call answers
// 0 clusters or an error. A driver that refuses that call makes cublasCreate return
// CUBLAS_STATUS_INTERNAL_ERROR.
#include <cublas_v2.h>

#include <cstdio>
#include <vector>

#include "cuda_check.h"

using namespace simtest;

#define CUBLAS_ASSERT(expr)                                                                     \
  do {                                                                                          \
    const cublasStatus_t cublas_assert_st_ = (expr);                                            \
    ASSERT_EQ(CUBLAS_STATUS_SUCCESS, cublas_assert_st_)                                         \
        << #expr << " -> " << cublasGetStatusName(cublas_assert_st_);                           \
  } while (0)

#define CUBLAS_EXPECT(expr)                                                                     \
  do {                                                                                          \
    const cublasStatus_t cublas_expect_st_ = (expr);                                            \
    EXPECT_EQ(CUBLAS_STATUS_SUCCESS, cublas_expect_st_)                                         \
        << #expr << " -> " << cublasGetStatusName(cublas_expect_st_);                           \
  } while (0)

namespace {

// Owns a handle so a failed ASSERT does not leak it.
struct Handle {
  cublasHandle_t h = nullptr;
  ~Handle() {
    if (h) (void)cublasDestroy(h);
  }
};

}  // namespace

TEST(Cublas, CreateDestroyAccountsMemory) {
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaFree(nullptr));  // the primary context exists before the first measurement
  size_t free0 = 0, total = 0;
  memInfo(&free0, &total);
  ASSERT_GT(total, 0u);

  size_t freeLive = 0;
  {
    Handle handle;
    CUBLAS_ASSERT(cublasCreate(&handle.h));
    ASSERT_NE(nullptr, handle.h);
    int version = 0;
    CUBLAS_EXPECT(cublasGetVersion(handle.h, &version));
    EXPECT_GE(version, 130000);
    memInfo(&freeLive, &total);
    // The handle holds device memory (its default workspace and constants).
    if (onSimgpu()) {
      EXPECT_LT(freeLive, free0) << "cublasCreate allocated no device memory";
    }
    if (freeLive < free0)
      std::printf("the handle holds %.2f MiB\n", static_cast<double>(free0 - freeLive) / static_cast<double>(MiB));
    CUBLAS_ASSERT(cublasDestroy(handle.h));
    handle.h = nullptr;
  }
  size_t free1 = 0;
  memInfo(&free1, &total);
  // Destroying the handle gives back what it took. Module-level state cuBLAS loads once per process
  // (its kernels' globals) may stay; a second create/destroy cycle must then leak nothing at all.
  {
    Handle handle;
    CUBLAS_ASSERT(cublasCreate(&handle.h));
    size_t freeLive2 = 0;
    memInfo(&freeLive2, &total);
    if (onSimgpu()) {
      EXPECT_LT(freeLive2, free1);
    }
    CUBLAS_ASSERT(cublasDestroy(handle.h));
    handle.h = nullptr;
  }
  size_t free2 = 0;
  memInfo(&free2, &total);
  EXPECT_GE(free2 + memSlack(), free1) << "a create/destroy cycle leaked device memory";
  EXPECT_GE(free1 + memSlack(), freeLive);
  if (onSimgpu()) {
    EXPECT_EQ(free1, free2);
  }
}

TEST(Cublas, SetStreamAndPointerMode) {
  Handle handle;
  CUBLAS_ASSERT(cublasCreate(&handle.h));
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUBLAS_EXPECT(cublasSetStream(handle.h, stream));
  cudaStream_t got = nullptr;
  CUBLAS_EXPECT(cublasGetStream(handle.h, &got));
  EXPECT_EQ(stream, got);
  CUBLAS_EXPECT(cublasSetPointerMode(handle.h, CUBLAS_POINTER_MODE_DEVICE));
  cublasPointerMode_t mode = CUBLAS_POINTER_MODE_HOST;
  CUBLAS_EXPECT(cublasGetPointerMode(handle.h, &mode));
  EXPECT_EQ(CUBLAS_POINTER_MODE_DEVICE, mode);
  // Back to the legacy default stream before the stream goes away.
  CUBLAS_EXPECT(cublasSetStream(handle.h, nullptr));
  CUDA_EXPECT(cudaStreamDestroy(stream));
  CUBLAS_ASSERT(cublasDestroy(handle.h));
  handle.h = nullptr;
}

TEST(Cublas, SetGetVectorRoundTrip) {
  Handle handle;
  CUBLAS_ASSERT(cublasCreate(&handle.h));
  const int n = 1000;
  std::vector<float> x(n), y(n, -1.0f);
  for (int i = 0; i < n; ++i) x[i] = 0.5f * static_cast<float>(i) - 7.0f;
  size_t free0 = 0, total = 0;
  memInfo(&free0, &total);
  float* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(float)));
  size_t free1 = 0;
  memInfo(&free1, &total);
  if (onSimgpu()) {
    EXPECT_LE(free1 + n * sizeof(float), free0);
  }
  CUDA_ASSERT(cudaMemset(d, 0, n * sizeof(float)));

  // Contiguous round trip.
  CUBLAS_ASSERT(cublasSetVector(n, sizeof(float), x.data(), 1, d, 1));
  CUBLAS_ASSERT(cublasGetVector(n, sizeof(float), d, 1, y.data(), 1));
  EXPECT_EQ(x, y);

  // Strided: every third host element into every second device element, and back out.
  const int m = n / 3;
  CUDA_ASSERT(cudaMemset(d, 0, n * sizeof(float)));
  CUBLAS_ASSERT(cublasSetVector(m, sizeof(float), x.data(), 3, d, 2));
  std::vector<float> dev(n, -1.0f);
  CUDA_ASSERT(cudaMemcpy(dev.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) {
    const float want = (i % 2 == 0 && i / 2 < m) ? x[(i / 2) * 3] : 0.0f;
    ASSERT_EQ(want, dev[i]) << "device element " << i;
  }
  std::vector<float> back(m, 0.0f);
  CUBLAS_ASSERT(cublasGetVector(m, sizeof(float), d, 2, back.data(), 1));
  for (int i = 0; i < m; ++i) ASSERT_EQ(x[i * 3], back[i]) << "element " << i;

  // Asynchronous variant on a stream.
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreate(&stream));
  std::vector<float> z(n, 0.0f);
  CUBLAS_EXPECT(cublasSetVectorAsync(n, sizeof(float), x.data(), 1, d, 1, stream));
  CUBLAS_EXPECT(cublasGetVectorAsync(n, sizeof(float), d, 1, z.data(), 1, stream));
  CUDA_EXPECT(cudaStreamSynchronize(stream));
  EXPECT_EQ(x, z);
  CUDA_EXPECT(cudaStreamDestroy(stream));

  CUDA_EXPECT(cudaFree(d));
  size_t free2 = 0;
  memInfo(&free2, &total);
  EXPECT_EQ(free0, free2);
}

TEST(Cublas, SetGetMatrixRoundTrip) {
  Handle handle;
  CUBLAS_ASSERT(cublasCreate(&handle.h));
  // A 5x4 sub-matrix of a host matrix with leading dimension 7, into a device matrix with lda 6.
  const int rows = 5, cols = 4, ldh = 7, ldd = 6;
  std::vector<double> h(ldh * cols);
  for (size_t i = 0; i < h.size(); ++i) h[i] = 1.25 * static_cast<double>(i) + 3.0;
  double* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, ldd * cols * sizeof(double)));
  CUDA_ASSERT(cudaMemset(d, 0, ldd * cols * sizeof(double)));
  CUBLAS_ASSERT(cublasSetMatrix(rows, cols, sizeof(double), h.data(), ldh, d, ldd));
  std::vector<double> dev(ldd * cols, -1.0);
  CUDA_ASSERT(cudaMemcpy(dev.data(), d, dev.size() * sizeof(double), cudaMemcpyDeviceToHost));
  for (int c = 0; c < cols; ++c)
    for (int r = 0; r < ldd; ++r) {
      const double want = r < rows ? h[c * ldh + r] : 0.0;
      ASSERT_EQ(want, dev[c * ldd + r]) << "row " << r << " col " << c;
    }
  std::vector<double> out(rows * cols, 0.0);
  CUBLAS_ASSERT(cublasGetMatrix(rows, cols, sizeof(double), d, ldd, out.data(), rows));
  for (int c = 0; c < cols; ++c)
    for (int r = 0; r < rows; ++r) ASSERT_EQ(h[c * ldh + r], out[c * rows + r]) << "row " << r << " col " << c;
  CUDA_EXPECT(cudaFree(d));
}

// cublasSgemm asks cuBLASLt for an algorithm; cuBLASLt finds kernels for the device only because
// simgpu answers two private calls it makes itself: TOOLS_TLS slot 2 (the current context) and the
// CONTEXT_IDS table's slot 4 (the context's id, on which cuBLASLt keys a per-context cache). The
// GEMM kernel is launched but nothing is computed on simgpu, so C is not checked.
TEST(Cublas, Sgemm) {
  Handle handle;
  CUBLAS_ASSERT(cublasCreate(&handle.h));
  const int n = 64;
  float *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_ASSERT(cudaMalloc(&a, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMalloc(&b, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMalloc(&c, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMemset(a, 0, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMemset(b, 0, n * n * sizeof(float)));
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_EXPECT(cublasSgemm(handle.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n));
  CUDA_EXPECT(cudaDeviceSynchronize());
  CUDA_EXPECT(cudaFree(a));
  CUDA_EXPECT(cudaFree(b));
  CUDA_EXPECT(cudaFree(c));
}

// At 512 x 512 cuBLAS takes another kernel path (sm80_xmma_gemm_..._tilesize64x64x8) than at 64 x 64:
// before each launch it asks the driver, through the CONTEXT_IDS table, for its own handle of the
// handle's stream (slot 51) and that stream's id (slot 39), and fails with
// CUBLAS_STATUS_INTERNAL_ERROR if either call fails. Run on the legacy default stream, a created
// stream and the per-thread default stream, the three kinds of handle slot 51 is given. Nothing is
// computed on simgpu, so C is not checked.
TEST(Cublas, SgemmLarge) {
  Handle handle;
  CUBLAS_ASSERT(cublasCreate(&handle.h));
  const int n = 512;
  float *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_ASSERT(cudaMalloc(&a, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMalloc(&b, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMalloc(&c, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMemset(a, 0, n * n * sizeof(float)));
  CUDA_ASSERT(cudaMemset(b, 0, n * n * sizeof(float)));
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_EXPECT(cublasSgemm(handle.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n));
  CUDA_EXPECT(cudaDeviceSynchronize());

  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreate(&stream));
  CUBLAS_EXPECT(cublasSetStream(handle.h, stream));
  CUBLAS_EXPECT(cublasSgemm(handle.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n));
  CUDA_EXPECT(cudaStreamSynchronize(stream));

  CUBLAS_EXPECT(cublasSetStream(handle.h, cudaStreamPerThread));
  CUBLAS_EXPECT(cublasSgemm(handle.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n));
  CUDA_EXPECT(cudaStreamSynchronize(cudaStreamPerThread));

  CUBLAS_EXPECT(cublasSetStream(handle.h, nullptr));
  CUDA_EXPECT(cudaStreamDestroy(stream));
  CUDA_EXPECT(cudaFree(a));
  CUDA_EXPECT(cudaFree(b));
  CUDA_EXPECT(cudaFree(c));
}
