// simgpu's virtual memory management, CUDA arrays and graph memory nodes, through the driver API.
//
// Every check on cuMemGetInfo is exact: simgpu counts device memory to the byte, and this program
// is the only user of its simulated host (each test registration has its own SIMGPU_STATE_DIR).
#include <cuda.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cu_check.h"

namespace {

constexpr size_t kMiB = size_t{1} << 20;


class Driver : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
    ASSERT_EQ(CUDA_SUCCESS, cuDevicePrimaryCtxRetain(&ctx_, 0));
  }
  static void TearDownTestSuite() {
    if (ctx_) cuDevicePrimaryCtxRelease(0);
    ctx_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(ctx_, nullptr);
    CU_ASSERT(cuCtxSetCurrent(ctx_));
  }
  static size_t freeMem() {
    size_t f = 0, t = 0;
    EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
    return f;
  }
  static CUmemAllocationProp deviceProp() {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    return p;
  }
  static CUmemAccessDesc readWrite() {
    CUmemAccessDesc d{};
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = 0;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return d;
  }
  static inline CUcontext ctx_ = nullptr;
};

using Vmm = Driver;
using Arrays = Driver;
using GraphMemory = Driver;

// ---------------------------------------------------------------------------------------------
TEST_F(Vmm, GranularityAndCreateValidation) {
  const CUmemAllocationProp prop = deviceProp();
  size_t g = 0;
  CU_ASSERT(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  EXPECT_EQ(g, 2 * kMiB);
  size_t rec = 0;
  CU_ASSERT(cuMemGetAllocationGranularity(&rec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  EXPECT_GE(rec, g);
  EXPECT_EQ(rec % g, 0u);

  const size_t before = freeMem();
  CUmemGenericAllocationHandle h = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&h, g + 4096, &prop, 0));  // not a multiple
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&h, 0, &prop, 0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&h, g, nullptr, 0));
  CUmemAllocationProp badDev = prop;
  badDev.location.id = 9;
  EXPECT_NE(CUDA_SUCCESS, cuMemCreate(&h, g, &badDev, 0));
  EXPECT_EQ(freeMem(), before) << "a refused cuMemCreate must not count memory";
  size_t total = 0;
  CU_ASSERT(cuDeviceTotalMem(&total, 0));
  CU_EXPECT_ERR(CUDA_ERROR_OUT_OF_MEMORY, cuMemCreate(&h, (total / g + 1) * g, &prop, 0));
  EXPECT_EQ(freeMem(), before);
}

TEST_F(Vmm, MapAliasAccountAndFree) {
  const CUmemAllocationProp prop = deviceProp();
  const size_t size = 4 * kMiB;
  const size_t before = freeMem();

  CUmemGenericAllocationHandle h = 0;
  CU_ASSERT(cuMemCreate(&h, size, &prop, 0));
  EXPECT_EQ(freeMem(), before - size) << "physical memory is counted at cuMemCreate";

  CUdeviceptr va = 0;
  CU_ASSERT(cuMemAddressReserve(&va, 2 * size, 0, 0, 0));
  ASSERT_NE(va, 0u);
  EXPECT_EQ(va % (2 * kMiB), 0u);
  EXPECT_EQ(freeMem(), before - size) << "address space is not memory";

  // The same physical memory mapped twice.
  CU_ASSERT(cuMemMap(va, size, 0, h, 0));
  CU_ASSERT(cuMemMap(va + size, size, 0, h, 0));
  EXPECT_EQ(freeMem(), before - size) << "a second mapping is not more memory";
  const CUmemAccessDesc rw = readWrite();
  CU_ASSERT(cuMemSetAccess(va, 2 * size, &rw, 1));
  unsigned long long access = 0;
  CUmemLocation loc{CU_MEM_LOCATION_TYPE_DEVICE, 0};
  CU_ASSERT(cuMemGetAccess(&access, &loc, va));
  EXPECT_EQ(access, static_cast<unsigned long long>(CU_MEM_ACCESS_FLAGS_PROT_READWRITE));

  // Write through one mapping (a copy and a direct store), read through the other.
  std::vector<uint32_t> src(size / 4);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint32_t>(i * 2654435761u);
  CU_ASSERT(cuMemcpyHtoD(va, src.data(), size));
  std::vector<uint32_t> back(size / 4, 0);
  CU_ASSERT(cuMemcpyDtoH(back.data(), va + size, size));
  EXPECT_EQ(src, back) << "the two mappings do not alias";
  reinterpret_cast<volatile uint32_t*>(va + size)[7] = 0xabcdef01u;  // device memory is host memory
  uint32_t word = 0;
  CU_ASSERT(cuMemcpyDtoH(&word, va + 7 * 4, 4));
  EXPECT_EQ(word, 0xabcdef01u);
  CU_ASSERT(cuMemsetD32(va + size + 64, 0x55aa55aau, 16));
  CU_ASSERT(cuMemcpyDtoH(&word, va + 64 + 60, 4));
  EXPECT_EQ(word, 0x55aa55aau);

  // Address-range and attribute lookups on mapped memory.
  CUdeviceptr base = 0;
  size_t rsize = 0;
  CU_ASSERT(cuMemGetAddressRange(&base, &rsize, va + size + 12345));
  EXPECT_EQ(base, va + size);
  EXPECT_EQ(rsize, size);
  CU_ASSERT(cuMemGetAddressRange(&base, &rsize, va));
  EXPECT_EQ(base, va);
  EXPECT_EQ(rsize, size);
  unsigned memType = 0;
  CU_ASSERT(cuPointerGetAttribute(&memType, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va + 100));
  EXPECT_EQ(memType, static_cast<unsigned>(CU_MEMORYTYPE_DEVICE));
  int ordinal = -1;
  CU_ASSERT(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va + size));
  EXPECT_EQ(ordinal, 0);

  // The handle behind an address.
  CUmemGenericAllocationHandle again = 0;
  CU_ASSERT(cuMemRetainAllocationHandle(&again, reinterpret_cast<void*>(va + size + 4096)));
  EXPECT_EQ(again, h);
  CU_ASSERT(cuMemRelease(again));  // the retain's reference
  CUmemAllocationProp got{};
  CU_ASSERT(cuMemGetAllocationPropertiesFromHandle(&got, h));
  EXPECT_EQ(got.type, CU_MEM_ALLOCATION_TYPE_PINNED);
  EXPECT_EQ(got.location.id, 0);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemFree(va));  // not cuMemAlloc memory

  // Released while mapped: still counted, still readable, until the last mapping goes.
  CU_ASSERT(cuMemRelease(h));
  EXPECT_EQ(freeMem(), before - size);
  CU_ASSERT(cuMemcpyDtoH(&word, va + size + 7 * 4, 4));
  EXPECT_EQ(word, 0xabcdef01u);
  EXPECT_NE(CUDA_SUCCESS, cuMemAddressFree(va, 2 * size)) << "freeing a reservation with live mappings";
  CU_ASSERT(cuMemUnmap(va, size));
  EXPECT_EQ(freeMem(), before - size) << "one mapping remains";
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, cuMemGetAddressRange(&base, &rsize, va));
  CU_ASSERT(cuMemUnmap(va + size, size));
  EXPECT_EQ(freeMem(), before) << "released and unmapped: the memory is back";
  CU_ASSERT(cuMemAddressFree(va, 2 * size));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 2 * size));
}

