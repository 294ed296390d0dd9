// Copies and memsets in every flavour. All copies are expressed as one CUDA_MEMCPY3D and all
// memsets as one CUDA_MEMSET_NODE_PARAMS, so the synchronous, asynchronous and graph-node forms
// share one implementation (copy3D / setMemory) and a captured copy replays exactly.
#include <cstring>

#include "driver.h"

namespace simgpu {
namespace {

// True if [p, p+bytes) is simulated memory throughout: one range, or adjacent ranges such as
// consecutive VMM mappings in one reservation.
bool knownRange(uintptr_t p, size_t bytes) {
  const uintptr_t end = p + bytes;
  do {
    Allocation a;
    if (!registryFind(p, &a)) return false;
    if (a.size == 0) return bytes == 0;
    p = a.base + a.size;
  } while (p < end);
  return true;
}

struct Side {
  char* base;
  size_t pitch;
  size_t height;
};

CUresult resolveSide(CUmemorytype type, const void* host, CUdeviceptr dev, CUarray arr, size_t x, size_t y, size_t z,
                     size_t pitch, size_t height, size_t rowBytes, size_t rows, size_t depth, Side* out) {
  switch (type) {
    case CU_MEMORYTYPE_HOST:
      if (!host) return CUDA_ERROR_INVALID_VALUE;
      out->base = static_cast<char*>(const_cast<void*>(host));
      break;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED:
      if (!dev) return CUDA_ERROR_INVALID_VALUE;
      out->base = reinterpret_cast<char*>(dev);
      break;
    case CU_MEMORYTYPE_ARRAY: {
      ArrayLayout l;
      if (!arrayLayout(arr, &l)) return CUDA_ERROR_INVALID_HANDLE;
      if (x + rowBytes > l.widthBytes || y + rows > l.height || z + depth > l.depth) return CUDA_ERROR_INVALID_VALUE;
      out->base = l.data;
      pitch = l.rowPitch;
      height = l.height;
      break;
    }
    default:
      return CUDA_ERROR_INVALID_VALUE;
  }
  if (pitch == 0) pitch = rowBytes;
  if (height == 0) height = rows;
  out->base += x + y * pitch + z * pitch * height;
  out->pitch = pitch;
  out->height = height;
  if (type == CU_MEMORYTYPE_DEVICE && rowBytes && rows && depth) {
    const size_t span = (depth - 1) * pitch * height + (rows - 1) * pitch + rowBytes;
    if (!knownRange(reinterpret_cast<uintptr_t>(out->base), span)) return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

}  // namespace

CUresult copy3D(const CUDA_MEMCPY3D& c, bool execute) {
  const size_t w = c.WidthInBytes, h = c.Height ? c.Height : 1, d = c.Depth ? c.Depth : 1;
  if (w == 0) return CUDA_SUCCESS;
  Side s, t;
  CU_TRY(resolveSide(c.srcMemoryType, c.srcHost, c.srcDevice, c.srcArray, c.srcXInBytes, c.srcY, c.srcZ, c.srcPitch,
                     c.srcHeight, w, h, d, &s));
  CU_TRY(resolveSide(c.dstMemoryType, c.dstHost, c.dstDevice, c.dstArray, c.dstXInBytes, c.dstY, c.dstZ, c.dstPitch,
                     c.dstHeight, w, h, d, &t));
  if ((h > 1 || d > 1) && (s.pitch < w || t.pitch < w)) return CUDA_ERROR_INVALID_VALUE;
  if (!execute) return CUDA_SUCCESS;
  for (size_t z = 0; z < d; ++z)
    for (size_t y = 0; y < h; ++y)
      std::memmove(t.base + z * t.pitch * t.height + y * t.pitch, s.base + z * s.pitch * s.height + y * s.pitch, w);
  return CUDA_SUCCESS;
}

// execute false: only the checks; checkRange false too: the element size and pitch, not whether
// the destination is known (a memset being captured: the node checks it when it runs).
CUresult setMemory(const CUDA_MEMSET_NODE_PARAMS& m, bool execute, bool checkRange) {
  const size_t es = m.elementSize, w = m.width, h = m.height ? m.height : 1;
  if (es != 1 && es != 2 && es != 4) return CUDA_ERROR_INVALID_VALUE;
  const size_t pitch = h > 1 ? m.pitch : w * es;
  if (w == 0) return CUDA_SUCCESS;
  if (h > 1 && pitch < w * es) return CUDA_ERROR_INVALID_VALUE;
  if ((execute || checkRange) && !knownRange(m.dst, (h - 1) * pitch + w * es)) return CUDA_ERROR_INVALID_VALUE;
  if (!execute) return CUDA_SUCCESS;
  for (size_t y = 0; y < h; ++y) {
    char* row = reinterpret_cast<char*>(m.dst) + y * pitch;
    if (es == 1) {
      std::memset(row, static_cast<int>(m.value & 0xff), w);
    } else if (es == 2) {
      auto* p = reinterpret_cast<uint16_t*>(row);
      for (size_t i = 0; i < w; ++i) p[i] = static_cast<uint16_t>(m.value);
    } else {
      auto* p = reinterpret_cast<uint32_t*>(row);
      for (size_t i = 0; i < w; ++i) p[i] = m.value;
    }
  }
  return CUDA_SUCCESS;
}

}  // namespace simgpu

using namespace simgpu;

namespace {

CUDA_MEMCPY3D linear(CUmemorytype st, const void* sh, CUdeviceptr sd, CUmemorytype dt, void* dh, CUdeviceptr dd,
                     size_t bytes) {
  CUDA_MEMCPY3D c = {};
  c.srcMemoryType = st;
  c.srcHost = sh;
  c.srcDevice = sd;
  c.dstMemoryType = dt;
  c.dstHost = dh;
  c.dstDevice = dd;
  c.WidthInBytes = bytes;
  c.Height = 1;
  c.Depth = 1;
  return c;
}

// The memory type of a unified address: device if the driver knows it as device memory.
CUmemorytype unifiedType(uintptr_t p) {
  Allocation a;
  if (registryFind(p, &a) && a.kind != MemKind::kHostPinned && a.kind != MemKind::kHostRegistered)
    return CU_MEMORYTYPE_DEVICE;
  return CU_MEMORYTYPE_HOST;
}

// Validates at once (so bad arguments fail the call, as in CUDA), then queues the copy; the
// synchronous forms (wait = true) return when it is done.
CUresult enqueueCopy(CUstream hs, const CUDA_MEMCPY3D& c, bool wait) {
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  CU_TRY(copy3D(c, false));
  Op op;
  op.type = Op::kMemcpy;
  op.copy = c;
  op.run = [c] { return copy3D(c); };
  return wait ? submitAndWait(s, std::move(op)) : submit(s, std::move(op));
}

CUresult enqueueMemset(CUstream hs, CUdeviceptr dst, size_t pitch, unsigned value, unsigned es, size_t w, size_t h,
                       bool wait) {
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  CUDA_MEMSET_NODE_PARAMS m = {};
  m.dst = dst;
  m.pitch = pitch;
  m.value = value;
  m.elementSize = es;
  m.width = w;
  m.height = h;
  Op op;
  op.type = Op::kMemset;
  op.memset = m;
  // Checked now, except the destination while the stream captures: the real driver records a
  // memset node without looking the address up (cuDNN 9.28 captures one at 0x80 and discards the
  // graph; ONNX Runtime's first convolution failed on the error), so simgpu checks it when the
  // node runs. [unverified: perf/gpu_check.sh asks the real driver]
  CU_TRY(setMemory(m, false, s->captureStatus != CU_STREAM_CAPTURE_STATUS_ACTIVE));
  op.run = [m] { return setMemory(m); };
  return wait ? submitAndWait(s, std::move(op)) : submit(s, std::move(op));
}

CUDA_MEMCPY3D from2D(const CUDA_MEMCPY2D& p) {
  CUDA_MEMCPY3D c = {};
  c.srcXInBytes = p.srcXInBytes;
  c.srcY = p.srcY;
  c.srcMemoryType = p.srcMemoryType;
  c.srcHost = p.srcHost;
  c.srcDevice = p.srcDevice;
  c.srcArray = p.srcArray;
  c.srcPitch = p.srcPitch;
  c.dstXInBytes = p.dstXInBytes;
  c.dstY = p.dstY;
  c.dstMemoryType = p.dstMemoryType;
  c.dstHost = p.dstHost;
  c.dstDevice = p.dstDevice;
  c.dstArray = p.dstArray;
  c.dstPitch = p.dstPitch;
  c.WidthInBytes = p.WidthInBytes;
  c.Height = p.Height;
  c.Depth = 1;
  return c;
}

CUDA_MEMCPY3D fromPeer(const CUDA_MEMCPY3D_PEER& p) {
  CUDA_MEMCPY3D c = {};
  c.srcXInBytes = p.srcXInBytes;
  c.srcY = p.srcY;
  c.srcZ = p.srcZ;
  c.srcLOD = p.srcLOD;
  c.srcMemoryType = p.srcMemoryType;
  c.srcHost = p.srcHost;
  c.srcDevice = p.srcDevice;
  c.srcArray = p.srcArray;
  c.srcPitch = p.srcPitch;
  c.srcHeight = p.srcHeight;
  c.dstXInBytes = p.dstXInBytes;
  c.dstY = p.dstY;
  c.dstZ = p.dstZ;
  c.dstLOD = p.dstLOD;
  c.dstMemoryType = p.dstMemoryType;
  c.dstHost = p.dstHost;
  c.dstDevice = p.dstDevice;
  c.dstArray = p.dstArray;
  c.dstPitch = p.dstPitch;
  c.dstHeight = p.dstHeight;
  c.WidthInBytes = p.WidthInBytes;
  c.Height = p.Height;
  c.Depth = p.Depth;
  return c;
}

// Unified-memory kinds resolve to host or device per address.
CUDA_MEMCPY3D resolveUnified(CUDA_MEMCPY3D c) {
  if (c.srcMemoryType == CU_MEMORYTYPE_UNIFIED) {
    c.srcMemoryType = unifiedType(c.srcDevice);
    if (c.srcMemoryType == CU_MEMORYTYPE_HOST) c.srcHost = reinterpret_cast<const void*>(c.srcDevice);
  }
  if (c.dstMemoryType == CU_MEMORYTYPE_UNIFIED) {
    c.dstMemoryType = unifiedType(c.dstDevice);
    if (c.dstMemoryType == CU_MEMORYTYPE_HOST) c.dstHost = reinterpret_cast<void*>(c.dstDevice);
  }
  return c;
}

constexpr CUstream kLegacyOrPerThread = nullptr;  // stream 0: resolved per the calling entry point

}  // namespace

#define H CU_MEMORYTYPE_HOST
#define D CU_MEMORYTYPE_DEVICE
#define U CU_MEMORYTYPE_UNIFIED

CU_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  API_ENTER(dst, src, n);
  return enqueueCopy(kLegacyOrPerThread, resolveUnified(linear(U, nullptr, src, U, nullptr, dst, n)), true);
}
CU_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  API_ENTER(dst, src, n, s);
  return enqueueCopy(s, resolveUnified(linear(U, nullptr, src, U, nullptr, dst, n)), false);
}
CU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  API_ENTER(dst, src, n);
  return enqueueCopy(kLegacyOrPerThread, linear(H, src, 0, D, nullptr, dst, n), true);
}
CU_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  API_ENTER(dst, src, n, s);
  return enqueueCopy(s, linear(H, src, 0, D, nullptr, dst, n), false);
}
CU_EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  API_ENTER(dst, src, n);
  return enqueueCopy(kLegacyOrPerThread, linear(D, nullptr, src, H, dst, 0, n), true);
}
CU_EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
  API_ENTER(dst, src, n, s);
  return enqueueCopy(s, linear(D, nullptr, src, H, dst, 0, n), false);
}
CU_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  API_ENTER(dst, src, n);
  return enqueueCopy(kLegacyOrPerThread, linear(D, nullptr, src, D, nullptr, dst, n), true);
}
CU_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  API_ENTER(dst, src, n, s);
  return enqueueCopy(s, linear(D, nullptr, src, D, nullptr, dst, n), false);
}
CU_EXPORT CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n) {
  API_ENTER(dst, dc, src, sc, n);
  if (!handleIs(dc, HandleType::kContext) || !handleIs(sc, HandleType::kContext)) return CUDA_ERROR_INVALID_CONTEXT;
  return enqueueCopy(kLegacyOrPerThread, linear(D, nullptr, src, D, nullptr, dst, n), true);
}
CU_EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s) {
  API_ENTER(dst, dc, src, sc, n, s);
  if (!handleIs(dc, HandleType::kContext) || !handleIs(sc, HandleType::kContext)) return CUDA_ERROR_INVALID_CONTEXT;
  return enqueueCopy(s, linear(D, nullptr, src, D, nullptr, dst, n), false);
}

