// MIG (Multi-Instance GPU) as the real driver presents it, for simulated boards of a known model
// (SIMGPU_GPU_MODEL): the profile tables, placements, GPU and compute instance IDs, and the
// host-wide MIG state every process sees (docs/simgpu.md, "MIG").
//
// Invariants:
// - The tables are data from NVIDIA's documentation and published `nvidia-smi mig -lgip/-lgipp`
//   outputs (docs/simgpu.md names what is a guess); each profile's memory is chosen so that the
//   profile name NVIDIA's tools derive from NVML's numbers (go-nvlib's rule) is the documented one.
// - The MIG state lives in one file of the state directory (<dir>/mig), fixed size and versioned;
//   every change is made under an exclusive flock and written whole, every read takes a shared
//   flock, so no process sees half a change. A file of another version or size is refused.
// - An operation that fails changes nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shared_state.h"

namespace simgpu::mig {

inline constexpr int kMemorySlices = 8;
inline constexpr int kComputeSlices = 7;
inline constexpr int kMaxGpuInstances = 15;     // GI IDs 0..14 (the mig-minors table's range)
inline constexpr int kMaxComputeInstances = 8;  // CI IDs 0..7 per GI
inline constexpr int kMaxMigDevices = 7;        // compute instances per GPU at most

struct GiProfile {
  unsigned index;     // NVML_GPU_INSTANCE_PROFILE_* (what nvmlDeviceGetGpuInstanceProfileInfo takes)
  unsigned id;        // the profile ID (nvidia-smi's ID column; what create and list take)
  const char* name;   // "1g.10gb", "1g.10gb+me"
  unsigned slices;    // compute slices
  unsigned memSlices; // memory slices: the placement's size
  unsigned instances; // at most this many at once
  unsigned sms;
  uint64_t memoryMiB;
  unsigned ce, dec, enc, jpeg, ofa;
  std::vector<unsigned> starts;  // possible placements' first memory slice
};

struct Model {
  const char* key;      // SIMGPU_GPU_MODEL value
  const char* name;     // the board's name, as NVML and CUDA give it
  uint64_t memoryMiB;   // the whole GPU's memory
  unsigned sms;         // the whole GPU's SMs (MIG off)
  bool resetless;       // a mode change applies at once when the GPU is idle (Hopper); else at reset
  std::vector<GiProfile> gi;
};

// The models simgpu knows; nullptr for an unknown key. keys(): "a100-40gb, a100-80gb, ...".
const Model* findModel(const std::string& key);
std::string modelKeys();

const GiProfile* giProfileByIndex(const Model& m, unsigned index);
const GiProfile* giProfileById(const Model& m, unsigned id);

// Compute instance profiles inside a GI of `giSlices` compute slices, by NVML index
// (NVML_COMPUTE_INSTANCE_PROFILE_*: 0 1 slice, 1 2, 2 3, 3 4, 4 7); the profile ID is the index.
struct CiProfile {
  unsigned index;
  unsigned slices;
  unsigned instances;
  unsigned sms;
};
bool ciProfile(const GiProfile& gi, unsigned index, CiProfile* out);
// CI placements on the GI's compute-slice axis: multiples of the CI's size that fit.
std::vector<unsigned> ciStarts(const GiProfile& gi, const CiProfile& ci);

// The name NVIDIA's tools give a profile from NVML's numbers (go-nvlib: the memory fraction of
// the GPU rounded up to eighths, times the GPU's memory in GiB rounded up, rounded).
std::string derivedName(unsigned slices, uint64_t memoryMiB, uint64_t gpuMemoryMiB);

// GI ID of a placement: the driver's numbering (a 7g is 0; 4-slice placements 1 (start 4) and 2
// (start 0); 2-slice 3..6; 1-slice 7..14), as the MIG guide's examples show it.
unsigned giIdFor(unsigned start, unsigned memSlices);

// The host-wide MIG state.
struct Ci {
  uint32_t used = 0;
  uint32_t id = 0, profile = 0, start = 0, size = 0;
};
struct Gi {
  uint32_t used = 0;
  uint32_t id = 0, profileId = 0, start = 0, size = 0;
  Ci ci[kMaxComputeInstances];
};
struct DeviceMig {
  uint32_t current = 0, pending = 0;  // NVML_DEVICE_MIG_DISABLE / _ENABLE
  Gi gi[kMaxGpuInstances];            // indexed by GI ID
};
struct State {
  uint64_t magic = 0;
  uint32_t version = 0, size = 0;
  DeviceMig dev[kMaxDevices];
};

// One MIG device (a compute instance with its GPU instance), in the order the driver numbers
// them under their GPU (NVML's MIG index): by GI ID, then CI ID.
struct MigDevice {
  unsigned index;
  unsigned gi, ci;
  const GiProfile* giProfile;
  CiProfile ciProfile;
};
std::vector<MigDevice> migDevices(const Model& m, const DeviceMig& d);
// One number per MIG device of the host: (host + 1) | (GI + 1) << 8 | (CI + 1) << 16 (never 0).
inline uint32_t migTag(int hostDevice, unsigned gi, unsigned ci) {
  return static_cast<uint32_t>(hostDevice + 1) | (gi + 1) << 8 | (ci + 1) << 16;
}
// The time-slice board of a MIG device (timeslice_board.h): each compute instance slices its own
// SMs' time; a whole GPU's board is its host index.
inline int migBoard(int hostDevice, unsigned gi, unsigned ci) {
  return 1000 + hostDevice * 128 + static_cast<int>(gi * 8 + ci);
}
// The first "MIG-..." entry of a CUDA_VISIBLE_DEVICES value (trimmed), "" when none.
std::string firstMigEntry(const char* visible);

// "MIG-xxxxxxxx-xxxx-5xxx-xxxx-xxxxxxxxxxxx", stable for (host device, GI, CI); its 16 bytes
// (what cuDeviceGetUuid_v2 gives inside the MIG device).
std::string migUuid(int hostDevice, unsigned gi, unsigned ci);
void migUuidBytes(int hostDevice, unsigned gi, unsigned ci, unsigned char out[16]);

// The MIG device CUDA_VISIBLE_DEVICES names by `entry` ("MIG-<uuid>" or the legacy
// "MIG-<GPU-UUID>/<GI>/<CI>", any case) among host devices hosts[0..n); false if none.
bool findMigDevice(const Model& m, const State& s, const int* hosts, int n, const std::string& entry, int* host,
                   MigDevice* out);
// A compute instance's profile name: its GPU instance's ("3g.40gb"), or "1c.3g.40gb" for a CI
// smaller than its GI.
std::string profileName(const GiProfile& gp, const CiProfile& cp);
// "<board name> MIG <profile>".
std::string migDeviceName(const Model& m, const MigDevice& d);

// Reads the state (all zero when the file does not exist yet); false with *err.
bool load(const std::string& stateDir, State* out, std::string* err);
// Applies f to the state under an exclusive lock and writes it back when f returns true.
// Returns f's result; false with *err on a system error.
template <typename F>
bool update(const std::string& stateDir, F f, std::string* err);

// Which placement start a create without one takes: the highest free start (the real driver's
// behaviour the MIG guide describes: 1g first at slot 6; 19,19,14,9 fails where 9,19,14,19 works).
// -1: none free.
int defaultStart(const DeviceMig& d, const GiProfile& p);
// Whether a GI of profile p fits at start now (free memory slices, compute slices, instance count).
bool fits(const Model& m, const DeviceMig& d, const GiProfile& p, unsigned start);
// How many more GIs of p could be created now.
unsigned remaining(const Model& m, const DeviceMig& d, const GiProfile& p);
// Records a GPU instance of p at start (which fits) and returns its ID.
unsigned addGi(DeviceMig& d, const GiProfile& p, unsigned start);
// Records a compute instance of cp at start (which fits) under the lowest free CI ID and returns
// it; -1 when no ID is left.
int addCi(Gi& gi, const CiProfile& cp, unsigned start);
// CI side, inside gi.
int defaultCiStart(const Gi& gi, const GiProfile& gp, const CiProfile& cp);
bool ciFits(const Gi& gi, const GiProfile& gp, const CiProfile& cp, unsigned start);
unsigned ciRemaining(const Gi& gi, const GiProfile& gp, const CiProfile& cp);

namespace detail {
bool updateImpl(const std::string& stateDir, bool (*f)(State*, void*), void* ctx, std::string* err);
}

template <typename F>
bool update(const std::string& stateDir, F f, std::string* err) {
  return detail::updateImpl(
      stateDir, [](State* s, void* c) { return (*static_cast<F*>(c))(s); }, &f, err);
}

}  // namespace simgpu::mig