TEST_F(Vmm, UnmapThenRelease) {
  const CUmemAllocationProp prop = deviceProp();
  const size_t size = 2 * kMiB;
  const size_t before = freeMem();
  CUmemGenericAllocationHandle h = 0;
  CU_ASSERT(cuMemCreate(&h, size, &prop, 0));
  CUdeviceptr va = 0;
  CU_ASSERT(cuMemAddressReserve(&va, size, 0, 0, 0));
  CU_ASSERT(cuMemMap(va, size, 0, h, 0));
  const CUmemAccessDesc rw = readWrite();
  CU_ASSERT(cuMemSetAccess(va, size, &rw, 1));
  CU_ASSERT(cuMemsetD8(va, 1, size));
  CU_ASSERT(cuMemUnmap(va, size));
  EXPECT_EQ(freeMem(), before - size) << "unmapped but not released: still counted";
  // Mapped again, the contents are still there.
  CU_ASSERT(cuMemMap(va, size, 0, h, 0));
  CU_ASSERT(cuMemSetAccess(va, size, &rw, 1));
  uint8_t b = 0;
  CU_ASSERT(cuMemcpyDtoH(&b, va + size - 1, 1));
  EXPECT_EQ(b, 1);
  CU_ASSERT(cuMemUnmap(va, size));
  CU_ASSERT(cuMemRelease(h));
  EXPECT_EQ(freeMem(), before);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemRelease(h));  // gone
  CU_ASSERT(cuMemAddressFree(va, size));
}

TEST_F(Vmm, MapValidation) {
  const CUmemAllocationProp prop = deviceProp();
  const size_t size = 2 * kMiB;
  CUmemGenericAllocationHandle h = 0;
  CU_ASSERT(cuMemCreate(&h, size, &prop, 0));
  CUdeviceptr va = 0;
  CU_ASSERT(cuMemAddressReserve(&va, 2 * size, 0, 0, 0));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, size + 4096, 0, h, 0));  // larger than the handle
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemMap(va + 2 * size, size, 0, h, 0));  // past the reservation
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemMap(va + size, 2 * size, 0, h, 0));  // ends past it
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, size, size, h, 0));      // offset past the end
  int local = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE,
                cuMemMap(reinterpret_cast<CUdeviceptr>(&local) & ~(2 * kMiB - 1), size, 0, h, 0));  // not reserved
  CU_ASSERT(cuMemMap(va, size, 0, h, 0));
  EXPECT_NE(CUDA_SUCCESS, cuMemMap(va, size, 0, h, 0)) << "mapping over a mapping";
  const CUmemAccessDesc rw = readWrite();
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemSetAccess(va, 2 * size, &rw, 1));  // half is unmapped
  CUmemGenericAllocationHandle none = 0;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemRetainAllocationHandle(&none, reinterpret_cast<void*>(va + size)));
  CU_ASSERT(cuMemUnmap(va, size));
  CU_ASSERT(cuMemRelease(h));
  CU_ASSERT(cuMemAddressFree(va, 2 * size));
}

