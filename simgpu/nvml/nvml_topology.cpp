// simgpu's libnvidia-ml.so.1: topology, peer access, NVLink, field values and fabric queries.
//
// The simulated host is a data-center machine whose GPUs sit on separate PCIe buses under one
// host bridge with no NVLink: peer access over PCIe works between every pair of devices (simgpu's
// device memory is host memory), and every NVLink, fabric and platform query answers the way a
// real GPU without NVLink does (NVML_ERROR_NOT_SUPPORTED, or zero links). NCCL 2.28 asks all of
// these at communicator setup and treats those answers as "PCIe only".
#include <time.h>

#include "nvml_internal.h"

using namespace simgpu::nvml;

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t handle, unsigned int cpuSetSize,
                                                      unsigned long* cpuSet) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (cpuSetSize == 0 || !cpuSet) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;  // no NUMA placement to report for a simulated device
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t h1, nvmlDevice_t h2,
                                                                 nvmlGpuTopologyLevel_t* pathInfo) {
  nvmlDevice_st *a, *b;
  if (nvmlReturn_t r = checkDevice(h1, &a); r != NVML_SUCCESS) return r;
  if (nvmlReturn_t r = checkDevice(h2, &b); r != NVML_SUCCESS) return r;
  if (!pathInfo) return NVML_ERROR_INVALID_ARGUMENT;
  *pathInfo = a == b ? NVML_TOPOLOGY_INTERNAL : NVML_TOPOLOGY_HOSTBRIDGE;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t h1, nvmlDevice_t h2,
                                                    nvmlGpuP2PCapsIndex_t p2pIndex,
                                                    nvmlGpuP2PStatus_t* p2pStatus) {
  nvmlDevice_st *a, *b;
  if (nvmlReturn_t r = checkDevice(h1, &a); r != NVML_SUCCESS) return r;
  if (nvmlReturn_t r = checkDevice(h2, &b); r != NVML_SUCCESS) return r;
  if (!p2pStatus) return NVML_ERROR_INVALID_ARGUMENT;
  switch (p2pIndex) {
    case NVML_P2P_CAPS_INDEX_READ:
    case NVML_P2P_CAPS_INDEX_WRITE:
    case NVML_P2P_CAPS_INDEX_ATOMICS:
    case NVML_P2P_CAPS_INDEX_PCI:
      *p2pStatus = NVML_P2P_STATUS_OK;
      return NVML_SUCCESS;
    case NVML_P2P_CAPS_INDEX_NVLINK:
      *p2pStatus = NVML_P2P_STATUS_NOT_SUPPORTED;
      return NVML_SUCCESS;
    default:
      return NVML_ERROR_INVALID_ARGUMENT;
  }
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t handle, unsigned int, nvmlEnableState_t* isActive) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!isActive) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetNvLinkCapability(nvmlDevice_t handle, unsigned int, nvmlNvLinkCapability_t,
                                                           unsigned int* capResult) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!capResult) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t handle, unsigned int, nvmlPciInfo_t* pci) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t handle, unsigned int,
                                                              nvmlPciInfoLegacy_t* pci) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

// Link counts are answered (zero: no NVLink, no C2C); every other field is NOT_SUPPORTED per
// value, with the call itself succeeding, as NVML does for fields a device lacks.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t handle, int valuesCount, nvmlFieldValue_t* values) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (valuesCount < 0 || (valuesCount > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  const long long now = static_cast<long long>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
  for (int i = 0; i < valuesCount; ++i) {
    nvmlFieldValue_t& v = values[i];
    v.timestamp = now;
    v.latencyUsec = 0;
    v.value.ullVal = 0;
    switch (v.fieldId) {
      case NVML_FI_DEV_NVLINK_LINK_COUNT:
      case NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT:
      case NVML_FI_DEV_C2C_LINK_COUNT:
        v.valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v.value.uiVal = 0;
        v.nvmlReturn = NVML_SUCCESS;
        break;
      default:
        v.valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v.nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        break;
    }
  }
  return NVML_SUCCESS;
}

// No NVLink fabric (NCCL then leaves MNNVL off). NCCL pre-sets state to NOT_SUPPORTED and ignores
// the return code; the struct is left untouched.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t handle, nvmlGpuFabricInfo_t* info) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!info) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t handle, nvmlGpuFabricInfoV_t* info) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!info) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}

// Platform (chassis/tray) information exists on Blackwell rack systems only.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetPlatformInfo(nvmlDevice_t handle, nvmlPlatformInfo_t* info) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!info) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_ERROR_NOT_SUPPORTED;
}
