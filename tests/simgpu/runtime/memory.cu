// Memory management through the CUDA runtime API: allocation, copies in every direction and
// shape, memsets, pinned/mapped/registered/managed host memory, pointer attributes, accounting.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda_check.h"

using namespace simtest;

// Module globals: reached through cudaMemcpyToSymbol & co (driver: cuLibraryGetGlobal /
// cuModuleGetGlobal).
__device__ int g_table[16];
__constant__ float c_coeffs[8];

namespace {

std::vector<uint8_t> pattern(size_t n, unsigned seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = patternByte(i, seed);
  return v;
}

// Index of the first differing byte, or -1.
long long firstMismatch(const void* a, const void* b, size_t n) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  if (std::memcmp(x, y, n) == 0) return -1;
  for (size_t i = 0; i < n; ++i)
    if (x[i] != y[i]) return static_cast<long long>(i);
  return -1;
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

TEST(Memory, RoundTripSizes) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, MiB + 3, 64 * MiB}) {
    SCOPED_TRACE("size " + std::to_string(n));
    const auto src = pattern(n, static_cast<unsigned>(n));
    std::vector<uint8_t> out(n, 0);
    void *a = nullptr, *b = nullptr;
    CUDA_ASSERT(cudaMalloc(&a, n));
    CUDA_ASSERT(cudaMalloc(&b, n));
    if (n) {
      ASSERT_NE(nullptr, a);
      ASSERT_NE(nullptr, b);
      EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(a) % 256) << "cudaMalloc returns 256-byte aligned memory";
    }
    CUDA_ASSERT(cudaMemcpy(a, src.data(), n, cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
    CUDA_ASSERT(cudaMemcpy(out.data(), b, n, cudaMemcpyDeviceToHost));
    EXPECT_EQ(-1, firstMismatch(src.data(), out.data(), n));
    CUDA_ASSERT(cudaFree(a));
    CUDA_ASSERT(cudaFree(b));
  }
}

TEST(Memory, PartialCopiesAtOffsets) {
  const size_t n = 1 << 16;
  const auto src = pattern(n, 3);
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemset(d, 0, n));
  CUDA_ASSERT(cudaMemcpy(d + 100, src.data() + 5, 1000, cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(d + 5000, d + 100, 1000, cudaMemcpyDeviceToDevice));
  std::vector<uint8_t> out(n, 0xff);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    uint8_t want = 0;
    if (i >= 100 && i < 1100) want = src[i - 100 + 5];
    if (i >= 5000 && i < 6000) want = src[i - 5000 + 5];
    ASSERT_EQ(want, out[i]) << "byte " << i;
  }
  CUDA_ASSERT(cudaFree(d));
}

TEST(Memory, Memset) {
  const size_t n = 3 * MiB + 11;
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemset(d, 0xa5, n));
  CUDA_ASSERT(cudaMemset(d + 17, 0x3c, 1000));
  CUDA_ASSERT(cudaMemset(d + n - 1, 0x01, 1));
  CUDA_ASSERT(cudaMemset(d, 0x77, 0));  // zero bytes: no effect
  std::vector<uint8_t> out(n);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) {
    uint8_t want = 0xa5;
    if (i >= 17 && i < 1017) want = 0x3c;
    if (i == n - 1) want = 0x01;
    ASSERT_EQ(want, out[i]) << "byte " << i;
  }
  // cudaMemset takes an int and uses its low byte.
  CUDA_ASSERT(cudaMemset(d, 0x1ff, 64));
  CUDA_ASSERT(cudaMemcpy(out.data(), d, 64, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 64; ++i) ASSERT_EQ(0xff, out[i]);
  CUDA_ASSERT(cudaFree(d));
}

