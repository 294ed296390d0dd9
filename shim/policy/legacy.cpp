// The first ABIs of the memory entry points (CUDA 2.x: 32-bit device pointers and sizes), which
// drivers still export and still answer through cuGetProcAddress at an old version. Allocating or
// reading the device's memory through them is refused with CUDA_ERROR_NOT_SUPPORTED: the shim
// counts the current ABIs, and no program built in the last fifteen years calls these. One log
// line per entry point and process says so. (cuMemFree's first ABI is counted, memory.cpp;
// contexts.cpp has the first ABIs of the context calls.)
#include <atomic>

#include "interpose/hooks.h"
#include "runtime/log.h"
#include "runtime/state.h"

namespace cushare::shim {
namespace {

CUresult refuse(std::atomic<bool>& said, const char* symbol) noexcept {
  if (!said.exchange(true, std::memory_order_relaxed))
    logLine(LogLevel::kError,
            "tenant %s: %s (the first, 32-bit ABI) is refused: use the current ABI (%s_v2)",
            state().config.tenant.c_str(), symbol, symbol);
  return CUDA_ERROR_NOT_SUPPORTED;
}

std::atomic<bool> gSaidAlloc, gSaidPitch, gSaidInfo, gSaidTotal, gSaidArray, gSaidArray3D;

}  // namespace

CUresult hook_cuMemAlloc(unsigned int*, unsigned int) noexcept {
  return refuse(gSaidAlloc, "cuMemAlloc");
}
CUresult hook_cuMemAllocPitch(unsigned int*, unsigned int*, unsigned int, unsigned int,
                              unsigned int) noexcept {
  return refuse(gSaidPitch, "cuMemAllocPitch");
}
CUresult hook_cuMemGetInfo(unsigned int*, unsigned int*) noexcept {
  return refuse(gSaidInfo, "cuMemGetInfo");
}
CUresult hook_cuDeviceTotalMem(unsigned int*, CUdevice) noexcept {
  return refuse(gSaidTotal, "cuDeviceTotalMem");
}
CUresult hook_cuArrayCreate(CUarray*, const void*) noexcept {
  return refuse(gSaidArray, "cuArrayCreate");
}
CUresult hook_cuArray3DCreate(CUarray*, const void*) noexcept {
  return refuse(gSaidArray3D, "cuArray3DCreate");
}

}  // namespace cushare::shim