// Two physical allocations mapped back to back form one contiguous range: this is what VMM is
// for (growable buffers, NCCL's and PyTorch's expandable segments). Copies and memsets across the
// boundary between the mappings are ordinary device accesses.
TEST_F(Vmm, CopiesAcrossAdjacentMappings) {
  const CUmemAllocationProp prop = deviceProp();
  const size_t size = 2 * kMiB;
  CUmemGenericAllocationHandle h1 = 0, h2 = 0;
  CU_ASSERT(cuMemCreate(&h1, size, &prop, 0));
  CU_ASSERT(cuMemCreate(&h2, size, &prop, 0));
  CUdeviceptr va = 0;
  CU_ASSERT(cuMemAddressReserve(&va, 2 * size, 0, 0, 0));
  CU_ASSERT(cuMemMap(va, size, 0, h1, 0));
  CU_ASSERT(cuMemMap(va + size, size, 0, h2, 0));
  const CUmemAccessDesc rw = readWrite();
  CU_ASSERT(cuMemSetAccess(va, 2 * size, &rw, 1));  // one call over both mappings

  std::vector<uint8_t> src(8192), back(8192, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  const CUdeviceptr straddle = va + size - 4096;
  CU_EXPECT(cuMemcpyHtoD(straddle, src.data(), src.size()));
  CU_EXPECT(cuMemcpyDtoH(back.data(), straddle, back.size()));
  EXPECT_EQ(src, back);
  CU_EXPECT(cuMemsetD32(straddle, 0x01020304u, 2048));

  for (CUdeviceptr p : {va, va + size}) CU_EXPECT(cuMemUnmap(p, size));
  CU_EXPECT(cuMemRelease(h1));
  CU_EXPECT(cuMemRelease(h2));
  CU_EXPECT(cuMemAddressFree(va, 2 * size));
}

// ---------------------------------------------------------------------------------------------
TEST_F(Arrays, OneDimensionalRoundTrip) {
  const size_t before = freeMem();
  CUDA_ARRAY_DESCRIPTOR d{};
  d.Width = 1000;
  d.Height = 0;
  d.Format = CU_AD_FORMAT_FLOAT;
  d.NumChannels = 1;
  CUarray a = nullptr;
  CU_ASSERT(cuArrayCreate(&a, &d));
  const size_t used = before - freeMem();
  EXPECT_GE(used, 1000 * sizeof(float)) << "an array is device memory";

  CUDA_ARRAY_DESCRIPTOR got{};
  CU_ASSERT(cuArrayGetDescriptor(&got, a));
  EXPECT_EQ(got.Width, 1000u);
  EXPECT_EQ(got.Height, 0u);
  EXPECT_EQ(got.Format, CU_AD_FORMAT_FLOAT);
  EXPECT_EQ(got.NumChannels, 1u);

  std::vector<float> in(1000), out(1000, 0);
  for (int i = 0; i < 1000; ++i) in[i] = static_cast<float>(i) * 0.5f;
  CU_ASSERT(cuMemcpyHtoA(a, 0, in.data(), in.size() * sizeof(float)));
  CU_ASSERT(cuMemcpyAtoH(out.data(), a, 0, out.size() * sizeof(float)));
  EXPECT_EQ(in, out);
  float part[10] = {};
  CU_ASSERT(cuMemcpyAtoH(part, a, 400 * sizeof(float), sizeof part));  // offset in bytes
  EXPECT_EQ(part[0], 200.0f);
  EXPECT_EQ(part[9], 204.5f);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpyHtoA(a, 996 * sizeof(float), in.data(), 8 * sizeof(float)));

  // Through device memory and to another array.
  CUdeviceptr dev = 0;
  CU_ASSERT(cuMemAlloc(&dev, 4000));
  CU_ASSERT(cuMemcpyAtoD(dev, a, 0, 4000));
  CUarray b = nullptr;
  CU_ASSERT(cuArrayCreate(&b, &d));
  CU_ASSERT(cuMemcpyDtoA(b, 0, dev, 4000));
  CUarray c = nullptr;
  CU_ASSERT(cuArrayCreate(&c, &d));
  CU_ASSERT(cuMemcpyAtoA(c, 0, b, 0, 4000));
  std::fill(out.begin(), out.end(), 0.0f);
  CU_ASSERT(cuMemcpyAtoH(out.data(), c, 0, 4000));
  EXPECT_EQ(in, out);
  CU_ASSERT(cuMemFree(dev));
  CU_ASSERT(cuArrayDestroy(b));
  CU_ASSERT(cuArrayDestroy(c));

  CU_ASSERT(cuArrayDestroy(a));
  EXPECT_EQ(freeMem(), before) << "an array's memory returns at destroy";
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuArrayDestroy(a));
  d.NumChannels = 3;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuArrayCreate(&a, &d));
}