TEST(Memory, MemGetInfoTracksAllocations) {
  const size_t size = 64 * MiB;
  const size_t over = onSimgpu() ? 2 * MiB : 64 * MiB;  // allowed rounding beyond the request
  size_t free0, total0, free1, total1, free2, total2;
  memInfo(&free0, &total0);
  void* p = nullptr;
  CUDA_ASSERT(cudaMalloc(&p, size));
  memInfo(&free1, &total1);
  CUDA_ASSERT(cudaFree(p));
  memInfo(&free2, &total2);
  EXPECT_EQ(total0, total1);
  EXPECT_EQ(total0, total2);
  ASSERT_LT(free1, free0);
  EXPECT_GE(free0 - free1, size);
  EXPECT_LE(free0 - free1, size + over);
  if (onSimgpu())
    EXPECT_EQ(free0, free2);
  else
    EXPECT_GE(free2 + memSlack(), free0);

  // Several allocations add up; freeing them in another order gives everything back.
  std::vector<void*> ps(4, nullptr);
  for (auto& q : ps) CUDA_ASSERT(cudaMalloc(&q, 16 * MiB));
  size_t free3, total3;
  memInfo(&free3, &total3);
  EXPECT_GE(free2 - free3, 64 * MiB);
  EXPECT_LE(free2 - free3, 64 * MiB + 4 * over);
  for (int i : {2, 0, 3, 1}) CUDA_ASSERT(cudaFree(ps[i]));
  size_t free4, total4;
  memInfo(&free4, &total4);
  if (onSimgpu()) EXPECT_EQ(free2, free4);
}

TEST(Memory, OutOfMemory) {
  size_t freeBytes, totalBytes;
  memInfo(&freeBytes, &totalBytes);
  void* p = reinterpret_cast<void*>(0x1);
  CUDA_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMalloc(&p, totalBytes + GiB));
  CUDA_EXPECT_ERR(cudaErrorMemoryAllocation, cudaMalloc(&p, ~size_t{0} - 4096));
  // The error is not sticky and nothing was charged.
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  size_t freeAfter, totalAfter;
  memInfo(&freeAfter, &totalAfter);
  if (onSimgpu()) EXPECT_EQ(freeBytes, freeAfter);
  CUDA_ASSERT(cudaMalloc(&p, MiB));
  CUDA_ASSERT(cudaFree(p));
}