// ---- arrays ----
namespace {
CUDA_MEMCPY3D arrayCopy(CUmemorytype st, const void* sh, CUdeviceptr sd, CUarray sa, size_t sx, CUmemorytype dt,
                        void* dh, CUdeviceptr dd, CUarray da, size_t dx, size_t n) {
  CUDA_MEMCPY3D c = linear(st, sh, sd, dt, dh, dd, n);
  c.srcArray = sa;
  c.srcXInBytes = sx;
  c.dstArray = da;
  c.dstXInBytes = dx;
  return c;
}
}  // namespace
#define A CU_MEMORYTYPE_ARRAY
CU_EXPORT CUresult cuMemcpyDtoA_v2(CUarray dst, size_t off, CUdeviceptr src, size_t n) {
  API_ENTER(dst, off, src, n);
  return enqueueCopy(kLegacyOrPerThread, arrayCopy(D, nullptr, src, nullptr, 0, A, nullptr, 0, dst, off, n), true);
}
CU_EXPORT CUresult cuMemcpyAtoD_v2(CUdeviceptr dst, CUarray src, size_t off, size_t n) {
  API_ENTER(dst, src, off, n);
  return enqueueCopy(kLegacyOrPerThread, arrayCopy(A, nullptr, 0, src, off, D, nullptr, dst, nullptr, 0, n), true);
}
CU_EXPORT CUresult cuMemcpyHtoA_v2(CUarray dst, size_t off, const void* src, size_t n) {
  API_ENTER(dst, off, src, n);
  return enqueueCopy(kLegacyOrPerThread, arrayCopy(H, src, 0, nullptr, 0, A, nullptr, 0, dst, off, n), true);
}
CU_EXPORT CUresult cuMemcpyHtoAAsync_v2(CUarray dst, size_t off, const void* src, size_t n, CUstream s) {
  API_ENTER(dst, off, src, n, s);
  return enqueueCopy(s, arrayCopy(H, src, 0, nullptr, 0, A, nullptr, 0, dst, off, n), false);
}
CU_EXPORT CUresult cuMemcpyAtoH_v2(void* dst, CUarray src, size_t off, size_t n) {
  API_ENTER(dst, src, off, n);
  return enqueueCopy(kLegacyOrPerThread, arrayCopy(A, nullptr, 0, src, off, H, dst, 0, nullptr, 0, n), true);
}
CU_EXPORT CUresult cuMemcpyAtoHAsync_v2(void* dst, CUarray src, size_t off, size_t n, CUstream s) {
  API_ENTER(dst, src, off, n, s);
  return enqueueCopy(s, arrayCopy(A, nullptr, 0, src, off, H, dst, 0, nullptr, 0, n), false);
}
CU_EXPORT CUresult cuMemcpyAtoA_v2(CUarray dst, size_t doff, CUarray src, size_t soff, size_t n) {
  API_ENTER(dst, doff, src, soff, n);
  return enqueueCopy(kLegacyOrPerThread, arrayCopy(A, nullptr, 0, src, soff, A, nullptr, 0, dst, doff, n), true);
}