TEST_F(Arrays, TwoDimensionalMemcpy2D) {
  const size_t before = freeMem();
  const size_t w = 64, h = 32, texel = 4;  // 64 x 32 RGBA8
  CUDA_ARRAY_DESCRIPTOR d{};
  d.Width = w;
  d.Height = h;
  d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  d.NumChannels = 4;
  CUarray a = nullptr;
  CU_ASSERT(cuArrayCreate(&a, &d));
  EXPECT_GE(before - freeMem(), w * h * texel);
  CUDA_ARRAY_DESCRIPTOR got{};
  CU_ASSERT(cuArrayGetDescriptor(&got, a));
  EXPECT_EQ(got.Width, w);
  EXPECT_EQ(got.Height, h);
  EXPECT_EQ(got.NumChannels, 4u);

  // Host rows with padding (pitch 300 > 256 bytes of texels).
  const size_t srcPitch = 300;
  std::vector<uint8_t> src(srcPitch * h, 0xee);
  for (size_t y = 0; y < h; ++y)
    for (size_t x = 0; x < w * texel; ++x) src[y * srcPitch + x] = static_cast<uint8_t>(x + 3 * y);
  CUDA_MEMCPY2D up{};
  up.srcMemoryType = CU_MEMORYTYPE_HOST;
  up.srcHost = src.data();
  up.srcPitch = srcPitch;
  up.dstMemoryType = CU_MEMORYTYPE_ARRAY;
  up.dstArray = a;
  up.WidthInBytes = w * texel;
  up.Height = h;
  CU_ASSERT(cuMemcpy2D(&up));

  // Back into a packed buffer, and a sub-rectangle with offsets.
  std::vector<uint8_t> packed(w * texel * h, 0);
  CUDA_MEMCPY2D down{};
  down.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  down.srcArray = a;
  down.dstMemoryType = CU_MEMORYTYPE_HOST;
  down.dstHost = packed.data();
  down.dstPitch = w * texel;
  down.WidthInBytes = w * texel;
  down.Height = h;
  CU_ASSERT(cuMemcpy2D(&down));
  for (size_t y = 0; y < h; ++y)
    for (size_t x = 0; x < w * texel; ++x) ASSERT_EQ(packed[y * w * texel + x], src[y * srcPitch + x]) << x << "," << y;

  std::vector<uint8_t> sub(16 * 4, 0);
  CUDA_MEMCPY2D rect{};
  rect.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  rect.srcArray = a;
  rect.srcXInBytes = 8 * texel;
  rect.srcY = 5;
  rect.dstMemoryType = CU_MEMORYTYPE_HOST;
  rect.dstHost = sub.data();
  rect.dstPitch = 16;
  rect.WidthInBytes = 16;
  rect.Height = 4;
  CU_ASSERT(cuMemcpy2D(&rect));
  for (size_t y = 0; y < 4; ++y)
    for (size_t x = 0; x < 16; ++x) EXPECT_EQ(sub[y * 16 + x], src[(5 + y) * srcPitch + 32 + x]);
  rect.srcY = h - 2;  // rows past the end
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpy2D(&rect));

  CU_ASSERT(cuArrayDestroy(a));
  EXPECT_EQ(freeMem(), before);
}

TEST_F(Arrays, ThreeDimensionalMemcpy3D) {
  const size_t before = freeMem();
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = 16;
  d.Height = 8;
  d.Depth = 4;
  d.Format = CU_AD_FORMAT_FLOAT;
  d.NumChannels = 2;
  CUarray a = nullptr;
  CU_ASSERT(cuArray3DCreate(&a, &d));
  const size_t rowBytes = 16 * 2 * sizeof(float);
  EXPECT_GE(before - freeMem(), rowBytes * 8 * 4);
  CUDA_ARRAY3D_DESCRIPTOR got{};
  CU_ASSERT(cuArray3DGetDescriptor(&got, a));
  EXPECT_EQ(got.Width, 16u);
  EXPECT_EQ(got.Height, 8u);
  EXPECT_EQ(got.Depth, 4u);
  EXPECT_EQ(got.NumChannels, 2u);
  EXPECT_EQ(got.Format, CU_AD_FORMAT_FLOAT);

  std::vector<float> in(16 * 2 * 8 * 4), out(in.size(), -1.0f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) + 0.25f;
  CUDA_MEMCPY3D up{};
  up.srcMemoryType = CU_MEMORYTYPE_HOST;
  up.srcHost = in.data();
  up.srcPitch = rowBytes;
  up.srcHeight = 8;
  up.dstMemoryType = CU_MEMORYTYPE_ARRAY;
  up.dstArray = a;
  up.WidthInBytes = rowBytes;
  up.Height = 8;
  up.Depth = 4;
  CU_ASSERT(cuMemcpy3D(&up));
  CUDA_MEMCPY3D down{};
  down.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  down.srcArray = a;
  down.dstMemoryType = CU_MEMORYTYPE_HOST;
  down.dstHost = out.data();
  down.dstPitch = rowBytes;
  down.dstHeight = 8;
  down.WidthInBytes = rowBytes;
  down.Height = 8;
  down.Depth = 4;
  CU_ASSERT(cuMemcpy3D(&down));
  EXPECT_EQ(in, out);

  // One slice from the middle, through pitched device memory.
  CUdeviceptr dev = 0;
  size_t pitch = 0;
  CU_ASSERT(cuMemAllocPitch(&dev, &pitch, rowBytes, 8, 4));
  CUDA_MEMCPY3D slice{};
  slice.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  slice.srcArray = a;
  slice.srcZ = 2;
  slice.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  slice.dstDevice = dev;
  slice.dstPitch = pitch;
  slice.dstHeight = 8;
  slice.WidthInBytes = rowBytes;
  slice.Height = 8;
  slice.Depth = 1;
  CU_ASSERT(cuMemcpy3D(&slice));
  std::vector<float> row(16 * 2);
  CU_ASSERT(cuMemcpyDtoH(row.data(), dev + 3 * pitch, rowBytes));  // slice 2, row 3
  for (size_t i = 0; i < row.size(); ++i) ASSERT_EQ(row[i], in[(2 * 8 + 3) * 32 + i]);
  CU_ASSERT(cuMemFree(dev));

  CU_ASSERT(cuArrayDestroy(a));
  EXPECT_EQ(freeMem(), before);
}

