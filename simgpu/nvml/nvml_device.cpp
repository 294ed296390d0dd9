// simgpu's libnvidia-ml.so.1: device enumeration, handles and static identity (name, UUID, PCI
// location, architecture, modes).
//
// Identities come from config.h's helpers, which the simulated driver uses too, so a UUID or PCI
// bus id read through CUDA finds the same device here. Every value is fixed at the first nvmlInit
// (nvml_internal.h); nothing here allocates.
#include <strings.h>

#include <cctype>
#include <cstring>
#include <string>

#include "nvml_internal.h"

using namespace simgpu::nvml;

namespace {

// Reads hex digits up to the next character that is not one; false if there are none or too many.
bool hexField(const char*& p, unsigned maxDigits, unsigned* out) {
  unsigned v = 0, n = 0;
  while (std::isxdigit(static_cast<unsigned char>(*p))) {
    if (++n > maxDigits) return false;
    const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(*p++)));
    v = v * 16 + static_cast<unsigned>(c <= '9' ? c - '0' : c - 'a' + 10);
  }
  *out = v;
  return n > 0;
}

// Parses "[domain:]bus:device[.function]" in hex, any case: NVML's own 8-digit-domain form, the
// legacy 4-digit form, and what CUDA (cudaDeviceGetPCIBusId) and NCCL print.
bool parseBusId(const char* s, unsigned* domain, unsigned* bus, unsigned* dev, unsigned* fn) {
  unsigned f[3];
  int fields = 0;
  const char* p = s;
  while (true) {
    if (fields == 3 || !hexField(p, 8, &f[fields])) return false;
    ++fields;
    if (*p != ':') break;
    ++p;
  }
  if (fields < 2) return false;
  *fn = 0;
  if (*p == '.') {
    ++p;
    if (!hexField(p, 1, fn)) return false;
  }
  if (*p != '\0') return false;
  *domain = fields == 3 ? f[0] : 0;
  *bus = f[fields - 2];
  *dev = f[fields - 1];
  return true;
}

nvmlReturn_t handleByIndex(unsigned int index, nvmlDevice_t* device) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!device || index >= static_cast<unsigned>(deviceCount())) return NVML_ERROR_INVALID_ARGUMENT;
  *device = simgpu::nvml::device(static_cast<int>(index));
  return NVML_SUCCESS;
}

nvmlReturn_t handleByBusId(const char* busId, nvmlDevice_t* device) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!busId || !device || std::strlen(busId) >= 64) return NVML_ERROR_INVALID_ARGUMENT;
  unsigned domain, bus, dev, fn;
  if (!parseBusId(busId, &domain, &bus, &dev, &fn)) return NVML_ERROR_INVALID_ARGUMENT;
  if (domain != 0 || dev != 0 || fn != 0) return NVML_ERROR_NOT_FOUND;
  for (int d = 0; d < deviceCount(); ++d) {
    if (simgpu::nvml::device(d)->pciBus == bus) {
      *device = simgpu::nvml::device(d);
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t countImpl(unsigned int* deviceCount) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
  *deviceCount = static_cast<unsigned>(simgpu::nvml::deviceCount());
  return NVML_SUCCESS;
}

// The legacy layout's fields are a prefix of v3's up to pciSubSystemId; only the bus id string
// differs in size, and the reserved words are zero.
void fillLegacy(const nvmlDevice_st* d, nvmlPciInfoLegacy_t* pci) {
  std::memset(pci, 0, sizeof *pci);
  std::memcpy(pci->busId, d->busIdLegacy, sizeof pci->busId);
  pci->domain = 0;
  pci->bus = d->pciBus;
  pci->device = 0;
  pci->pciDeviceId = kPciDeviceId;
  pci->pciSubSystemId = kPciSubSystemId;
}

// A query answered with one unsigned value that does not depend on the device.
nvmlReturn_t constant(nvmlDevice_t handle, unsigned int* out, unsigned int value) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!out) return NVML_ERROR_INVALID_ARGUMENT;
  *out = value;
  return NVML_SUCCESS;
}

}  // namespace

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* n) { return countImpl(n); }
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetCount(unsigned int* n) { return countImpl(n); }

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  return handleByIndex(index, device);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t* device) {
  return handleByIndex(index, device);
}

