// Stream-ordered allocation and memory pools through the CUDA runtime API: cudaMallocAsync /
// cudaFreeAsync, explicit pools, pool attributes, trimming, and device memory accounting.
#include <cstring>
#include <vector>

#include "cuda_check.h"

using namespace simtest;

namespace {

uint64_t poolAttr(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  uint64_t v = ~0ull;
  const cudaError_t e = cudaMemPoolGetAttribute(pool, attr, &v);
  EXPECT_EQ(cudaSuccess, e) << "cudaMemPoolGetAttribute(" << static_cast<int>(attr) << "): " << cudaGetErrorName(e);
  return v;
}

cudaMemPoolProps devicePoolProps(int device) {
  cudaMemPoolProps props;
  std::memset(&props, 0, sizeof props);
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  return props;
}

}  // namespace

TEST(AsyncPools, Supported) {
  int v = 0;
  CUDA_ASSERT(cudaDeviceGetAttribute(&v, cudaDevAttrMemoryPoolsSupported, 0));
  EXPECT_EQ(1, v);
}

TEST(AsyncPools, MallocAsyncRoundTrip) {
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (size_t n : {size_t{1}, size_t{4096}, 3 * MiB + 5}) {
    SCOPED_TRACE("size " + std::to_string(n));
    std::vector<uint8_t> in(n), out(n, 0);
    for (size_t i = 0; i < n; ++i) in[i] = patternByte(i, 41);
    uint8_t *a = nullptr, *b = nullptr;
    CUDA_ASSERT(cudaMallocAsync(reinterpret_cast<void**>(&a), n, s));
    CUDA_ASSERT(cudaMallocAsync(reinterpret_cast<void**>(&b), n, s));
    ASSERT_NE(nullptr, a);
    ASSERT_NE(nullptr, b);
    ASSERT_NE(a, b);
    CUDA_ASSERT(cudaMemcpyAsync(a, in.data(), n, cudaMemcpyHostToDevice, s));
    CUDA_ASSERT(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
    CUDA_ASSERT(cudaMemsetAsync(b, 0x6b, n / 2, s));
    CUDA_ASSERT(cudaMemcpyAsync(out.data(), b, n, cudaMemcpyDeviceToHost, s));
    CUDA_ASSERT(cudaFreeAsync(a, s));
    CUDA_ASSERT(cudaFreeAsync(b, s));
    CUDA_ASSERT(cudaStreamSynchronize(s));
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(i < n / 2 ? 0x6b : in[i], out[i]) << i;
  }
  // cudaMallocAsync memory is device memory to the pointer query.
  void* p = nullptr;
  CUDA_ASSERT(cudaMallocAsync(&p, 4096, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  cudaPointerAttributes a{};
  CUDA_ASSERT(cudaPointerGetAttributes(&a, p));
  EXPECT_EQ(cudaMemoryTypeDevice, a.type);
  EXPECT_EQ(0, a.device);
  // Memory from cudaMallocAsync may also be released with cudaFree.
  CUDA_ASSERT(cudaFree(p));
  CUDA_ASSERT(cudaStreamDestroy(s));
}

TEST(AsyncPools, FreeOnAnotherStreamAfterEvent) {
  cudaStream_t a, b;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_ASSERT(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  const size_t n = 1 << 16;
  std::vector<uint8_t> out(n, 0);
  uint8_t* p = nullptr;
  CUDA_ASSERT(cudaMallocAsync(reinterpret_cast<void**>(&p), n, a));
  CUDA_ASSERT(cudaMemsetAsync(p, 0x5d, n, a));
  cudaEvent_t e;
  CUDA_ASSERT(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CUDA_ASSERT(cudaEventRecord(e, a));
  CUDA_ASSERT(cudaStreamWaitEvent(b, e, 0));
  CUDA_ASSERT(cudaMemcpyAsync(out.data(), p, n, cudaMemcpyDeviceToHost, b));
  CUDA_ASSERT(cudaFreeAsync(p, b));
  CUDA_ASSERT(cudaStreamSynchronize(b));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(0x5d, out[i]) << i;
  CUDA_ASSERT(cudaEventDestroy(e));
  CUDA_ASSERT(cudaStreamDestroy(a));
  CUDA_ASSERT(cudaStreamDestroy(b));
}

TEST(AsyncPools, DefaultPool) {
  cudaMemPool_t def = nullptr, cur = nullptr;
  CUDA_ASSERT(cudaDeviceGetDefaultMemPool(&def, 0));
  ASSERT_NE(nullptr, def);
  CUDA_ASSERT(cudaDeviceGetMemPool(&cur, 0));
  EXPECT_EQ(def, cur) << "the current pool starts as the default pool";
  cudaMemPool_t again = nullptr;
  CUDA_ASSERT(cudaDeviceGetDefaultMemPool(&again, 0));
  EXPECT_EQ(def, again);
  cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
  cudaMemLocation loc{};
  loc.type = cudaMemLocationTypeDevice;
  loc.id = 0;
  CUDA_ASSERT(cudaMemPoolGetAccess(&flags, def, &loc));
  EXPECT_EQ(cudaMemAccessFlagsProtReadWrite, flags);
  EXPECT_EQ(0u, poolAttr(def, cudaMemPoolAttrReleaseThreshold)) << "default release threshold is 0";
  cudaMemPool_t bad = nullptr;
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaDeviceGetDefaultMemPool(&bad, deviceCount()));
}

TEST(AsyncPools, CreatedPoolAllocations) {
  cudaMemPoolProps props = devicePoolProps(0);
  cudaMemPool_t pool = nullptr;
  CUDA_ASSERT(cudaMemPoolCreate(&pool, &props));
  ASSERT_NE(nullptr, pool);
  cudaMemPool_t def = nullptr;
  CUDA_ASSERT(cudaDeviceGetDefaultMemPool(&def, 0));
  EXPECT_NE(def, pool);

  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t n = 2 * MiB + 100;
  std::vector<uint8_t> in(n), out(n, 0);
  for (size_t i = 0; i < n; ++i) in[i] = patternByte(i, 43);
  uint8_t* p = nullptr;
  CUDA_ASSERT(cudaMallocFromPoolAsync(reinterpret_cast<void**>(&p), n, pool, s));
  ASSERT_NE(nullptr, p);
  CUDA_ASSERT(cudaMemcpyAsync(p, in.data(), n, cudaMemcpyHostToDevice, s));
  CUDA_ASSERT(cudaMemcpyAsync(out.data(), p, n, cudaMemcpyDeviceToHost, s));
  CUDA_ASSERT(cudaFreeAsync(p, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_EQ(0, std::memcmp(in.data(), out.data(), n));

  // The typed overload and making the pool current for cudaMallocAsync.
  CUDA_ASSERT(cudaDeviceSetMemPool(0, pool));
  cudaMemPool_t cur = nullptr;
  CUDA_ASSERT(cudaDeviceGetMemPool(&cur, 0));
  EXPECT_EQ(pool, cur);
  CUDA_ASSERT(cudaMallocAsync(reinterpret_cast<void**>(&p), 4096, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_GE(poolAttr(pool, cudaMemPoolAttrUsedMemCurrent), 4096u) << "cudaMallocAsync used the current pool";
  CUDA_ASSERT(cudaFreeAsync(p, s));
  CUDA_ASSERT(cudaDeviceSetMemPool(0, def));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaMemPoolDestroy(pool));
}

TEST(AsyncPools, AttributesAndTrim) {
  cudaMemPoolProps props = devicePoolProps(0);
  cudaMemPool_t pool = nullptr;
  CUDA_ASSERT(cudaMemPoolCreate(&pool, &props));

  // Release threshold: set and read back.
  uint64_t threshold = 64 * MiB;
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  EXPECT_EQ(64 * MiB, poolAttr(pool, cudaMemPoolAttrReleaseThreshold));
  threshold = ~0ull;
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  EXPECT_EQ(~0ull, poolAttr(pool, cudaMemPoolAttrReleaseThreshold));

  EXPECT_EQ(0u, poolAttr(pool, cudaMemPoolAttrUsedMemCurrent)) << "a new pool uses nothing";
  EXPECT_EQ(0u, poolAttr(pool, cudaMemPoolAttrReservedMemCurrent)) << "a new pool reserves nothing";

  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t n = 32 * MiB;
  void *p = nullptr, *q = nullptr;
  CUDA_ASSERT(cudaMallocFromPoolAsync(&p, n, pool, s));
  CUDA_ASSERT(cudaMallocFromPoolAsync(&q, n, pool, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  const uint64_t used = poolAttr(pool, cudaMemPoolAttrUsedMemCurrent);
  const uint64_t reserved = poolAttr(pool, cudaMemPoolAttrReservedMemCurrent);
  EXPECT_GE(used, 2 * n);
  EXPECT_GE(reserved, used);
  EXPECT_GE(poolAttr(pool, cudaMemPoolAttrUsedMemHigh), used);
  EXPECT_GE(poolAttr(pool, cudaMemPoolAttrReservedMemHigh), reserved);

  CUDA_ASSERT(cudaFreeAsync(p, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  const uint64_t usedAfterOne = poolAttr(pool, cudaMemPoolAttrUsedMemCurrent);
  EXPECT_LT(usedAfterOne, used);
  EXPECT_GE(usedAfterOne, n);
  CUDA_ASSERT(cudaFreeAsync(q, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_EQ(0u, poolAttr(pool, cudaMemPoolAttrUsedMemCurrent));
  // With an unlimited release threshold the pool keeps its memory after a synchronisation...
  EXPECT_EQ(reserved, poolAttr(pool, cudaMemPoolAttrReservedMemCurrent));
  // ...until it is trimmed.
  CUDA_ASSERT(cudaMemPoolTrimTo(pool, 0));
  EXPECT_EQ(0u, poolAttr(pool, cudaMemPoolAttrReservedMemCurrent));

  // The high-water marks can be reset to zero.
  uint64_t zero = 0;
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
  EXPECT_EQ(0u, poolAttr(pool, cudaMemPoolAttrUsedMemHigh));
  EXPECT_EQ(0u, poolAttr(pool, cudaMemPoolAttrReservedMemHigh));

  // Boolean reuse policies read back as set.
  int follow = 0;
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseFollowEventDependencies, &follow));
  int got = -1;
  CUDA_ASSERT(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseFollowEventDependencies, &got));
  EXPECT_EQ(0, got);

  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaMemPoolDestroy(pool));
}

TEST(AsyncPools, MemGetInfoReflectsPoolMemory) {
  cudaMemPoolProps props = devicePoolProps(0);
  cudaMemPool_t pool = nullptr;
  CUDA_ASSERT(cudaMemPoolCreate(&pool, &props));
  uint64_t threshold = ~0ull;
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  size_t free0, total0, free1, total1, free2, total2, free3, total3;
  memInfo(&free0, &total0);
  const size_t n = 256 * MiB;
  void* p = nullptr;
  CUDA_ASSERT(cudaMallocFromPoolAsync(&p, n, pool, s));
  CUDA_ASSERT(cudaMemsetAsync(p, 0, n, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  memInfo(&free1, &total1);
  ASSERT_LT(free1, free0);
  EXPECT_GE(free0 - free1, n) << "pool memory in use counts against free memory";
  EXPECT_GE(poolAttr(pool, cudaMemPoolAttrReservedMemCurrent), free0 - free1 - memSlack());

  CUDA_ASSERT(cudaFreeAsync(p, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  memInfo(&free2, &total2);
  EXPECT_LE(free2, free0 - n + memSlack()) << "reserved (unreleased) pool memory still counts";

  CUDA_ASSERT(cudaMemPoolTrimTo(pool, 0));
  memInfo(&free3, &total3);
  if (onSimgpu())
    EXPECT_EQ(free0, free3) << "trimming returns the memory to the device";
  else
    EXPECT_GE(free3 + memSlack(), free0);
  EXPECT_EQ(total0, total3);

  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaMemPoolDestroy(pool));
}

TEST(AsyncPools, DestroyedPoolReleasesMemory) {
  size_t free0, total0, free1, total1;
  memInfo(&free0, &total0);
  cudaMemPoolProps props = devicePoolProps(0);
  cudaMemPool_t pool = nullptr;
  CUDA_ASSERT(cudaMemPoolCreate(&pool, &props));
  uint64_t threshold = ~0ull;
  CUDA_ASSERT(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  void* p = nullptr;
  CUDA_ASSERT(cudaMallocFromPoolAsync(&p, 64 * MiB, pool, 0));
  CUDA_ASSERT(cudaFreeAsync(p, 0));
  CUDA_ASSERT(cudaDeviceSynchronize());
  CUDA_ASSERT(cudaMemPoolDestroy(pool));
  memInfo(&free1, &total1);
  if (onSimgpu())
    EXPECT_EQ(free0, free1);
  else
    EXPECT_GE(free1 + memSlack(), free0);
}

TEST(AsyncPools, OutOfMemory) {
  size_t freeBytes, totalBytes;
  memInfo(&freeBytes, &totalBytes);
  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* p = nullptr;
  CUDA_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMallocAsync(&p, totalBytes + GiB, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  CUDA_ASSERT(cudaMallocAsync(&p, MiB, s));
  CUDA_ASSERT(cudaFreeAsync(p, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  CUDA_ASSERT(cudaStreamDestroy(s));
}