TEST_F(Arrays, MipmappedLevels) {
  const size_t before = freeMem();
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = 64;
  d.Height = 64;
  d.Format = CU_AD_FORMAT_FLOAT;
  d.NumChannels = 1;
  CUmipmappedArray m = nullptr;
  CU_ASSERT(cuMipmappedArrayCreate(&m, &d, 4));
  EXPECT_GE(before - freeMem(), (64 * 64 + 32 * 32 + 16 * 16 + 8 * 8) * sizeof(float));
  for (unsigned level = 0; level < 4; ++level) {
    CUarray a = nullptr;
    CU_ASSERT(cuMipmappedArrayGetLevel(&a, m, level));
    CUDA_ARRAY3D_DESCRIPTOR got{};
    CU_ASSERT(cuArray3DGetDescriptor(&got, a));
    EXPECT_EQ(got.Width, 64u >> level) << "level " << level;
    EXPECT_EQ(got.Height, 64u >> level) << "level " << level;
  }
  CUarray none = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMipmappedArrayGetLevel(&none, m, 4));

  // A copy to level 2 (16 x 16) and back.
  CUarray l2 = nullptr;
  CU_ASSERT(cuMipmappedArrayGetLevel(&l2, m, 2));
  std::vector<float> in(16 * 16), out(16 * 16, 0);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i * 3);
  CUDA_MEMCPY2D up{};
  up.srcMemoryType = CU_MEMORYTYPE_HOST;
  up.srcHost = in.data();
  up.srcPitch = 16 * sizeof(float);
  up.dstMemoryType = CU_MEMORYTYPE_ARRAY;
  up.dstArray = l2;
  up.WidthInBytes = 16 * sizeof(float);
  up.Height = 16;
  CU_ASSERT(cuMemcpy2D(&up));
  CUDA_MEMCPY2D down{};
  down.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  down.srcArray = l2;
  down.dstMemoryType = CU_MEMORYTYPE_HOST;
  down.dstHost = out.data();
  down.dstPitch = 16 * sizeof(float);
  down.WidthInBytes = 16 * sizeof(float);
  down.Height = 16;
  CU_ASSERT(cuMemcpy2D(&down));
  EXPECT_EQ(in, out);
  up.WidthInBytes = 32 * sizeof(float);  // level 2 is 16 wide
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMemcpy2D(&up));

  EXPECT_NE(CUDA_SUCCESS, cuArrayDestroy(l2)) << "a level belongs to its mipmapped array";
  CU_ASSERT(cuMipmappedArrayDestroy(m));
  EXPECT_EQ(freeMem(), before);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuMipmappedArrayDestroy(m));
}

// cuMipmappedArrayCreate documents numMipmapLevels as clamped to [1, 1 + floor(log2(max(w, h, d)))].
TEST_F(Arrays, MipmapLevelCountIsClamped) {
  const size_t before = freeMem();
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = 64;
  d.Height = 16;
  d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  d.NumChannels = 1;
  CUmipmappedArray m = nullptr;
  CU_ASSERT(cuMipmappedArrayCreate(&m, &d, 20));
  CUarray last = nullptr;
  CU_EXPECT(cuMipmappedArrayGetLevel(&last, m, 6));  // 1 + log2(64) = 7 levels: 0..6
  CUarray beyond = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuMipmappedArrayGetLevel(&beyond, m, 7));
  CU_ASSERT(cuMipmappedArrayDestroy(m));
  EXPECT_EQ(freeMem(), before);
}

// ---------------------------------------------------------------------------------------------
CUDA_MEM_ALLOC_NODE_PARAMS allocParams(size_t bytes) {
  CUDA_MEM_ALLOC_NODE_PARAMS p{};
  p.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.poolProps.location.id = 0;
  p.bytesize = bytes;
  return p;
}

