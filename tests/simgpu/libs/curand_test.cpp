// cuRAND (the real toolkit library) on simgpu: generator life cycle, seeding and generation into
// device memory. simgpu runs no device code, so the generated values are not checked; the statuses
// and the device-memory accounting are.
#include <curand.h>

#include <vector>

#include "cuda_check.h"

using namespace simtest;

#define CURAND_ASSERT(expr)                                                                     \
  do {                                                                                          \
    const curandStatus_t curand_assert_st_ = (expr);                                            \
    ASSERT_EQ(CURAND_STATUS_SUCCESS, curand_assert_st_) << #expr << " -> " << curand_assert_st_; \
  } while (0)

#define CURAND_EXPECT(expr)                                                                     \
  do {                                                                                          \
    const curandStatus_t curand_expect_st_ = (expr);                                            \
    EXPECT_EQ(CURAND_STATUS_SUCCESS, curand_expect_st_) << #expr << " -> " << curand_expect_st_; \
  } while (0)

namespace {

// Owns a generator so a failed ASSERT does not leak it.
struct Generator {
  curandGenerator_t g = nullptr;
  ~Generator() {
    if (g) (void)curandDestroyGenerator(g);
  }
};

}  // namespace

TEST(Curand, Version) {
  int version = 0;
  CURAND_ASSERT(curandGetVersion(&version));
  EXPECT_GE(version, 10000);
}

TEST(Curand, DefaultGeneratorUniformAccountsMemory) {
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_ASSERT(cudaFree(nullptr));  // the primary context exists before the first measurement
  size_t free0 = 0, total = 0;
  memInfo(&free0, &total);

  const size_t n = 1 << 20;
  float* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(float)));
  size_t freeBuf = 0;
  memInfo(&freeBuf, &total);
  EXPECT_LE(freeBuf + n * sizeof(float), free0 + memSlack());

  size_t freeGen = 0, freeAfterGen = 0;
  {
    Generator gen;
    CURAND_ASSERT(curandCreateGenerator(&gen.g, CURAND_RNG_PSEUDO_DEFAULT));
    ASSERT_NE(nullptr, gen.g);
    CURAND_EXPECT(curandSetPseudoRandomGeneratorSeed(gen.g, 1234ULL));
    CURAND_EXPECT(curandSetGeneratorOffset(gen.g, 0ULL));
    // The default generator (XORWOW) keeps its per-thread states in device memory.
    CURAND_ASSERT(curandGenerateUniform(gen.g, d, n));
    CUDA_EXPECT(cudaDeviceSynchronize());
    memInfo(&freeGen, &total);
    if (onSimgpu()) {
      EXPECT_LT(freeGen, freeBuf) << "the generator's states take no device memory";
    }
    // More output through the same generator; the state memory stays allocated, nothing more.
    CURAND_EXPECT(curandGenerateUniform(gen.g, d, n / 2));
    CURAND_EXPECT(curandGenerateNormal(gen.g, d, n, 0.0f, 1.0f));
    CUDA_EXPECT(cudaDeviceSynchronize());
    memInfo(&freeAfterGen, &total);
    if (onSimgpu()) {
      EXPECT_EQ(freeGen, freeAfterGen);
    }
    CURAND_ASSERT(curandDestroyGenerator(gen.g));
    gen.g = nullptr;
  }
  size_t freeDestroyed = 0;
  memInfo(&freeDestroyed, &total);
  EXPECT_GE(freeDestroyed + memSlack(), freeBuf) << "curandDestroyGenerator leaked device memory";
  if (onSimgpu()) {
    EXPECT_EQ(freeBuf, freeDestroyed);
  }

  CUDA_EXPECT(cudaFree(d));
  size_t free1 = 0;
  memInfo(&free1, &total);
  if (onSimgpu()) {
    EXPECT_EQ(free0, free1);
  }
}

TEST(Curand, GeneratorOnStream) {
  Generator gen;
  CURAND_ASSERT(curandCreateGenerator(&gen.g, CURAND_RNG_PSEUDO_DEFAULT));
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreate(&stream));
  CURAND_EXPECT(curandSetStream(gen.g, stream));
  CURAND_EXPECT(curandSetPseudoRandomGeneratorSeed(gen.g, 42ULL));
  unsigned int* d = nullptr;
  const size_t n = 4096;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(unsigned int)));
  CURAND_EXPECT(curandGenerate(gen.g, d, n));
  CUDA_EXPECT(cudaStreamSynchronize(stream));
  CURAND_EXPECT(curandDestroyGenerator(gen.g));
  gen.g = nullptr;
  CUDA_EXPECT(cudaStreamDestroy(stream));
  CUDA_EXPECT(cudaFree(d));
}

TEST(Curand, PhiloxGenerator) {
  Generator gen;
  CURAND_ASSERT(curandCreateGenerator(&gen.g, CURAND_RNG_PSEUDO_PHILOX4_32_10));
  CURAND_EXPECT(curandSetPseudoRandomGeneratorSeed(gen.g, 7ULL));
  double* d = nullptr;
  const size_t n = 1 << 16;
  CUDA_ASSERT(cudaMalloc(&d, n * sizeof(double)));
  CURAND_EXPECT(curandGenerateUniformDouble(gen.g, d, n));
  CUDA_EXPECT(cudaDeviceSynchronize());
  CURAND_EXPECT(curandDestroyGenerator(gen.g));
  gen.g = nullptr;
  CUDA_EXPECT(cudaFree(d));
}