TEST(Memory, FreeErrors) {
  CUDA_ASSERT(cudaFree(nullptr));
  int local = 0;
  CUDA_EXPECT_ERR(cudaErrorInvalidValue, cudaFree(&local));  // not a device allocation
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST(Memory, Pitch2D) {
  const size_t width = 1000, height = 37;  // bytes per row, rows
  uint8_t* d = nullptr;
  size_t pitch = 0;
  CUDA_ASSERT(cudaMallocPitch(reinterpret_cast<void**>(&d), &pitch, width, height));
  ASSERT_GE(pitch, width);
  const size_t hpitch = width + 24;
  const auto host = pattern(hpitch * height, 9);
  CUDA_ASSERT(cudaMemset2D(d, pitch, 0, pitch, height));
  CUDA_ASSERT(cudaMemcpy2D(d, pitch, host.data(), hpitch, width, height, cudaMemcpyHostToDevice));
  // Overwrite a 10x5 rectangle at (x=30, y=4) with 0xee.
  CUDA_ASSERT(cudaMemset2D(d + 4 * pitch + 30, pitch, 0xee, 10, 5));

  const size_t opitch = width + 3;  // an odd destination pitch
  std::vector<uint8_t> out(opitch * height, 0x55);
  CUDA_ASSERT(cudaMemcpy2D(out.data(), opitch, d, pitch, width, height, cudaMemcpyDeviceToHost));
  for (size_t y = 0; y < height; ++y) {
    for (size_t x = 0; x < width; ++x) {
      const bool inRect = y >= 4 && y < 9 && x >= 30 && x < 40;
      const uint8_t want = inRect ? 0xee : host[y * hpitch + x];
      ASSERT_EQ(want, out[y * opitch + x]) << "x=" << x << " y=" << y;
    }
    for (size_t x = width; x < opitch; ++x) ASSERT_EQ(0x55, out[y * opitch + x]) << "padding touched";
  }

  // Device-to-device 2D copy of a 100x10 window into a second pitched allocation.
  uint8_t* e = nullptr;
  size_t epitch = 0;
  CUDA_ASSERT(cudaMallocPitch(reinterpret_cast<void**>(&e), &epitch, 256, 16));
  CUDA_ASSERT(cudaMemset2D(e, epitch, 0x11, 256, 16));
  CUDA_ASSERT(cudaMemcpy2D(e + 2 * epitch + 50, epitch, d + 20 * pitch + 7, pitch, 100, 10,
                           cudaMemcpyDeviceToDevice));
  std::vector<uint8_t> eout(256 * 16);
  CUDA_ASSERT(cudaMemcpy2D(eout.data(), 256, e, epitch, 256, 16, cudaMemcpyDeviceToHost));
  for (size_t y = 0; y < 16; ++y)
    for (size_t x = 0; x < 256; ++x) {
      const bool inWin = y >= 2 && y < 12 && x >= 50 && x < 150;
      const uint8_t want = inWin ? host[(y - 2 + 20) * hpitch + (x - 50 + 7)] : 0x11;
      ASSERT_EQ(want, eout[y * 256 + x]) << "x=" << x << " y=" << y;
    }
  // A width larger than the pitch is invalid.
  const cudaError_t bad = cudaMemcpy2D(out.data(), 10, d, pitch, 20, 2, cudaMemcpyDeviceToHost);
  EXPECT_TRUE(bad == cudaErrorInvalidPitchValue || bad == cudaErrorInvalidValue) << cudaGetErrorName(bad);
  (void)cudaGetLastError();
  CUDA_ASSERT(cudaFree(d));
  CUDA_ASSERT(cudaFree(e));
}

TEST(Memory, Malloc3DAndMemcpy3D) {
  const size_t w = 200, h = 13, depth = 5;  // width in bytes
  cudaPitchedPtr dp{};
  CUDA_ASSERT(cudaMalloc3D(&dp, make_cudaExtent(w, h, depth)));
  ASSERT_NE(nullptr, dp.ptr);
  ASSERT_GE(dp.pitch, w);
  EXPECT_EQ(w, dp.xsize);
  EXPECT_EQ(h, dp.ysize);
  CUDA_ASSERT(cudaMemset3D(dp, 0x5a, make_cudaExtent(w, h, depth)));

  // Host volume with its own pitch, copied whole.
  const size_t hp = w + 8;
  const auto host = pattern(hp * h * depth, 21);
  cudaMemcpy3DParms up{};
  up.srcPtr = make_cudaPitchedPtr(const_cast<uint8_t*>(host.data()), hp, w, h);
  up.dstPtr = dp;
  up.extent = make_cudaExtent(w, h, depth);
  up.kind = cudaMemcpyHostToDevice;
  CUDA_ASSERT(cudaMemcpy3D(&up));

  // A 16x3x2 box from host position (1,2,0) to device position (8,4,2).
  cudaMemcpy3DParms box{};
  box.srcPtr = up.srcPtr;
  box.srcPos = make_cudaPos(1, 2, 0);
  box.dstPtr = dp;
  box.dstPos = make_cudaPos(8, 4, 2);
  box.extent = make_cudaExtent(16, 3, 2);
  box.kind = cudaMemcpyHostToDevice;
  std::vector<uint8_t> boxSrc(hp * h * depth);
  for (size_t i = 0; i < boxSrc.size(); ++i) boxSrc[i] = static_cast<uint8_t>(~host[i]);
  box.srcPtr = make_cudaPitchedPtr(boxSrc.data(), hp, w, h);
  CUDA_ASSERT(cudaMemcpy3D(&box));

  std::vector<uint8_t> out(w * h * depth, 0);
  cudaMemcpy3DParms down{};
  down.srcPtr = dp;
  down.dstPtr = make_cudaPitchedPtr(out.data(), w, w, h);
  down.extent = make_cudaExtent(w, h, depth);
  down.kind = cudaMemcpyDeviceToHost;
  CUDA_ASSERT(cudaMemcpy3D(&down));
  for (size_t z = 0; z < depth; ++z)
    for (size_t y = 0; y < h; ++y)
      for (size_t x = 0; x < w; ++x) {
        const bool inBox = z >= 2 && z < 4 && y >= 4 && y < 7 && x >= 8 && x < 24;
        const uint8_t want = inBox ? boxSrc[(z - 2) * hp * h + (y - 4 + 2) * hp + (x - 8 + 1)]
                                   : host[z * hp * h + y * hp + x];
        ASSERT_EQ(want, out[z * w * h + y * w + x]) << "x=" << x << " y=" << y << " z=" << z;
      }
  CUDA_ASSERT(cudaFree(dp.ptr));
}

TEST(Memory, ManagedIsHostAccessible) {
  const size_t n = 1 * MiB;
  uint8_t* m = nullptr;
  CUDA_ASSERT(cudaMallocManaged(&m, n));
  ASSERT_NE(nullptr, m);
  for (size_t i = 0; i < n; ++i) m[i] = patternByte(i, 5);  // written on the host
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemcpy(d, m, n, cudaMemcpyDefault));
  std::vector<uint8_t> out(n);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(patternByte(i, 5), out[i]) << i;

  // Device writes to managed memory are visible on the host after synchronisation.
  CUDA_ASSERT(cudaMemset(m, 0x42, n / 2));
  CUDA_ASSERT(cudaDeviceSynchronize());
  for (size_t i = 0; i < n / 2; ++i) ASSERT_EQ(0x42, m[i]) << i;
  for (size_t i = n / 2; i < n; ++i) ASSERT_EQ(patternByte(i, 5), m[i]) << i;

  uint8_t* m2 = nullptr;
  CUDA_ASSERT(cudaMallocManaged(&m2, n, cudaMemAttachHost));
  CUDA_ASSERT(cudaMemcpy(m2, d, n, cudaMemcpyDefault));
  CUDA_ASSERT(cudaDeviceSynchronize());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(patternByte(i, 5), m2[i]) << i;
  CUDA_ASSERT(cudaFree(m2));
  CUDA_ASSERT(cudaFree(m));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Memory, HostAllocMapped) {
  const size_t n = 256 * KiB;
  uint8_t* h = nullptr;
  CUDA_ASSERT(cudaHostAlloc(reinterpret_cast<void**>(&h), n, cudaHostAllocMapped));
  ASSERT_NE(nullptr, h);
  unsigned flags = 0;
  CUDA_ASSERT(cudaHostGetFlags(&flags, h));
  EXPECT_TRUE(flags & cudaHostAllocMapped) << flags;
  uint8_t* dp = nullptr;
  CUDA_ASSERT(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dp), h, 0));
  ASSERT_NE(nullptr, dp);
  for (size_t i = 0; i < n; ++i) h[i] = patternByte(i, 11);

  // Read through the device pointer...
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemcpy(d, dp, n, cudaMemcpyDefault));
  std::vector<uint8_t> out(n);
  CUDA_ASSERT(cudaMemcpy(out.data(), d, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(patternByte(i, 11), out[i]) << i;
  // ...and write through it: the host pointer sees the data.
  CUDA_ASSERT(cudaMemset(d, 0x99, n));
  CUDA_ASSERT(cudaMemcpy(dp, d, n, cudaMemcpyDefault));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(0x99, h[i]) << i;
  CUDA_ASSERT(cudaFree(d));
  CUDA_ASSERT(cudaFreeHost(h));
}

TEST(Memory, HostRegister) {
  const size_t n = 1 * MiB;
  std::unique_ptr<uint8_t, AlignedFree> buf(static_cast<uint8_t*>(std::aligned_alloc(4096, n)));
  ASSERT_TRUE(buf);
  DeviceDrain drain;  // after buf: queued copies use it
  uint8_t* h = buf.get();
  for (size_t i = 0; i < n; ++i) h[i] = patternByte(i, 13);

  CUDA_ASSERT(cudaHostRegister(h, n, cudaHostRegisterMapped));
  cudaPointerAttributes a{};
  CUDA_ASSERT(cudaPointerGetAttributes(&a, h + 100));
  EXPECT_EQ(cudaMemoryTypeHost, a.type);
  EXPECT_EQ(h + 100, a.hostPointer);
  CUDA_EXPECT_ERR(cudaErrorHostMemoryAlreadyRegistered, cudaHostRegister(h, n, cudaHostRegisterDefault));

  uint8_t* dp = nullptr;
  CUDA_ASSERT(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dp), h, 0));
  ASSERT_NE(nullptr, dp);

  cudaStream_t s;
  CUDA_ASSERT(cudaStreamCreate(&s));
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s));
  CUDA_ASSERT(cudaMemsetAsync(d, 0xcd, 4096, s));
  CUDA_ASSERT(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
  CUDA_ASSERT(cudaStreamSynchronize(s));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(i < 4096 ? 0xcd : patternByte(i, 13), h[i]) << i;
  // Through the mapped device pointer.
  CUDA_ASSERT(cudaMemset(d, 0x21, n));
  CUDA_ASSERT(cudaMemcpy(dp, d, 64, cudaMemcpyDefault));
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(0x21, h[i]) << i;

  CUDA_ASSERT(cudaHostUnregister(h));
  CUDA_EXPECT_ERR(cudaErrorHostMemoryNotRegistered, cudaHostUnregister(h));
  CUDA_ASSERT(cudaPointerGetAttributes(&a, h));
  EXPECT_EQ(cudaMemoryTypeUnregistered, a.type);
  CUDA_ASSERT(cudaStreamDestroy(s));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Memory, MallocHost) {
  const size_t n = 4 * MiB;
  uint8_t *h = nullptr, *h2 = nullptr;
  CUDA_ASSERT(cudaMallocHost(&h, n));
  CUDA_ASSERT(cudaMallocHost(reinterpret_cast<void**>(&h2), n, cudaHostAllocDefault));
  for (size_t i = 0; i < n; ++i) h[i] = patternByte(i, 17);
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, n));
  CUDA_ASSERT(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(h2, d, n, cudaMemcpyDeviceToHost));
  EXPECT_EQ(-1, firstMismatch(h, h2, n));
  cudaPointerAttributes a{};
  CUDA_ASSERT(cudaPointerGetAttributes(&a, h));
  EXPECT_EQ(cudaMemoryTypeHost, a.type);
  EXPECT_EQ(h, a.hostPointer);
  CUDA_ASSERT(cudaFreeHost(h));
  CUDA_ASSERT(cudaFreeHost(h2));
  CUDA_ASSERT(cudaFree(d));
}

