// Internals shared by the files of simgpu's libnvidia-ml.so.1.
//
// Invariants:
// - The library state (configuration, shared-state mapping, per-device records) is built once,
//   by the first nvmlInit that succeeds, and never changes or is freed afterwards: it is leaked on
//   purpose, so no static destructor can pull it from under a late caller at exit, and readers
//   need no lock once they have seen the reference count above zero (acquire load).
// - Device handles are pointers into the leaked device array; a handle is valid only if it points
//   exactly at one of its first deviceCount elements.
// - No exported function lets an exception escape: the entry points that allocate catch.
#pragma once

#define NVML_NO_UNVERSIONED_FUNC_DEFS  // we define the legacy names too, under their own names
#include "simgpu/nvml.h"

#include <cstdint>

#include <string>

#include "mig.h"
#include "shared_state.h"
#include "timeslice_board.h"

// Every NVML entry point: C linkage and default visibility (the target builds hidden by default).
#define SIMGPU_NVML_API extern "C" __attribute__((visibility("default")))

struct nvmlDevice_st {
  int ordinal;  // NVML's index: the position among the devices this process (container) sees
  int host;     // the host device behind it: identity, /dev/nvidiaN, the shared state's index
  unsigned pciBus;
  char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
  char uuid[NVML_DEVICE_UUID_BUFFER_SIZE];
  char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE];
  char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];            // "00000000:18:00.0"
  char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];   // "0000:18:00.0"
  simgpu::Board* board;  // the device's time-slice board: what the engines ran (null if unavailable)
  double timeScale;      // SIMGPU_TIME_SCALE: device time = CLOCK_MONOTONIC / timeScale
  // A MIG device handle (nvml_mig.cpp): the parent's ordinal, else -1; migIndex is its MIG index
  // under the parent. Its other fields are the parent's.
  int migParent = -1;
  unsigned migIndex = 0;
};

namespace simgpu::nvml {

// What simgpu reports for every device: an H100 SXM5 80GB-class board.
inline constexpr unsigned kPciDeviceId = 0x233010DEu;  // device 0x2330, vendor 0x10DE (NVIDIA)
inline constexpr unsigned kPciSubSystemId = 0x16C110DEu;
inline constexpr int kCcMajor = 9;
inline constexpr int kCcMinor = 0;
inline constexpr int kCudaDriverVersion = 13000;
inline constexpr const char* kDriverVersion = "580.65.06";
inline constexpr const char* kNvmlVersion = "13.580.65.06";

// True while the reference count is above zero.
bool initialized();
int deviceCount();
nvmlDevice_st* device(int ordinal);
SharedState* state();

// Resolves a handle; nullptr if it is not one of ours (a MIG device handle is not: see below).
nvmlDevice_st* fromHandle(nvmlDevice_t handle);

// The usual preamble of a device query: UNINITIALIZED before init, INVALID_ARGUMENT for a handle
// that is not ours. NVML_SUCCESS lets the caller go on with *out set. A MIG device handle is
// refused here: only the queries that answer for MIG devices take one (checkDeviceOrMig).
nvmlReturn_t checkDevice(nvmlDevice_t handle, nvmlDevice_st** out);

// MIG (nvml_mig.cpp). The model (null: a board without MIG) and the state directory.
const simgpu::mig::Model* model();
const std::string& stateDir();
// The MIG device handles of parent ordinal p (kMaxMigDevices of them, leaked like the devices).
nvmlDevice_st* migHandle(int parent, unsigned index);
nvmlDevice_st* fromMigHandle(nvmlDevice_t handle);  // nullptr if not a MIG device handle of ours
// The MIG mode of host device `host` now (disabled on a board without MIG); false when the MIG
// state cannot be read. migEnabled: whether it is on (utilisation is then NOT_SUPPORTED).
bool migMode(int host, unsigned* current, unsigned* pending);
bool migEnabled(int host);
// A device or a live MIG device handle; for a MIG handle *mig describes it now (a handle whose
// MIG device was destroyed is INVALID_ARGUMENT).
nvmlReturn_t checkDeviceOrMig(nvmlDevice_t handle, nvmlDevice_st** out, simgpu::mig::MigDevice* mig, bool* isMig);

// Copies a NUL-terminated string into a caller's buffer as NVML does: INVALID_ARGUMENT for a null
// buffer, INSUFFICIENT_SIZE (buffer untouched) when length cannot hold the string and its NUL.
nvmlReturn_t copyString(const char* src, char* dst, unsigned int length);

}  // namespace simgpu::nvml