// A GPU's UUID, or a MIG device's: "MIG-<uuid>" or the legacy "MIG-<GPU-UUID>/<GI>/<CI>" (both
// accepted since R470, NVML's change log).
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char* uuid, nvmlDevice_t* device) {
  if (!initialized()) return NVML_ERROR_UNINITIALIZED;
  if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
  for (int d = 0; d < deviceCount(); ++d) {
    if (strcasecmp(simgpu::nvml::device(d)->uuid, uuid) == 0) {
      *device = simgpu::nvml::device(d);
      return NVML_SUCCESS;
    }
  }
  if (strncasecmp(uuid, "MIG-", 4) != 0 || !model()) return NVML_ERROR_NOT_FOUND;
  simgpu::mig::State st;
  std::string err;
  if (!simgpu::mig::load(stateDir(), &st, &err)) return NVML_ERROR_UNKNOWN;
  for (int d = 0; d < deviceCount(); ++d) {
    int host = 0;
    simgpu::mig::MigDevice m;
    if (simgpu::mig::findMigDevice(*model(), st, &simgpu::nvml::device(d)->host, 1, uuid, &host, &m)) {
      *device = migHandle(d, m.index);
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* busId, nvmlDevice_t* device) {
  return handleByBusId(busId, device);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char* busId, nvmlDevice_t* device) {
  return handleByBusId(busId, device);
}

// On a MIG device handle: its MIG index under the parent (what GetMigDeviceHandleByIndex takes).
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t handle, unsigned int* index) {
  nvmlDevice_st* d;
  simgpu::mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!index) return NVML_ERROR_INVALID_ARGUMENT;
  *index = isMig ? m.index : static_cast<unsigned>(d->ordinal);
  return NVML_SUCCESS;
}

// A MIG device is "<board> MIG <profile>", as CUDA and nvidia-smi name it.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t handle, char* name, unsigned int length) {
  nvmlDevice_st* d;
  simgpu::mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!isMig) return copyString(d->name, name, length);
  return copyString(simgpu::mig::migDeviceName(*model(), m).c_str(), name, length);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t handle, char* uuid, unsigned int length) {
  nvmlDevice_st* d;
  simgpu::mig::MigDevice m;
  bool isMig;
  if (nvmlReturn_t r = checkDeviceOrMig(handle, &d, &m, &isMig); r != NVML_SUCCESS) return r;
  if (!isMig) return copyString(d->uuid, uuid, length);
  return copyString(simgpu::mig::migUuid(d->host, m.gi, m.ci).c_str(), uuid, length);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t handle, char* serial, unsigned int length) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  return copyString(d->serial, serial, length);
}

// Unique per device, as on boards that carry one GPU each.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetBoardId(nvmlDevice_t handle, unsigned int* boardId) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!boardId) return NVML_ERROR_INVALID_ARGUMENT;
  *boardId = d->pciBus << 8;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMultiGpuBoard(nvmlDevice_t handle, unsigned int* multiGpuBool) {
  return constant(handle, multiGpuBool, 0);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t handle, nvmlBrandType_t* type) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!type) return NVML_ERROR_INVALID_ARGUMENT;
  *type = NVML_BRAND_NVIDIA;  // what data-center Hopper boards report
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t handle, nvmlDeviceArchitecture_t* arch) {
  return constant(handle, arch, NVML_DEVICE_ARCH_HOPPER);
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t handle, int* major, int* minor) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
  *major = kCcMajor;
  *minor = kCcMinor;
  return NVML_SUCCESS;
}

// The N of /dev/nvidiaN: the host index (simgpu's GPUs enumerate in PCI order), which a container
// keeps for the nodes it is given.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t handle, unsigned int* minorNumber) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
  *minorNumber = static_cast<unsigned>(d->host);
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t handle, nvmlPciInfo_t* pci) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
  std::memset(pci, 0, sizeof *pci);
  std::memcpy(pci->busIdLegacy, d->busIdLegacy, sizeof pci->busIdLegacy);
  pci->domain = 0;
  pci->bus = d->pciBus;
  pci->device = 0;
  pci->pciDeviceId = kPciDeviceId;
  pci->pciSubSystemId = kPciSubSystemId;
  std::memcpy(pci->busId, d->busId, sizeof pci->busId);
  return NVML_SUCCESS;
}

// The legacy entry points write only the 52-byte legacy layout: callers such as NCCL pass a
// struct of that size, and writing v3's 68 bytes would overrun it.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t handle, nvmlPciInfoLegacy_t* pci) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
  fillLegacy(d, pci);
  return NVML_SUCCESS;
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t handle, nvmlPciInfoLegacy_t* pci) {
  return nvmlDeviceGetPciInfo_v2(handle, pci);
}

// An H100 SXM5's host link: PCIe Gen5 x16.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t handle, unsigned int* gen) {
  return constant(handle, gen, 5);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t handle, unsigned int* width) {
  return constant(handle, width, 16);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t handle, unsigned int* gen) {
  return constant(handle, gen, 5);
}
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t handle, unsigned int* width) {
  return constant(handle, width, 16);
}

// Shared by every process: the whole point of simgpu's host-wide state.
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t handle, nvmlComputeMode_t* mode) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
  *mode = NVML_COMPUTEMODE_DEFAULT;
  return NVML_SUCCESS;
}

// Data-center hosts run the persistence daemon; the simulated device is always "loaded".
SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t handle, nvmlEnableState_t* mode) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
  *mode = NVML_FEATURE_ENABLED;
  return NVML_SUCCESS;
}

