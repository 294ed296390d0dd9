/* simgpu: host implementations of kernels.
 *
 * simgpu launches every kernel successfully and, by default, runs nothing. A program (or a test)
 * gives a kernel a body by exporting a C function named "simgpu_host_" followed by the kernel's
 * mangled name, e.g. for  __global__ void scale(float*, float, int)  (mangled _Z5scalePffi):
 *
 *     extern "C" void simgpu_host__Z5scalePffi(const simgpu_launch* l) {
 *       float* p = *(float**)l->params[0]; float a = *(float*)l->params[1]; int n = *(int*)l->params[2];
 *       for (int i = 0; i < n; ++i) p[i] *= a;   // device memory is host memory in simgpu
 *     }
 *
 * The executable must export its symbols (link with -rdynamic / CMake ENABLE_EXPORTS). Bodies can
 * also live in shared libraries listed in SIMGPU_KERNELS (colon-separated paths), which simgpu
 * dlopens at cuInit. The body runs when the launch executes on its stream, on the thread that
 * executes the stream's work; launches on one stream run in order.
 * No CUDA header is needed: this file is plain C. */
#ifndef SIMGPU_SIMGPU_H
#define SIMGPU_SIMGPU_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct simgpu_launch {
  const char* name;        /* the kernel's mangled name */
  unsigned grid[3];        /* gridDim x, y, z */
  unsigned block[3];       /* blockDim x, y, z */
  unsigned shared_mem;     /* dynamic shared memory bytes */
  int device;              /* ordinal of the device it runs on */
  void** params;           /* kernelParams as passed to cuLaunchKernel: params[i] points at argument i */
  void** extra;            /* the `extra` array, if the launch used one (else NULL) */
} simgpu_launch;

typedef void (*simgpu_host_kernel)(const simgpu_launch* launch);

#define SIMGPU_HOST_PREFIX "simgpu_host_"

#ifdef __cplusplus
}
#endif
#endif
