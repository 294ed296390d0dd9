// Bringing the host's GPUs to a declared MIG layout (docs/mig.md, "Declarative layout"):
// `cushare mig assert|apply` and the broker's mig.apply_at_start. The layout is mig-parted's
// (config.h, MigLayoutEntry); NVML (libnvidia-ml.so.1, loaded at run time) reads and changes the
// GPUs. Semantics follow mig-parted's: a GPU matches when its MIG mode is the wanted one and its GPU
// instances are the wanted profiles in the wanted counts, each with one compute instance spanning
// it (placements and IDs do not matter); a GPU that does not match has every instance destroyed and
// the wanted ones created, at placements chosen so that all of them fit. Unlike mig-parted, nothing
// is touched while any process runs on an affected GPU (the refusal names them), and a mode change
// the driver leaves pending (it needs a GPU reset) stops that GPU's part with what to do.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"

namespace cushare::broker::mig {

struct GiProfile {
  unsigned id = 0;           // the profile ID (nvmlGpuInstanceProfileInfo_v2_t.id)
  std::string name;          // "1g.10gb" (NVML's name without "MIG ")
  unsigned slices = 0;       // compute slices
  unsigned maxInstances = 0; // instanceCount: at most this many on the GPU
  uint64_t memoryBytes = 0;  // memorySizeMB
  std::vector<std::pair<unsigned, unsigned>> placements;  // (start, size) on the memory-slice axis
};

struct Instance {
  unsigned gi = 0;
  unsigned profileId = 0;
  std::string profile;       // its profile's name
  unsigned start = 0, size = 0;
  unsigned computeInstances = 0;
  bool fullCompute = false;  // exactly one compute instance, spanning the GPU instance
};

struct Gpu {
  int index = 0;
  std::string uuid;
  bool capable = false;      // MIG mode can be read (NOT_SUPPORTED: a GPU without MIG)
  bool enabled = false;      // current mode
  bool pendingEnabled = false;
  std::vector<GiProfile> profiles;   // of a GPU with MIG (readable with MIG off too)
  std::vector<Instance> instances;
  std::vector<std::string> migUuids; // its MIG devices, by index
  std::vector<int> pids;             // processes on the GPU or its MIG devices
};

// What the layout wants of one GPU.
struct Wanted {
  bool enabled = false;
  std::map<std::string, unsigned> counts;  // profile name -> instances
};

// The host through NVML. Every call returns false with one line in *err on an NVML error.
class Host {
 public:
  bool read(std::vector<Gpu>* out, std::string* err);
  // Sets GPU `gpu`'s mode; *pending when the driver needs a reset before it applies.
  // destroyAll refuses (before destroying anything) when a process runs on the GPU by then.
  bool setMode(int gpu, bool enabled, bool* pending, std::string* err);
  bool destroyAll(int gpu, std::string* err);
  // A GPU instance of the profile at the placement, and one compute instance spanning it.
  bool create(int gpu, const GiProfile& p, std::pair<unsigned, unsigned> placement, std::string* err);
};

// Per GPU of the host (gpus' order), what the layout wants (nullopt: no entry names it). False
// with one line when an entry names a GPU the host does not have.
bool wantedOf(const std::vector<MigLayoutEntry>& layout, const std::vector<Gpu>& gpus,
              std::vector<std::optional<Wanted>>* out, std::string* err);

// Why the GPU does not have what is wanted: "" when it matches.
std::string difference(const Gpu& gpu, const Wanted& w);

// Placements for the wanted instances on an empty GPU of these profiles: (profile, placement) in
// the order to create them. False with *why when a profile is unknown or they cannot all fit.
bool place(const Gpu& gpu, const Wanted& w, std::vector<std::pair<GiProfile, std::pair<unsigned, unsigned>>>* out,
           std::string* why);

// What the configuration would meet after the layout: one line per memory key that would name no
// device, a GPU in MIG mode, or a MIG device the layout re-creates (its UUID goes with it); more
// devices than a broker shares; a single size that no longer fits the smallest new GPU instance
// (or their sum); an unknown_tenants profile whose per-device map misses the new MIG devices. Only
// GPUs whose layout changes are judged. A <gpu>:<mig> index that still exists may name another
// profile than before (the driver numbers MIG devices by GPU instance ID): cushare-broker --check
// judges the limits against the devices once they exist.
std::vector<std::string> keyProblems(const Config& c, const std::vector<Gpu>& gpus,
                                     const std::vector<std::optional<Wanted>>& wanted);

struct Report {
  std::vector<std::string> steps;     // done (or, dry run, to do), one line each
  std::vector<std::string> problems;  // why the layout is not (fully) applied
  bool pendingReset = false;          // some GPU waits for a reset
  uint64_t changes = 0;               // instances destroyed and created, mode changes made
};

// assert: the differences (empty: the host has the layout). apply: brings the GPUs to it, or with
// dryRun says what it would do. Both read the host first; *err for NVML errors.
bool assertLayout(Host& host, const std::vector<MigLayoutEntry>& layout, std::vector<std::string>* differences,
                  std::string* err);
bool applyLayout(Host& host, const Config& c, const std::vector<MigLayoutEntry>& layout, bool dryRun, Report* r,
                 std::string* err);

// One change of MIG layout at a time on this host: `cushare mig apply` and a broker's
// apply_at_start each hold it while they read, judge and change the GPUs (two of them interleaved
// could each destroy what the other created). The lock is an flock on a file beside the
// configuration's state_file (applyLockPath), made when missing (with its directories, 0755): a
// regular file of this user with one name, mode 0600, never followed through a link, in
// directories of root or this user that nobody else may write (else refused, as the broker
// refuses such a state_file); the holder's pid is written in it for the next one's message.
class ApplyLock {
 public:
  ApplyLock() = default;
  ~ApplyLock();
  ApplyLock(const ApplyLock&) = delete;
  ApplyLock& operator=(const ApplyLock&) = delete;
  // Takes the lock, trying for up to waitMs (0: once); `waiting` is told once, with who holds it,
  // when it has to wait. False with *err (one line): held by another (its pid named) past the
  // wait, or the file or a directory above it is one others could change or hold.
  bool acquire(const std::string& path, int waitMs, std::string* err,
               const std::function<void(const std::string&)>& waiting = {});
  // The descriptor holding the lock, now the caller's to close (-1 when not held).
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};
// <state_file> + kApplyLockSuffix.
inline constexpr char kApplyLockSuffix[] = ".mig-lock";
std::string applyLockPath(const Config& c);

}  // namespace cushare::broker::mig
