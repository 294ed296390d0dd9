// cuGetProcAddress and cuGetExportTable: the roads by which cudart and libraries find entry points.
// The table is generated from the toolkit (tools/gen_driver_table.py); the rule for a request
// (name, version, flags) is the one the real driver follows: among the ABIs of that name, the one
// with the highest first version not above the requested version, the per-thread-stream variant
// when flags ask for it and one exists.
#include <cstring>

#include "driver.h"
#include "export_tables.h"
#include "proc_table.h"

using namespace simgpu;

namespace {

CUresult lookup(const char* symbol, void** pfn, int version, cuuint64_t flags,
                CUdriverProcAddressQueryResult* status) {
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  if (flags & ~static_cast<cuuint64_t>(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                                       CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
    return CUDA_ERROR_INVALID_VALUE;
  const bool perThread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  *pfn = nullptr;
  // Binary search for the first row of this name.
  unsigned lo = 0, hi = simgpu_proc_table_size;
  while (lo < hi) {
    const unsigned mid = (lo + hi) / 2;
    if (std::strcmp(simgpu_proc_table[mid].name, symbol) < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  const simgpu_proc_entry* best = nullptr;
  const simgpu_proc_entry* bestPt = nullptr;
  bool known = false;
  for (unsigned i = lo; i < simgpu_proc_table_size && std::strcmp(simgpu_proc_table[i].name, symbol) == 0; ++i) {
    known = true;
    const simgpu_proc_entry& e = simgpu_proc_table[i];
    if (e.version > version) continue;
    if (e.per_thread) {
      if (!bestPt || e.version > bestPt->version) bestPt = &e;
    } else if (!best || e.version > best->version) {
      best = &e;
    }
  }
  // A per-thread variant applies only if it is not older than the default ABI chosen.
  if (perThread && bestPt && (!best || bestPt->version >= best->version)) best = bestPt;
  if (!known) {
    if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_SUCCESS;
  }
  if (!best) {
    if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    return CUDA_SUCCESS;
  }
  *pfn = best->fn;
  if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

}  // namespace

CU_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult* symbolStatus) {
  SIMGPU_TRACE(symbol, pfn, cudaVersion, flags, symbolStatus);
  return lookup(symbol, pfn, cudaVersion, flags, symbolStatus);
}

extern "C" SIMGPU_EXPORT CUresult simgpu_cuGetProcAddress_v1(const char* symbol, void** pfn, int cudaVersion,
                                                           cuuint64_t flags) __asm__("cuGetProcAddress");
CUresult simgpu_cuGetProcAddress_v1(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) {
  SIMGPU_TRACE(symbol, pfn, cudaVersion, flags);
  CUdriverProcAddressQueryResult st;
  CUresult r = lookup(symbol, pfn, cudaVersion, flags, &st);
  // The first ABI reports a missing symbol as an error rather than through a status.
  if (r == CUDA_SUCCESS && st != CU_GET_PROC_ADDRESS_SUCCESS) return CUDA_ERROR_NOT_FOUND;
  return r;
}

CU_EXPORT CUresult cuGetExportTable(const void** table, const CUuuid* id) {
  SIMGPU_TRACE(table, id);
  return getExportTable(table, id);
}
