// simgpu's configuration, read once from the environment (SIMGPU_*). Shared by the driver and the
// NVML library so both describe the same devices.
#pragma once

#include <cstdint>
#include <string>

#include "cost_table.h"
#include "shared_state.h"

namespace simgpu {

struct Config {
  int deviceCount = 1;                 // SIMGPU_DEVICES (1..16)
  uint64_t memory[kMaxDevices] = {};   // SIMGPU_MEMORY: one size for all, or "16GiB,8GiB" per device
  uint32_t smCount = 132;              // SIMGPU_SMS (1..1024)
  std::string name;                    // SIMGPU_NAME
  std::string stateDir;                // SIMGPU_STATE_DIR
  bool trace = false;                  // SIMGPU_TRACE=1
  // Device time (engine.h): SIMGPU_KERNEL_COSTS, SIMGPU_TIME_SCALE, SIMGPU_TIME_SLICE_US,
  // SIMGPU_SWITCH_US.
  CostTable costs;
  std::string costsPath;
  double timeScale = 1.0;              // real ns per device ns (>1 stretches device time)
  uint64_t sliceNs = 2'000'000;        // time slice between contexts (a guess)
  uint64_t switchNs = 25'000;          // context switch cost (a guess)
  uint32_t testSmCap = 0;              // SIMGPU_TEST_SM_CAP: tests only, until MPS sets caps (0: none)
};

// Parses the environment. On invalid input returns false and sets *error to one line naming the
// variable, its value and what is expected.
bool loadConfig(Config* out, std::string* error);

// Stable identity of simulated device `ordinal`: a UUID derived from the ordinal (the same in
// every process and run) and PCI location 0000:<0x18+ordinal>:00.0.
void deviceUuid(int ordinal, unsigned char out[16]);
unsigned devicePciBus(int ordinal);
std::string deviceUuidString(int ordinal);  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
std::string devicePciBusId(int ordinal);    // "00000000:18:00.0"

}  // namespace simgpu