// ---- 2D / 3D ----
CU_EXPORT CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D* p) {
  API_ENTER(p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(kLegacyOrPerThread, resolveUnified(from2D(*p)), true);
}
CU_EXPORT CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D* p) {
  API_ENTER(p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(kLegacyOrPerThread, resolveUnified(from2D(*p)), true);
}
CU_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* p, CUstream s) {
  API_ENTER(p, s);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(s, resolveUnified(from2D(*p)), false);
}
CU_EXPORT CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D* p) {
  API_ENTER(p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(kLegacyOrPerThread, resolveUnified(*p), true);
}
CU_EXPORT CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D* p, CUstream s) {
  API_ENTER(p, s);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(s, resolveUnified(*p), false);
}
CU_EXPORT CUresult cuMemcpy3DPeer(const CUDA_MEMCPY3D_PEER* p) {
  API_ENTER(p);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(kLegacyOrPerThread, resolveUnified(fromPeer(*p)), true);
}
CU_EXPORT CUresult cuMemcpy3DPeerAsync(const CUDA_MEMCPY3D_PEER* p, CUstream s) {
  API_ENTER(p, s);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  return enqueueCopy(s, resolveUnified(fromPeer(*p)), false);
}

// ---- memset ----
CU_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
  API_ENTER(d, v, n);
  return enqueueMemset(kLegacyOrPerThread, d, 0, v, 1, n, 1, true);
}
CU_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) {
  API_ENTER(d, v, n);
  if (d % 2) return CUDA_ERROR_INVALID_VALUE;
  return enqueueMemset(kLegacyOrPerThread, d, 0, v, 2, n, 1, true);
}
CU_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) {
  API_ENTER(d, v, n);
  if (d % 4) return CUDA_ERROR_INVALID_VALUE;
  return enqueueMemset(kLegacyOrPerThread, d, 0, v, 4, n, 1, true);
}
CU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
  API_ENTER(d, v, n, s);
  return enqueueMemset(s, d, 0, v, 1, n, 1, false);
}
CU_EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) {
  API_ENTER(d, v, n, s);
  if (d % 2) return CUDA_ERROR_INVALID_VALUE;
  return enqueueMemset(s, d, 0, v, 2, n, 1, false);
}
CU_EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) {
  API_ENTER(d, v, n, s);
  if (d % 4) return CUDA_ERROR_INVALID_VALUE;
  return enqueueMemset(s, d, 0, v, 4, n, 1, false);
}
CU_EXPORT CUresult cuMemsetD2D8_v2(CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h) {
  API_ENTER(d, pitch, v, w, h);
  return enqueueMemset(kLegacyOrPerThread, d, pitch, v, 1, w, h, true);
}
CU_EXPORT CUresult cuMemsetD2D16_v2(CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h) {
  API_ENTER(d, pitch, v, w, h);
  return enqueueMemset(kLegacyOrPerThread, d, pitch, v, 2, w, h, true);
}
CU_EXPORT CUresult cuMemsetD2D32_v2(CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h) {
  API_ENTER(d, pitch, v, w, h);
  return enqueueMemset(kLegacyOrPerThread, d, pitch, v, 4, w, h, true);
}
CU_EXPORT CUresult cuMemsetD2D8Async(CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h, CUstream s) {
  API_ENTER(d, pitch, v, w, h, s);
  return enqueueMemset(s, d, pitch, v, 1, w, h, false);
}
CU_EXPORT CUresult cuMemsetD2D16Async(CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h, CUstream s) {
  API_ENTER(d, pitch, v, w, h, s);
  return enqueueMemset(s, d, pitch, v, 2, w, h, false);
}
CU_EXPORT CUresult cuMemsetD2D32Async(CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h, CUstream s) {
  API_ENTER(d, pitch, v, w, h, s);
  return enqueueMemset(s, d, pitch, v, 4, w, h, false);
}
