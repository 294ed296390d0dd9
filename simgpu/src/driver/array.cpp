// CUDA arrays (1D, 2D, 3D, layered) and mipmapped arrays. Texels are stored row-major in host
// memory with rows padded to the device's texture pitch alignment. Each array is counted against
// its device at what a real device reserves for it in block-linear (tiled) layout (tiledBytes:
// rows padded to 64-byte GOBs, heights to blocks of GOBs, depths to blocks of slices, the whole to
// the array alignment), which is also what cuArrayGetMemoryRequirements and
// cuMipmappedArrayGetMemoryRequirements report for deferred-mapping arrays (the only ones they
// answer for, as on real drivers). Deferred-mapping and sparse arrays reserve nothing at creation.
// Texture and surface objects over them are not simulated.
#include <algorithm>

#include "driver.h"

namespace simgpu {
namespace {

struct Array {
  CUDA_ARRAY3D_DESCRIPTOR desc = {};
  char* data = nullptr;
  size_t mapped = 0;
  ArrayLayout layout = {};
  int device = 0;
  uint64_t accounted = 0;  // counted against the device: required, or 0 (deferred mapping, sparse)
  uint64_t required = 0;   // what the layout takes on a device
  bool ownedByMipmap = false;
};

struct Mipmapped {
  std::vector<Array*> levels;
  CUDA_ARRAY3D_DESCRIPTOR desc = {};
};

size_t formatBytes(CUarray_format f) {
  switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
    case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X1:
      return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
    case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1:
      return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
      return 4;
    default:
      return 0;
  }
}

uint64_t roundUpTo(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
uint64_t pow2AtLeast(uint64_t v) {
  uint64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

// Block-linear layout (docs/simgpu.md; the GOB is the hardware's, the block-size choice and the
// alignment are simgpu's guesses): a GOB is 64 bytes x 8 rows; a block is 1..16 GOBs high and
// 1..32 slices deep, the smallest power of two that holds the extent; each layer (or cube face)
// is stored whole; the total is rounded up to kArrayAlignment.
constexpr uint64_t kGobWidth = 64, kGobRows = 8, kMaxBlockGobs = 16, kMaxBlockSlices = 32;
constexpr uint64_t kArrayAlignment = 512;

uint64_t tiledBytes(const CUDA_ARRAY3D_DESCRIPTOR& d, size_t elem) {
  const bool layered = d.Flags & CUDA_ARRAY3D_LAYERED;
  const bool cube = d.Flags & CUDA_ARRAY3D_CUBEMAP;
  const uint64_t rows = d.Height ? d.Height : 1;
  const uint64_t depth = layered || !d.Depth ? 1 : d.Depth;
  const uint64_t layers = (layered ? (d.Depth ? d.Depth : 1) : 1) * (cube ? 6 : 1);
  const uint64_t row = roundUpTo(static_cast<uint64_t>(d.Width) * elem * d.NumChannels, kGobWidth);
  const uint64_t gobs = (rows + kGobRows - 1) / kGobRows;
  const uint64_t blockRows = kGobRows * std::min(pow2AtLeast(gobs), kMaxBlockGobs);
  const uint64_t blockSlices = std::min(pow2AtLeast(depth), kMaxBlockSlices);
  const uint64_t image = row * roundUpTo(rows, blockRows) * roundUpTo(depth, blockSlices);
  return roundUpTo(image * layers, kArrayAlignment);
}

CUresult makeArray(const CUDA_ARRAY3D_DESCRIPTOR& d, Array** out) {
  const size_t elem = formatBytes(d.Format);
  if (!elem || (d.NumChannels != 1 && d.NumChannels != 2 && d.NumChannels != 4) || d.Width == 0)
    return CUDA_ERROR_INVALID_VALUE;
  if ((d.Depth && !d.Height && !(d.Flags & CUDA_ARRAY3D_LAYERED))) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  auto* a = new Array;
  a->desc = d;
  a->device = c->device;
  a->layout.widthBytes = d.Width * elem * d.NumChannels;
  a->layout.rowPitch = (a->layout.widthBytes + 511) / 512 * 512;
  a->layout.height = d.Height ? d.Height : 1;
  a->layout.depth = d.Depth ? d.Depth : 1;
  const uint64_t hostBytes = a->layout.rowPitch * a->layout.height * a->layout.depth;
  a->required = tiledBytes(d, elem);
  // Deferred-mapping and sparse arrays get their memory mapped in later (cuMemMapArrayAsync).
  const uint64_t charged = d.Flags & (CUDA_ARRAY3D_DEFERRED_MAPPING | CUDA_ARRAY3D_SPARSE) ? 0 : a->required;
  if (charged && !deviceReserve(c->device, charged)) {
    delete a;
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->accounted = charged;
  a->data = static_cast<char*>(hostMap(hostBytes, &a->mapped));
  if (!a->data) {
    if (charged) deviceRelease(c->device, charged);
    delete a;
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->layout.data = a->data;
  handleAdd(a, HandleType::kArray);
  *out = a;
  return CUDA_SUCCESS;
}

void destroyArray(Array* a) {
  handleRemove(a);
  hostUnmap(a->data, a->mapped);
  if (a->accounted) deviceRelease(a->device, a->accounted);
  delete a;
}

Array* arrayOf(CUarray h) { return handleGet<Array>(h, HandleType::kArray); }

}  // namespace

bool arrayLayout(CUarray h, ArrayLayout* out) {
  Array* a = arrayOf(h);
  if (!a) return false;
  *out = a->layout;
  return true;
}

}  // namespace simgpu

using namespace simgpu;

CU_EXPORT CUresult cuArrayCreate_v2(CUarray* out, const CUDA_ARRAY_DESCRIPTOR* d) {
  API_ENTER(out, d);
  if (!out || !d) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY3D_DESCRIPTOR d3 = {};
  d3.Width = d->Width;
  d3.Height = d->Height;
  d3.Format = d->Format;
  d3.NumChannels = d->NumChannels;
  Array* a;
  CU_TRY(makeArray(d3, &a));
  *out = reinterpret_cast<CUarray>(a);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuArray3DCreate_v2(CUarray* out, const CUDA_ARRAY3D_DESCRIPTOR* d) {
  API_ENTER(out, d);
  if (!out || !d) return CUDA_ERROR_INVALID_VALUE;
  Array* a;
  CU_TRY(makeArray(*d, &a));
  *out = reinterpret_cast<CUarray>(a);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuArrayDestroy(CUarray h) {
  API_ENTER(h);
  Array* a = arrayOf(h);
  if (!a) return CUDA_ERROR_INVALID_HANDLE;
  if (a->ownedByMipmap) return CUDA_ERROR_INVALID_VALUE;
  destroyArray(a);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR* out, CUarray h) {
  API_ENTER(out, h);
  Array* a = arrayOf(h);
  if (!a) return CUDA_ERROR_INVALID_HANDLE;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  out->Width = a->desc.Width;
  out->Height = a->desc.Height;
  out->Format = a->desc.Format;
  out->NumChannels = a->desc.NumChannels;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR* out, CUarray h) {
  API_ENTER(out, h);
  Array* a = arrayOf(h);
  if (!a) return CUDA_ERROR_INVALID_HANDLE;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = a->desc;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray* out, const CUDA_ARRAY3D_DESCRIPTOR* d, unsigned int levels) {
  API_ENTER(out, d, levels);
  if (!out || !d || levels == 0) return CUDA_ERROR_INVALID_VALUE;
  // Levels stop at 1x1x1, as on real devices: more are clamped, not an error.
  size_t largest = std::max({d->Width, d->Height, (d->Flags & CUDA_ARRAY3D_LAYERED) ? size_t{0} : d->Depth});
  unsigned maxLevels = 1;
  while (largest > 1) {
    largest /= 2;
    ++maxLevels;
  }
  levels = std::min(levels, maxLevels);
  auto* m = new Mipmapped;
  m->desc = *d;
  CUDA_ARRAY3D_DESCRIPTOR ld = *d;
  for (unsigned i = 0; i < levels; ++i) {
    Array* a;
    if (CUresult r = makeArray(ld, &a); r != CUDA_SUCCESS) {
      for (Array* x : m->levels) destroyArray(x);
      delete m;
      return r;
    }
    a->ownedByMipmap = true;
    m->levels.push_back(a);
    ld.Width = std::max<size_t>(1, ld.Width / 2);
    if (ld.Height) ld.Height = std::max<size_t>(1, ld.Height / 2);
    if (ld.Depth && !(ld.Flags & CUDA_ARRAY3D_LAYERED)) ld.Depth = std::max<size_t>(1, ld.Depth / 2);
  }
  handleAdd(m, HandleType::kMipmappedArray);
  *out = reinterpret_cast<CUmipmappedArray>(m);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMipmappedArrayGetLevel(CUarray* out, CUmipmappedArray h, unsigned int level) {
  API_ENTER(out, h, level);
  auto* m = handleGet<Mipmapped>(h, HandleType::kMipmappedArray);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  if (!out || level >= m->levels.size()) return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<CUarray>(m->levels[level]);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h) {
  API_ENTER(h);
  auto* m = handleGet<Mipmapped>(h, HandleType::kMipmappedArray);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  handleRemove(m);
  for (Array* a : m->levels) destroyArray(a);
  delete m;
  return CUDA_SUCCESS;
}

namespace {
bool deferred(const CUDA_ARRAY3D_DESCRIPTOR& d) { return d.Flags & CUDA_ARRAY3D_DEFERRED_MAPPING; }
}  // namespace

// Real drivers answer only for arrays made with CUDA_ARRAY3D_DEFERRED_MAPPING (others:
// CUDA_ERROR_INVALID_VALUE); the size is what the same array without the flag is counted at.
CU_EXPORT CUresult cuArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS* req, CUarray h, CUdevice dev) {
  API_ENTER(req, h, dev);
  Array* a = arrayOf(h);
  if (!a) return CUDA_ERROR_INVALID_HANDLE;
  if (!req || !validDevice(dev) || !deferred(a->desc)) return CUDA_ERROR_INVALID_VALUE;
  *req = {};
  req->size = a->required;
  req->alignment = kArrayAlignment;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuMipmappedArrayGetMemoryRequirements(CUDA_ARRAY_MEMORY_REQUIREMENTS* req, CUmipmappedArray h,
                                                         CUdevice dev) {
  API_ENTER(req, h, dev);
  auto* m = handleGet<Mipmapped>(h, HandleType::kMipmappedArray);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  if (!req || !validDevice(dev) || !deferred(m->desc)) return CUDA_ERROR_INVALID_VALUE;
  *req = {};
  for (Array* a : m->levels) req->size += a->required;
  req->alignment = kArrayAlignment;
  return CUDA_SUCCESS;
}

// The first ABIs (32-bit extents), which real drivers still export: the same arrays.
namespace {
struct ArrayDescriptorV1 {
  unsigned int Width, Height;
  CUarray_format Format;
  unsigned int NumChannels;
};
struct Array3DDescriptorV1 {
  unsigned int Width, Height, Depth;
  CUarray_format Format;
  unsigned int NumChannels, Flags;
};
}  // namespace

extern "C" SIMGPU_EXPORT CUresult simgpu_cuArrayCreate_v1(CUarray* out, const ArrayDescriptorV1* d) __asm__("cuArrayCreate");
CUresult simgpu_cuArrayCreate_v1(CUarray* out, const ArrayDescriptorV1* d) {
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY_DESCRIPTOR d2 = {};
  d2.Width = d->Width;
  d2.Height = d->Height;
  d2.Format = d->Format;
  d2.NumChannels = d->NumChannels;
  return cuArrayCreate_v2(out, &d2);
}

extern "C" SIMGPU_EXPORT CUresult simgpu_cuArray3DCreate_v1(CUarray* out, const Array3DDescriptorV1* d) __asm__("cuArray3DCreate");
CUresult simgpu_cuArray3DCreate_v1(CUarray* out, const Array3DDescriptorV1* d) {
  if (!d) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY3D_DESCRIPTOR d3 = {};
  d3.Width = d->Width;
  d3.Height = d->Height;
  d3.Depth = d->Depth;
  d3.Format = d->Format;
  d3.NumChannels = d->NumChannels;
  d3.Flags = d->Flags;
  return cuArray3DCreate_v2(out, &d3);
}
