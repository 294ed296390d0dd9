// simgpu's configuration, read once from the environment (SIMGPU_*). Shared by the driver and the
// NVML library so both describe the same devices.
#pragma once

#include <cstdint>
#include <string>

#include "cost_table.h"
#include "shared_state.h"

namespace simgpu {

namespace mig {
struct Model;
}

struct Config {
  int deviceCount = 1;                 // SIMGPU_DEVICES (1..16)
  uint64_t memory[kMaxDevices] = {};   // SIMGPU_MEMORY: one size for all, or "16GiB,8GiB" per device
  uint32_t smCount = 132;              // SIMGPU_SMS (1..1024)
  std::string name;                    // SIMGPU_NAME
  // SIMGPU_GPU_MODEL (mig.h): a known board (name, memory, SMs, MIG profiles); null: a generic
  // board sized by SIMGPU_MEMORY and SIMGPU_SMS, without MIG.
  const mig::Model* model = nullptr;
  std::string stateDir;                // SIMGPU_STATE_DIR
  bool trace = false;                  // SIMGPU_TRACE=1
  // SIMGPU_CONTAINER_DEVICES: the host devices a container runtime gave this process, as host
  // indices in host (PCI bus) order; every host device when unset. The driver and NVML see only
  // these, numbered from 0; identities (UUID, PCI bus id) and the shared state stay the host's.
  int containerCount = 0;
  int container[kMaxDevices] = {};
  // Device time (engine.h): SIMGPU_KERNEL_COSTS, SIMGPU_TIME_SCALE, SIMGPU_TIME_SLICE_US,
  // SIMGPU_SWITCH_US.
  CostTable costs;
  std::string costsPath;
  double timeScale = 1.0;              // real ns per device ns (>1 stretches device time)
  uint64_t sliceNs = 2'000'000;        // time slice between contexts (a guess)
  uint64_t switchNs = 25'000;          // context switch cost (a guess)
  // Device time a kernel waits for each 2 MiB chunk of managed memory its launch populates (a
  // page-fault migration, about 10 GB/s over the bus: a guess, docs/simgpu.md; perf/gpu_check.sh
  // step 10 measures it).
  uint64_t faultChunkNs = 200'000;
  uint32_t testSmCap = 0;              // SIMGPU_TEST_SM_CAP: tests only, until MPS sets caps (0: none)
};

// Parses the environment. On invalid input returns false and sets *error to one line naming the
// variable, its value and what is expected.
bool loadConfig(Config* out, std::string* error);

// The devices the driver enumerates, as host indices in its order: the container's devices in
// CUDA_DEVICE_ORDER order (simgpu's devices are equally fast, so FASTEST_FIRST and PCI_BUS_ID
// both give host order), then narrowed and reordered by CUDA_VISIBLE_DEVICES (`visible`; null when
// unset) with the real driver's rules (docs/simgpu.md, "Device visibility"): indices or GPU UUID
// prefixes, the list ending at the first invalid, unknown or ambiguous entry, a repeated device
// leaving no device at all. Returns the number written to out; never fails (as the real driver,
// an unusable value hides devices rather than refusing to start).
int visibleDevices(const Config& c, const char* visible, int out[kMaxDevices]);

// Stable identity of simulated device `ordinal`: a UUID derived from the ordinal (the same in
// every process and run) and PCI location 0000:<0x18+ordinal>:00.0.
void deviceUuid(int ordinal, unsigned char out[16]);
unsigned devicePciBus(int ordinal);
std::string deviceUuidString(int ordinal);  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
std::string devicePciBusId(int ordinal);    // "00000000:18:00.0"

}  // namespace simgpu