TEST_F(GraphMemory, AllocAndFreeNodes) {
  const size_t bytes = 64 * kMiB;
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const size_t before = freeMem();

  // Graph A: allocate, then fill.
  CUgraph ga = nullptr;
  CU_ASSERT(cuGraphCreate(&ga, 0));
  CUDA_MEM_ALLOC_NODE_PARAMS ap = allocParams(bytes);
  CUgraphNode allocNode = nullptr;
  CU_ASSERT(cuGraphAddMemAllocNode(&allocNode, ga, nullptr, 0, &ap));
  ASSERT_NE(ap.dptr, 0u) << "an alloc node's address is known when the node is made";
  CUgraphNodeType type{};
  CU_ASSERT(cuGraphNodeGetType(allocNode, &type));
  EXPECT_EQ(type, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
  CUDA_MEM_ALLOC_NODE_PARAMS gotParams{};
  CU_ASSERT(cuGraphMemAllocNodeGetParams(allocNode, &gotParams));
  EXPECT_EQ(gotParams.dptr, ap.dptr);
  EXPECT_EQ(gotParams.bytesize, bytes);
  CUDA_MEMSET_NODE_PARAMS mp{};
  mp.dst = ap.dptr;
  mp.value = 0x5c;
  mp.elementSize = 1;
  mp.width = bytes;
  mp.height = 1;
  CUgraphNode setNode = nullptr;
  CU_ASSERT(cuGraphAddMemsetNode(&setNode, ga, &allocNode, 1, &mp, ctx_));
  EXPECT_EQ(freeMem(), before) << "making the node does not allocate";

  CUgraphExec ea = nullptr;
  CU_ASSERT(cuGraphInstantiate(&ea, ga, 0));
  CU_ASSERT(cuGraphLaunch(ea, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(freeMem(), before - bytes) << "launching the graph allocates";
  cuuint64_t used = 0;
  CU_ASSERT(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used));
  EXPECT_EQ(used, bytes);
  uint8_t probe[2] = {};
  CU_ASSERT(cuMemcpyDtoH(&probe[0], ap.dptr, 1));
  CU_ASSERT(cuMemcpyDtoH(&probe[1], ap.dptr + bytes - 1, 1));
  EXPECT_EQ(probe[0], 0x5c);
  EXPECT_EQ(probe[1], 0x5c);

  // Graph B: free it.
  CUgraph gb = nullptr;
  CU_ASSERT(cuGraphCreate(&gb, 0));
  CUgraphNode freeNode = nullptr;
  CU_ASSERT(cuGraphAddMemFreeNode(&freeNode, gb, nullptr, 0, ap.dptr));
  CU_ASSERT(cuGraphNodeGetType(freeNode, &type));
  EXPECT_EQ(type, CU_GRAPH_NODE_TYPE_MEM_FREE);
  CUgraphExec eb = nullptr;
  CU_ASSERT(cuGraphInstantiate(&eb, gb, 0));
  CU_ASSERT(cuGraphLaunch(eb, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(freeMem(), before) << "the free node returns the memory";
  CU_ASSERT(cuDeviceGetGraphMemAttribute(0, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used));
  EXPECT_EQ(used, 0u);

  // Again; this time freed outside any graph, stream-ordered.
  CU_ASSERT(cuGraphLaunch(ea, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(freeMem(), before - bytes);
  CU_ASSERT(cuMemFreeAsync(ap.dptr, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(freeMem(), before);

  int local = 0;
  CUgraphNode bad = nullptr;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE,
                cuGraphAddMemFreeNode(&bad, gb, nullptr, 0, reinterpret_cast<CUdeviceptr>(&local)));

  CU_ASSERT(cuGraphExecDestroy(ea));
  CU_ASSERT(cuGraphExecDestroy(eb));
  CU_ASSERT(cuGraphDestroy(ga));
  CU_ASSERT(cuGraphDestroy(gb));
  CU_ASSERT(cuStreamDestroy(s));
}

TEST_F(GraphMemory, CapturedAllocAsyncFreeAsync) {
  const size_t bytes = 32 * kMiB;
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const size_t before = freeMem();
  std::vector<uint8_t> host(4096, 0);

  CU_ASSERT(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAllocAsync(&p, bytes, s));
  ASSERT_NE(p, 0u);
  CU_ASSERT(cuMemsetD8Async(p, 0x3e, bytes, s));
  CU_ASSERT(cuMemcpyDtoHAsync(host.data(), p + bytes - host.size(), host.size(), s));
  CU_ASSERT(cuMemFreeAsync(p, s));
  CUgraph g = nullptr;
  CU_ASSERT(cuStreamEndCapture(s, &g));
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(freeMem(), before) << "capturing does not allocate";
  EXPECT_EQ(host[0], 0) << "capturing does not execute";

  size_t n = 0;
  CU_ASSERT(cuGraphGetNodes(g, nullptr, &n));
  ASSERT_EQ(n, 4u);
  std::vector<CUgraphNode> nodes(n);
  CU_ASSERT(cuGraphGetNodes(g, nodes.data(), &n));
  std::vector<CUgraphNodeType> types;
  CUgraphNode allocNode = nullptr;
  for (CUgraphNode node : nodes) {
    CUgraphNodeType t{};
    CU_ASSERT(cuGraphNodeGetType(node, &t));
    types.push_back(t);
    if (t == CU_GRAPH_NODE_TYPE_MEM_ALLOC) allocNode = node;
  }
  const std::vector<CUgraphNodeType> want = {CU_GRAPH_NODE_TYPE_MEM_ALLOC, CU_GRAPH_NODE_TYPE_MEMSET,
                                             CU_GRAPH_NODE_TYPE_MEMCPY, CU_GRAPH_NODE_TYPE_MEM_FREE};
  EXPECT_EQ(types, want);
  ASSERT_NE(allocNode, nullptr);
  CUDA_MEM_ALLOC_NODE_PARAMS ap{};
  CU_ASSERT(cuGraphMemAllocNodeGetParams(allocNode, &ap));
  EXPECT_EQ(ap.dptr, p);
  EXPECT_EQ(ap.bytesize, bytes);

  CUgraphExec e = nullptr;
  CU_ASSERT(cuGraphInstantiate(&e, g, 0));
  CU_ASSERT(cuGraphLaunch(e, s));
  CU_ASSERT(cuStreamSynchronize(s));
  for (uint8_t b : host) ASSERT_EQ(b, 0x3e);
  EXPECT_EQ(freeMem(), before) << "allocated and freed within the graph";
  // Launchable again: the free node made the allocation reusable.
  std::fill(host.begin(), host.end(), 0);
  CU_ASSERT(cuGraphLaunch(e, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(host[100], 0x3e);
  EXPECT_EQ(freeMem(), before);

  CU_ASSERT(cuGraphExecDestroy(e));
  CU_ASSERT(cuGraphDestroy(g));
  CU_ASSERT(cuStreamDestroy(s));
}

// A captured allocation without a free: the memory outlives the launch, until cuMemFree.
TEST_F(GraphMemory, CapturedAllocFreedOutside) {
  const size_t bytes = 16 * kMiB;
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const size_t before = freeMem();
  CU_ASSERT(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUdeviceptr p = 0;
  CU_ASSERT(cuMemAllocAsync(&p, bytes, s));
  CU_ASSERT(cuMemsetD32Async(p, 0x11223344u, bytes / 4, s));
  CUgraph g = nullptr;
  CU_ASSERT(cuStreamEndCapture(s, &g));
  CUgraphExec e = nullptr;
  CU_ASSERT(cuGraphInstantiate(&e, g, 0));
  CU_ASSERT(cuGraphLaunch(e, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(freeMem(), before - bytes);
  uint32_t word = 0;
  CU_ASSERT(cuMemcpyDtoH(&word, p + bytes - 4, 4));
  EXPECT_EQ(word, 0x11223344u);
  CU_ASSERT(cuMemFree(p));
  EXPECT_EQ(freeMem(), before);
  CU_ASSERT(cuGraphExecDestroy(e));
  CU_ASSERT(cuGraphDestroy(g));
  CU_ASSERT(cuStreamDestroy(s));
}

}  // namespace

namespace {
// ---------------------------------------------------------------------------------------------
// Shareable physical memory lives, on the device, while a handle or an exported descriptor refers
// to it (a real driver keeps it for the descriptor): release alone does not free it.
TEST_F(Vmm, ExportedDescriptorKeepsTheMemory) {
  CUmemAllocationProp prop = deviceProp();
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  const size_t size = 8 * kMiB;
  const size_t before = freeMem();
  CUmemGenericAllocationHandle h = 0;
  CU_ASSERT(cuMemCreate(&h, size, &prop, 0));
  int fd = -1;
  CU_ASSERT(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  const int copy = dup(fd);  // a duplicate keeps it as well
  CU_ASSERT(cuMemRelease(h));
  EXPECT_EQ(before - size, freeMem()) << "the exported descriptor keeps the memory";
  // Imported again after the maker's handle is gone: the same memory, on its device.
  CUmemGenericAllocationHandle imported = 0;
  CU_ASSERT(cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUmemAllocationProp got{};
  CU_ASSERT(cuMemGetAllocationPropertiesFromHandle(&got, imported));
  EXPECT_EQ(0, got.location.id);
  close(fd);
  close(copy);
  EXPECT_EQ(before - size, freeMem()) << "the imported handle keeps the memory";
  CU_ASSERT(cuMemRelease(imported));
  EXPECT_EQ(before, freeMem()) << "no handle, no descriptor: freed";
  // Not exported: freed at release, as before.
  CU_ASSERT(cuMemCreate(&h, size, &prop, 0));
  CU_ASSERT(cuMemRelease(h));
  EXPECT_EQ(before, freeMem());
}

// Arrays are counted in block-linear tiles, and the memory-requirement queries answer that size
// for deferred-mapping arrays (only for those, as real drivers), which themselves take nothing.
TEST_F(Arrays, TiledSizeIsCountedAndReported) {
  CUDA_ARRAY3D_DESCRIPTOR d{};
  d.Width = 1;
  d.Height = 1;
  d.Depth = 64;
  d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  d.NumChannels = 1;
  const size_t before = freeMem();
  CUarray a = nullptr;
  CU_ASSERT(cuArray3DCreate(&a, &d));
  const size_t counted = before - freeMem();
  EXPECT_EQ(64u * 64 * 8, counted) << "one 64-byte x 8-row GOB per slice";
  CUDA_ARRAY_MEMORY_REQUIREMENTS req{};
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuArrayGetMemoryRequirements(&req, a, 0));
  CU_ASSERT(cuArrayDestroy(a));
  d.Flags = CUDA_ARRAY3D_DEFERRED_MAPPING;
  CU_ASSERT(cuArray3DCreate(&a, &d));
  EXPECT_EQ(before, freeMem()) << "a deferred-mapping array takes no memory";
  CU_ASSERT(cuArrayGetMemoryRequirements(&req, a, 0));
  EXPECT_EQ(counted, req.size);
  CU_ASSERT(cuArrayDestroy(a));
  CUmipmappedArray m = nullptr;
  CU_ASSERT(cuMipmappedArrayCreate(&m, &d, 3));
  CU_ASSERT(cuMipmappedArrayGetMemoryRequirements(&req, m, 0));
  EXPECT_EQ(64u * 512 + 32u * 512 + 16u * 512, req.size);
  CU_ASSERT(cuMipmappedArrayDestroy(m));
  d.Flags = 0;
  CU_ASSERT(cuMipmappedArrayCreate(&m, &d, 3));
  EXPECT_EQ(before - req.size, freeMem());
  CU_ASSERT(cuMipmappedArrayDestroy(m));
  EXPECT_EQ(before, freeMem());
}

// Child graphs: a copy is embedded (later edits of the original do not reach it), memory nodes only
// come in with CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE, and an executable graph runs them.
TEST_F(GraphMemory, MemoryNodesInMovedChildGraphs) {
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const size_t before = freeMem();
  CUgraph child = nullptr, parent = nullptr;
  CU_ASSERT(cuGraphCreate(&child, 0));
  CU_ASSERT(cuGraphCreate(&parent, 0));
  CUDA_MEM_ALLOC_NODE_PARAMS ap = allocParams(16 * kMiB);
  CUgraphNode alloc = nullptr, node = nullptr;
  CU_ASSERT(cuGraphAddMemAllocNode(&alloc, child, nullptr, 0, &ap));
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuGraphAddChildGraphNode(&node, parent, nullptr, 0, child))
      << "a cloned child graph may not hold memory nodes";
  CUgraphNodeParams p{};
  p.type = CU_GRAPH_NODE_TYPE_GRAPH;
  p.graph.graph = child;
  p.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
  CU_ASSERT(cuGraphAddNode(&node, parent, nullptr, nullptr, 0, &p));
  CUgraph embedded = nullptr;
  CU_ASSERT(cuGraphChildGraphNodeGetGraph(node, &embedded));
  EXPECT_EQ(child, embedded) << "moved in, not copied";
  CUgraphExec exec = nullptr;
  CU_ASSERT(cuGraphInstantiateWithFlags(&exec, parent, 0));
  CU_ASSERT(cuGraphLaunch(exec, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(before - 16 * kMiB, freeMem());
  CU_ASSERT(cuMemFree(ap.dptr));
  EXPECT_EQ(before, freeMem());
  CU_ASSERT(cuGraphExecDestroy(exec));
  CU_ASSERT(cuGraphDestroy(parent));
  CU_ASSERT(cuStreamDestroy(s));
}
}  // namespace

namespace {
// The first (32-bit) ABIs a real driver still exports allocate and are counted like the current
// ones (the shim refuses them: tests/shim).
TEST_F(Vmm, FirstAbiAllocationsAreCounted) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(nullptr, h);
  auto alloc = reinterpret_cast<CUresult (*)(unsigned int*, unsigned int)>(dlsym(h, "cuMemAlloc"));
  auto release = reinterpret_cast<CUresult (*)(unsigned int)>(dlsym(h, "cuMemFree"));
  ASSERT_TRUE(alloc && release);
  const size_t before = freeMem();
  unsigned int p = 0;
  CU_ASSERT(alloc(&p, 16 * kMiB));
  EXPECT_NE(0u, p);
  EXPECT_EQ(before - 16 * kMiB, freeMem());
  CU_ASSERT(release(p));
  EXPECT_EQ(before, freeMem());
  const unsigned desc[6] = {1, 1, 64, CU_AD_FORMAT_UNSIGNED_INT8, 1, 0};
  CUarray a = nullptr;
  CU_ASSERT(reinterpret_cast<CUresult (*)(CUarray*, const void*)>(dlsym(h, "cuArray3DCreate"))(&a, desc));
  EXPECT_EQ(before - 64 * 512, freeMem());
  CU_ASSERT(cuArrayDestroy(a));
  dlclose(h);
}
}  // namespace

// Newer than this toolkit's cuda.h (drivers since CUDA 13.2 export it); simgpu does.
extern "C" CUresult cuGraphNodeGetParams(CUgraphNode node, CUgraphNodeParams* params);

namespace {
int gBodyRuns = 0;
void countBodyRun(void*) { ++gBodyRuns; }

// Conditional nodes: bodies made by the driver, run by the condition's default value, described
// by cuGraphNodeGetParams; memory nodes in a body (at any depth) are refused at instantiation, as
// real drivers allow none there.
TEST_F(GraphMemory, ConditionalBodies) {
  CUstream s = nullptr;
  CU_ASSERT(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUgraph g = nullptr;
  CU_ASSERT(cuGraphCreate(&g, 0));
  CUgraphConditionalHandle handle = 0;
  CU_ASSERT(cuGraphConditionalHandleCreate(&handle, g, ctx_, 1, CU_GRAPH_COND_ASSIGN_DEFAULT));
  CUgraphNodeParams p{};
  p.type = CU_GRAPH_NODE_TYPE_CONDITIONAL;
  p.conditional.handle = handle;
  p.conditional.type = CU_GRAPH_COND_TYPE_IF;
  p.conditional.size = 2;
  CUgraphNode cond = nullptr;
  CU_ASSERT(cuGraphAddNode(&cond, g, nullptr, nullptr, 0, &p));
  ASSERT_NE(nullptr, p.conditional.phGraph_out);
  CUDA_HOST_NODE_PARAMS host{countBodyRun, nullptr};
  CUgraphNode hn = nullptr;
  CU_ASSERT(cuGraphAddHostNode(&hn, p.conditional.phGraph_out[0], nullptr, 0, &host));
  CUgraphNodeParams got{};
  CU_ASSERT(cuGraphNodeGetParams(cond, &got));
  EXPECT_EQ(CU_GRAPH_NODE_TYPE_CONDITIONAL, got.type);
  EXPECT_EQ(2u, got.conditional.size);
  EXPECT_EQ(p.conditional.phGraph_out[1], got.conditional.phGraph_out[1]);
  CUgraphExec exec = nullptr;
  CU_ASSERT(cuGraphInstantiateWithFlags(&exec, g, 0));
  gBodyRuns = 0;
  CU_ASSERT(cuGraphLaunch(exec, s));
  CU_ASSERT(cuStreamSynchronize(s));
  EXPECT_EQ(1, gBodyRuns) << "condition 1: the if body ran";
  CU_ASSERT(cuGraphExecDestroy(exec));
  // A memory node moved into the else body, one child graph down: refused.
  CUgraph child = nullptr;
  CU_ASSERT(cuGraphCreate(&child, 0));
  CUDA_MEM_ALLOC_NODE_PARAMS ap = allocParams(16 * kMiB);
  CUgraphNode alloc = nullptr, node = nullptr;
  CU_ASSERT(cuGraphAddMemAllocNode(&alloc, child, nullptr, 0, &ap));
  CUgraphNodeParams cp{};
  cp.type = CU_GRAPH_NODE_TYPE_GRAPH;
  cp.graph.graph = child;
  cp.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
  CU_ASSERT(cuGraphAddNode(&node, p.conditional.phGraph_out[1], nullptr, nullptr, 0, &cp));
  EXPECT_EQ(CUDA_ERROR_NOT_SUPPORTED, cuGraphInstantiateWithFlags(&exec, g, 0));
  CU_ASSERT(cuGraphDestroy(g));
  CU_ASSERT(cuStreamDestroy(s));
}
}  // namespace
