// Device code for the driver tests: compiled by nvcc into kernels.fatbin and kernels.cubin at build
// time (never linked into a program). The tests load the images with cuModuleLoadData; the kernels'
// host bodies (simgpu_host_<mangled name>) live in driver_basics_test.cpp.

__device__ int table[64];  // cuModuleGetGlobal: 256 bytes

// _Z5scalePffi
__global__ void scale(float* p, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] *= a;
}

// _Z7params3Pfid: parameters (float*, int, double) at offsets 0, 8, 16 with sizes 8, 4, 8.
__global__ void params3(float* p, int n, double d) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = static_cast<float>(d) + static_cast<float>(table[i % 64]);
}

// Unmangled name; never given a host body (a launch completes doing nothing).
extern "C" __global__ void nobody(int* p) {
  if (p) *p = 1;
}
