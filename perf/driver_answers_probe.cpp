// What the driver answers where simgpu's answer is a classification, not a measurement
// (simgpu/driver_api_cuda13.txt, docs/simgpu.md "Every entry point classified"): one line per
// fact, `name: result`, the same on simgpu and on a real driver, so perf/gpu_check.sh (step 8)
// prints where they differ. Every call is made with arguments that are valid except for the
// point being asked, so a real driver answers rather than crashes.
//   usage: driver_answers_probe
#include <cuda.h>
#include <cudaProfiler.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>

namespace {

void* drv = nullptr;
template <typename F>
F fn(const char* name) {
  return reinterpret_cast<F>(dlsym(drv, name));
}

void line(const char* what, CUresult r) {
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS) name = "?";
  std::printf("%s: %s\n", what, name);
}

int attr(CUdevice_attribute a) {
  int v = -1;
  if (cuDeviceGetAttribute(&v, a, 0) != CUDA_SUCCESS) return -1;
  return v;
}

}  // namespace

int main() {
  drv = dlopen("libcuda.so.1", RTLD_NOW);
  if (!drv || cuInit(0) != CUDA_SUCCESS) {
    std::fprintf(stderr, "driver_answers_probe: no driver\n");
    return 2;
  }
  CUcontext ctx = nullptr;
  if (cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return 2;
  CUstream s = nullptr;
  CUdeviceptr buf = 0;
  if (cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS || cuMemAlloc(&buf, 1 << 20) != CUDA_SUCCESS) return 2;

  // A memset captured at an address nothing allocated (cuDNN 9.28 does this under ONNX Runtime):
  // simgpu records it and checks the address when the node runs.
  if (cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) == CUDA_SUCCESS) {
    line("capture_memset_unallocated", cuMemsetD8Async(0x80, 0, 0x4000, s));
    CUgraph g = nullptr;
    line("capture_memset_unallocated_end", cuStreamEndCapture(s, &g));
    if (g) cuGraphDestroy(g);
  }
  // Outside capture, the same memset.
  line("memset_unallocated", cuMemsetD8Async(0x80, 0, 0x4000, s));
  cuStreamSynchronize(s);

  // Profiler control with no profiler attached.
  line("profiler_start", cuProfilerStart());
  line("profiler_stop", cuProfilerStop());
  if (auto init = fn<CUresult (*)(const char*, const char*, CUoutput_mode)>("cuProfilerInitialize"))
    line("profiler_initialize", init("/nonexistent.cfg", "/tmp/cushare-probe-profile.out", CU_OUT_KEY_VALUE_PAIR));

  // Stream memory operations: v2 always, v1 only where the device says so.
  std::printf("attr_can_use_stream_mem_ops_v1: %d\n", attr(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1));
  std::printf("attr_can_use_64_bit_stream_mem_ops: %d\n", attr(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS));
  std::printf("attr_can_flush_remote_writes: %d\n", attr(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES));
  line("write_value32_v2", cuStreamWriteValue32(s, buf, 1, 0));
  line("wait_value32_v2", cuStreamWaitValue32(s, buf, 1, CU_STREAM_WAIT_VALUE_GEQ));
  line("write_value32_v2_no_barrier_flag", cuStreamWriteValue32(s, buf, 1, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER));
  line("write_value32_v2_misaligned", cuStreamWriteValue32(s, buf + 1, 1, 0));
  if (auto v1 = fn<CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned)>("cuStreamWriteValue32"))
    line("write_value32_v1", v1(s, buf, 1, 0));
  cuStreamSynchronize(s);

  // Features the simulated device does not have: the attribute, then the answer.
  std::printf("attr_multicast_supported: %d\n", attr(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED));
  CUmulticastObjectProp mc = {};
  mc.numDevices = 1;
  mc.size = 2 << 20;
  mc.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  line("multicast_granularity", cuMulticastGetGranularity(&gran, &mc, CU_MULTICAST_GRANULARITY_MINIMUM));
  std::printf("attr_sparse_cuda_array_supported: %d\n", attr(CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED));
  CUDA_ARRAY_DESCRIPTOR ad = {};
  ad.Width = 64;
  ad.Height = 64;
  ad.Format = CU_AD_FORMAT_FLOAT;
  ad.NumChannels = 1;
  CUarray arr = nullptr;
  if (cuArrayCreate(&arr, &ad) == CUDA_SUCCESS) {
    CUDA_ARRAY_SPARSE_PROPERTIES sp = {};
    line("array_sparse_properties_dense_array", cuArrayGetSparseProperties(&sp, arr));
    cuArrayDestroy(arr);
  }
  std::printf("attr_cooperative_multi_device_launch: %d\n", attr(CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH));
  std::printf("attr_mem_decompress_algorithm_mask: %d\n", attr(CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_ALGORITHM_MASK));
  line("graphics_unregister_null", cuGraphicsUnregisterResource(nullptr));

  // A CUDA 2.x ABI (32-bit sizes), as an old binary would call it.
  if (auto v1 = fn<CUresult (*)(unsigned*, unsigned*)>("cuMemGetInfo")) {
    unsigned f = 0, t = 0;
    line("mem_get_info_v1", v1(&f, &t));
  }
  cuMemFree(buf);
  cuStreamDestroy(s);
  cuDevicePrimaryCtxRelease(0);
  return 0;
}
