// The host segment: a small read-only file the broker writes into its ledger directory
// (`<ledger_dir>/host.segment`, mode 0644) for what every tenant process may know about the host.
// Its presence is what tells a shim that a broker owns the directory. Layout and rules:
// docs/ledger-abi.md ("Host segment"); like the ledger it is an ABI, so every offset is asserted.
//
// The broker replaces the file as a whole (write a temporary file, rename over), so a reader sees
// the old or the new contents, never a mix; readers read it once with pread and never map it.
// It holds no tenant names: tenants must not learn about each other from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cushare {

// "CUSHHST\0" as a little-endian u64.
inline constexpr uint64_t kHostMagic = 0x0054534848535543ull;
inline constexpr uint32_t kHostVersion = 2;  // 2: metering and cupti_library
inline constexpr uint32_t kHostMaxDevices = 16;
inline constexpr char kHostSegmentName[] = "host.segment";

// HostSegmentLayout::metering: the busy-time source the broker chose for every tenant process
// (docs/compute.md, "Measuring GPU time"); the values of MeteringSource (shim_config.h).
inline constexpr uint32_t kHostMeteringEvents = 0;
inline constexpr uint32_t kHostMeteringCupti = 1;
inline constexpr uint32_t kHostMeteringAuto = 2;
inline constexpr size_t kHostCuptiPathBytes = 256;

// HostSegmentLayout::unknown_policy
inline constexpr uint32_t kHostRefuseUnknown = 0;
inline constexpr uint32_t kHostProfileForUnknown = 1;

struct HostDeviceLayout {
  uint8_t uuid[16];
  uint64_t capacity;       // bytes of device memory
  uint64_t unknown_limit;  // limit for a tenant given the unknown-tenant profile; UINT64_MAX: none
  uint64_t reserved[2];    // zero
};

struct HostSegmentLayout {
  uint64_t magic;  // kHostMagic
  uint32_t version;
  uint32_t header_size;  // sizeof(HostSegmentLayout)
  uint64_t file_size;    // sizeof(HostSegmentLayout): the file has exactly this size
  uint32_t broker_pid;
  uint32_t device_count;  // <= kHostMaxDevices
  uint64_t config_generation;
  uint32_t unknown_policy;  // kHostRefuseUnknown or kHostProfileForUnknown
  uint32_t reserved0;
  char unknown_profile[64];  // the profile's name when kHostProfileForUnknown, NUL-padded
  HostDeviceLayout devices[kHostMaxDevices];
  uint32_t metering;  // kHostMetering*
  uint32_t reserved1;  // zero
  // The only file a tenant process may load CUPTI from: absolute, NUL-padded; empty: none (events).
  char cupti_library[kHostCuptiPathBytes];
};

static_assert(sizeof(HostDeviceLayout) == 48);
static_assert(offsetof(HostSegmentLayout, broker_pid) == 24);
static_assert(offsetof(HostSegmentLayout, config_generation) == 32);
static_assert(offsetof(HostSegmentLayout, unknown_policy) == 40);
static_assert(offsetof(HostSegmentLayout, unknown_profile) == 48);
static_assert(offsetof(HostSegmentLayout, devices) == 112);
static_assert(offsetof(HostSegmentLayout, metering) == 880);
static_assert(offsetof(HostSegmentLayout, cupti_library) == 888);
static_assert(sizeof(HostSegmentLayout) == 1144);

// The segment as plain data.
struct HostDevice {
  uint8_t uuid[16] = {};
  uint64_t capacity = 0;
  uint64_t unknownLimit = UINT64_MAX;
};

struct HostInfo {
  uint32_t brokerPid = 0;
  uint64_t configGeneration = 0;
  bool profileForUnknown = false;
  std::string unknownProfile;  // when profileForUnknown
  std::vector<HostDevice> devices;
  uint32_t metering = kHostMeteringEvents;
  std::string cuptiLibrary;  // absolute; empty: none
  uint32_t ownerUid = 0;  // read: the file's owner (the broker's user); not stored in the file

  const HostDevice* device(const uint8_t uuid[16]) const;
};

// Reads <dir>/host.segment. Returns 1 with *out filled, 0 when the file does not exist (no broker
// owns the directory), -1 with *err (naming the file and the field) for a file that cannot be
// read or is not a valid segment of this version: fail closed, never guess.
int readHostSegment(const std::string& dir, HostInfo* out, std::string* err);

// Replaces <dir>/host.segment atomically (temporary file + rename), mode 0644.
bool writeHostSegment(const std::string& dir, const HostInfo& info, std::string* err);

}  // namespace cushare