TEST(Memory, MemcpyDefaultKind) {
  const size_t n = 100000;
  const auto src = pattern(n, 23);
  std::vector<uint8_t> out(n, 0), hostCopy(n, 0);
  void *a = nullptr, *b = nullptr;
  CUDA_ASSERT(cudaMalloc(&a, n));
  CUDA_ASSERT(cudaMalloc(&b, n));
  CUDA_ASSERT(cudaMemcpy(a, src.data(), n, cudaMemcpyDefault));     // H2D
  CUDA_ASSERT(cudaMemcpy(b, a, n, cudaMemcpyDefault));              // D2D
  CUDA_ASSERT(cudaMemcpy(out.data(), b, n, cudaMemcpyDefault));     // D2H
  CUDA_ASSERT(cudaMemcpy(hostCopy.data(), out.data(), n, cudaMemcpyDefault));  // H2H
  EXPECT_EQ(-1, firstMismatch(src.data(), out.data(), n));
  EXPECT_EQ(-1, firstMismatch(src.data(), hostCopy.data(), n));
  // An explicit host-to-host copy works too.
  std::vector<uint8_t> hh(n, 0);
  CUDA_ASSERT(cudaMemcpy(hh.data(), src.data(), n, cudaMemcpyHostToHost));
  EXPECT_EQ(-1, firstMismatch(src.data(), hh.data(), n));
  CUDA_ASSERT(cudaFree(a));
  CUDA_ASSERT(cudaFree(b));
}

