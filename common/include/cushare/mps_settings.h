// What the broker tells tenant processes about its NVIDIA MPS control daemon (docs/mps.md): two
// small text files it writes into its ledger directory, read by the shim before the driver
// starts, and the client environment the shim derives from them.
//
//   <ledger_dir>/mps.conf       MPS is on: the pipe directory, the context reserve and what an
//                               unknown tenant gets. Absent: MPS is off (the shim sets nothing).
//   <ledger_dir>/<tenant>.mps   that tenant's cap, priority and per-device memory limit.
//
// Invariants:
// - The files are written whole (temporary file + rename, mode 0644), so a reader sees the old or
//   the new contents. A reader accepts only a regular file owned by the ledger directory's owner
//   (the broker) that nobody else may write: a tenant that can create files in the directory
//   (unknown tenants admitted) cannot plant settings for anyone.
// - Parsing is strict: every line known, every value checked, each error one line naming the file,
//   the line and the field. A damaged file is an error, never "MPS off".
// - The client environment only ever lowers what the process asked for itself
//   (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_CLIENT_PRIORITY, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
//   CUSHARE_THREAD_PERCENTAGE, CUSHARE_PRIORITY).
// - Pure code apart from the read/write functions: no global state, no logging.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cushare/shim_config.h"

namespace cushare {

inline constexpr char kMpsHostFile[] = "mps.conf";
inline constexpr char kMpsTenantSuffix[] = ".mps";
inline constexpr size_t kMaxMpsFileBytes = 64 * 1024;
inline constexpr size_t kMaxMpsPipeDir = 99;  // "<dir>/control" must fit a Unix socket's 107 bytes

// One tenant's MPS client settings (or an unknown tenant's, from the profile).
struct MpsTenantSettings {
  std::optional<int> threads;  // active thread percentage 1..100; unset: no cap
  Priority priority = Priority::kNormal;
  // Per device ("GPU-<hex>" as formatGpuUuid writes it), the memory limit; devices not listed
  // and kUnlimited entries: no limit.
  std::vector<std::pair<std::string, uint64_t>> memory;
};

struct MpsHostSettings {
  std::string pipeDir;  // the daemon's CUDA_MPS_PIPE_DIRECTORY
  // The pipe directory's st_dev and st_ino (0, 0: not published, an older broker). A process whose
  // CUSHARE_MPS_PIPE_DIR names another directory is refused (mpsClientEnv).
  uint64_t pipeDev = 0, pipeIno = 0;
  // Bytes added to a tenant's memory limit for its MPS pinned-memory limit: the CUDA context and
  // module images, which the device counts and the shim's limit does not.
  uint64_t contextReserve = 0;
  // The unknown-tenant profile's settings when the broker admits unknown tenants.
  std::optional<MpsTenantSettings> unknown;
  // MIG devices, each with a control daemon of its own (as NVIDIA runs MPS on MIG) whose pipe
  // directory is <pipe_dir>/<uuid>: a process whose CUDA_VISIBLE_DEVICES names one (by its
  // MIG-<uuid>, or the legacy MIG-<GPU-UUID>/<gi>/<ci>) is that daemon's client.
  struct MigDaemon {
    std::string uuid;     // "MIG-..." (formatDeviceUuid)
    std::string gpuUuid;  // its GPU's "GPU-..."
    unsigned gi = 0, ci = 0;
  };
  std::vector<MigDaemon> mig;
  // A daemon at pipe_dir itself serves the whole GPUs (false on a host whose devices are all MIG
  // devices).
  bool wholeGpus = true;
};
// The longest pipe_dir that leaves room, within a socket's 107 bytes, for a MIG device's
// "/MIG-<uuid>" (41) and the sockets in it: "/control", and a server's (simgpu's
// "/mps-server-<pid>": 19 with a 7-digit pid).
inline constexpr size_t kMaxMpsPipeDirWithMig = 107 - 41 - 19;

std::string formatMpsHost(const MpsHostSettings& s);
std::string formatMpsTenant(const MpsTenantSettings& s);
// name: the file's name for messages. False with *err (one line) on any problem.
bool parseMpsHost(std::string_view text, const std::string& name, MpsHostSettings* out, std::string* err);
bool parseMpsTenant(std::string_view text, const std::string& name, MpsTenantSettings* out, std::string* err);

// Reads <dir>/mps.conf (or <dir>/<tenant>.mps): 1 with *out filled, 0 when the file does not
// exist, -1 with *err when it cannot be read, is not the broker's (owner, mode, type) or does not
// parse.
int readMpsHost(const std::string& dir, MpsHostSettings* out, std::string* err);
int readMpsTenant(const std::string& dir, const std::string& tenant, MpsTenantSettings* out, std::string* err);

// Replaces <dir>/<name> with text atomically (mkostemp beside it, fsync, rename), mode 0644.
bool writeMpsFile(const std::string& dir, const std::string& name, const std::string& text, std::string* err);

// The MPS client environment of a tenant process.
struct MpsClientEnv {
  std::string pipeDir;     // CUDA_MPS_PIPE_DIRECTORY (<pipe_dir>/<uuid> for a MIG device's daemon)
  std::string threads;     // CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; empty: leave unset
  std::string priority;    // CUDA_MPS_CLIENT_PRIORITY: "0" or "1"
  std::string pinnedMem;   // CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; empty: leave unset
};

// From the broker's settings (tenant: the tenant's file, or the host's unknown-tenant settings),
// the shim's configuration (CUSHARE_THREAD_PERCENTAGE and CUSHARE_PRIORITY only lower) and the
// process's own CUDA_MPS_* variables (getenv; these only lower too). Pinned limits are the
// tenant's limit plus the context reserve, rounded down to whole MiB ("GPU-...=1536M"), merged
// per device with the process's own (the lower wins). Fails (one line) for a malformed CUDA_MPS_*
// value or a CUDA_MPS_PINNED_DEVICE_MEM_LIMIT that names a device by ordinal, which cannot be
// matched to a UUID before the driver starts. A process whose CUDA_VISIBLE_DEVICES names a MIG
// device (its first MIG- entry, as the driver reads it) is the client of that MIG device's daemon,
// with the pinned limit of that MIG device only; one naming a MIG device without a daemon of the
// broker fails (it would run outside MPS). Other processes are clients of the whole GPUs' daemon,
// with the limits of the whole GPUs.
bool mpsClientEnv(const MpsHostSettings& host, const MpsTenantSettings& tenant, const ShimConfig& config,
                  const std::function<const char*(const char*)>& getenv, MpsClientEnv* out, std::string* err);

}  // namespace cushare
