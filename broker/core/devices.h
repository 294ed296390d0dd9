// The devices of this host, read through NVML (libnvidia-ml.so.1, loaded at run time so the broker
// builds without the driver; on a test host simgpu's NVML answers).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace cushare::broker {

// Every device NVML lists, in NVML's order: ordinal, "GPU-<hex>" UUID, total memory. False with
// one line in *err when NVML cannot be loaded or answers an error.
bool listDevices(std::vector<DeviceInfo>* out, std::string* err);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (dashes optional, any case) to its 16 bytes.
bool parseGpuUuid(const std::string& text, uint8_t out[16]);

}  // namespace cushare::broker