TEST(Memory, PointerAttributes) {
  int dev = -1;
  CUDA_ASSERT(cudaGetDevice(&dev));
  uint8_t* d = nullptr;
  CUDA_ASSERT(cudaMalloc(&d, 1 * MiB));
  cudaPointerAttributes a{};
  CUDA_ASSERT(cudaPointerGetAttributes(&a, d));
  EXPECT_EQ(cudaMemoryTypeDevice, a.type);
  EXPECT_EQ(dev, a.device);
  EXPECT_EQ(d, a.devicePointer);
  EXPECT_EQ(nullptr, a.hostPointer);
  // An interior pointer reports itself.
  CUDA_ASSERT(cudaPointerGetAttributes(&a, d + 4096 + 8));
  EXPECT_EQ(cudaMemoryTypeDevice, a.type);
  EXPECT_EQ(d + 4096 + 8, a.devicePointer);

  uint8_t* h = nullptr;
  CUDA_ASSERT(cudaMallocHost(&h, 4096));
  CUDA_ASSERT(cudaPointerGetAttributes(&a, h));
  EXPECT_EQ(cudaMemoryTypeHost, a.type);
  EXPECT_EQ(h, a.hostPointer);
  EXPECT_EQ(h, a.devicePointer);  // unified addressing: mapped at the same address

  uint8_t* m = nullptr;
  CUDA_ASSERT(cudaMallocManaged(&m, 4096));
  CUDA_ASSERT(cudaPointerGetAttributes(&a, m));
  EXPECT_EQ(cudaMemoryTypeManaged, a.type);
  EXPECT_EQ(m, a.hostPointer);
  EXPECT_EQ(m, a.devicePointer);

  std::vector<uint8_t> pageable(4096);
  CUDA_ASSERT(cudaPointerGetAttributes(&a, pageable.data()));
  EXPECT_EQ(cudaMemoryTypeUnregistered, a.type);
  int onStack = 0;
  CUDA_ASSERT(cudaPointerGetAttributes(&a, &onStack));
  EXPECT_EQ(cudaMemoryTypeUnregistered, a.type);

  CUDA_ASSERT(cudaFree(d));
  CUDA_ASSERT(cudaFreeHost(h));
  CUDA_ASSERT(cudaFree(m));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST(Memory, Symbols) {
  size_t size = 0;
  CUDA_ASSERT(cudaGetSymbolSize(&size, g_table));
  EXPECT_EQ(sizeof(int) * 16, size);
  int in[16], out[16];
  for (int i = 0; i < 16; ++i) in[i] = i * i - 7;
  CUDA_ASSERT(cudaMemcpyToSymbol(g_table, in, sizeof in));
  std::memset(out, 0, sizeof out);
  CUDA_ASSERT(cudaMemcpyFromSymbol(out, g_table, sizeof out));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(in[i], out[i]) << i;

  // With an offset, and through the symbol's address.
  const int four[4] = {100, 101, 102, 103};
  CUDA_ASSERT(cudaMemcpyToSymbol(g_table, four, sizeof four, 8 * sizeof(int)));
  void* addr = nullptr;
  CUDA_ASSERT(cudaGetSymbolAddress(&addr, g_table));
  ASSERT_NE(nullptr, addr);
  CUDA_ASSERT(cudaMemcpy(out, addr, sizeof out, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(i >= 8 && i < 12 ? 100 + i - 8 : in[i], out[i]) << i;
  // Past the end of the symbol.
  CUDA_EXPECT_ERR(cudaErrorInvalidValue, cudaMemcpyToSymbol(g_table, in, sizeof in, 4));

  const float coeffs[8] = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f, 7.5f};
  float back[8] = {};
  CUDA_ASSERT(cudaMemcpyToSymbol(c_coeffs, coeffs, sizeof coeffs));
  CUDA_ASSERT(cudaMemcpyFromSymbol(back, c_coeffs, sizeof back));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(coeffs[i], back[i]) << i;
}
