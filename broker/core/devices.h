// The devices of this host, read through NVML (libnvidia-ml.so.1, loaded at run time so the broker
// builds without the driver; on a test host simgpu's NVML answers).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "config/config.h"

namespace cushare::broker {

// Every device NVML lists, in NVML's order: ordinal, "GPU-<hex>" UUID, total memory. False with
// one line in *err when NVML cannot be loaded or answers an error.
bool listDevices(std::vector<DeviceInfo>* out, std::string* err);

// What each process holds on each device, as the driver counts it: NVML's per-process used memory
// (compute processes, and MPS clients), indexed like listDevices' devices, host pid -> bytes. NVML
// is loaded and started once and kept for the broker's lifetime. False with one line in *err when
// it cannot be loaded or answers an error. A process whose usage NVML does not report
// (NVML_VALUE_NOT_AVAILABLE) is left out.
// With deviceUsed: also each device's used memory as a whole (nvmlDeviceGetMemoryInfo), read
// after its process list.
bool processMemory(size_t devices, std::vector<std::map<int, uint64_t>>* out, std::string* err,
                   std::vector<uint64_t>* deviceUsed = nullptr);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (dashes optional, any case) to its 16 bytes.
bool parseGpuUuid(const std::string& text, uint8_t out[16]);

}  // namespace cushare::broker
