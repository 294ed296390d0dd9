// The devices of this host, read through NVML (libnvidia-ml.so.1, loaded at run time so the broker
// builds without the driver; on a test host simgpu's NVML answers).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "config/config.h"

namespace cushare::broker {

// Every device NVML lists, in NVML's order: ordinal, "GPU-<hex>" UUID, total memory. A GPU in MIG
// mode (its current mode) is listed as its MIG devices instead, in NVML's MIG device order: "MIG-"
// UUID, its GPU instance's memory, profile, GI and CI IDs, and the memory group shared by the
// compute instances of one GPU instance; a GPU in MIG mode without MIG devices adds nothing and is
// named in *migWithoutDevices. False with one line in *err when NVML cannot be loaded or answers an
// error.
bool listDevices(std::vector<DeviceInfo>* out, std::string* err, std::vector<std::string>* migWithoutDevices = nullptr);

// What each process holds on each device, as the driver counts it: NVML's per-process used memory
// (compute processes, and MPS clients), indexed like listDevices' devices, host pid -> bytes. NVML
// is loaded and started once and kept for the broker's lifetime. False with one line in *err when
// it cannot be loaded or answers an error. A process whose usage NVML does not report
// (NVML_VALUE_NOT_AVAILABLE) is left out.
// With deviceUsed: also each device's used memory as a whole (nvmlDeviceGetMemoryInfo), read
// before and after its process lists: the smaller of the two (a change between the reads never
// makes memory appear that no process holds), and in deviceUsedHigh the larger (never makes it
// disappear).
// A MIG device's used memory is its GPU instance's less what the processes of the other compute
// instances of that GPU instance hold (listed beside it with the same memory group); memory no
// process holds is counted on the group's first device only.
// With unread: a MIG device that cannot be read (gone, or another compute instance at its index
// after a layout change) gets its reason there and empty figures; the others are read.
bool processMemory(const std::vector<DeviceInfo>& devices, std::vector<std::map<int, uint64_t>>* out, std::string* err,
                   std::vector<uint64_t>* deviceUsed = nullptr, std::vector<uint64_t>* deviceUsedHigh = nullptr,
                   std::vector<std::string>* unread = nullptr);

// The device's own count of each process's busy time, for checking what tenants meter
// (compute.cpp): NVML's per-process utilization samples (nvmlDeviceGetProcessUtilization), each
// the percent of its sampling period during which a kernel of the process ran, turned into
// nanoseconds. read() gives what the samples newer than the previous read() add up to, per device
// (listDevices' order), host pid -> ns (a device that cannot answer adds nothing and leaves the
// others read; *err says why). A process's first sample only starts its count (its period's
// start is unknown), and a period is taken as at most kMaxSamplePeriodUs (a guess: the driver's
// sampling period, [unverified]). MIG devices add nothing (NVML has no utilization there). False
// with one line in *err when NVML cannot answer at all.
class ProcessBusyReader {
 public:
  static constexpr uint64_t kMaxSamplePeriodUs = 200'000;
  static constexpr uint64_t kForgetAfterUs = 30'000'000;
  bool read(const std::vector<DeviceInfo>& devices, std::vector<std::map<int, uint64_t>>* out, std::string* err);

 private:
  std::vector<unsigned long long> lastSeenUs_;          // per device: the newest sample's timestamp
  std::vector<std::map<int, uint64_t>> lastSampleUs_;   // per device: each pid's newest sample
};

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" or "MIG-..." (dashes optional, any case) to its 16
// bytes.
bool parseGpuUuid(const std::string& text, uint8_t out[16]);

}  // namespace cushare::broker
