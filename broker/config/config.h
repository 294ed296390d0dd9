// The broker's configuration file (YAML): parsing, validation and the check against the devices
// of the host. Reference: docs/broker-configuration.md.
//
// Invariants:
// - Config is plain data, fully validated: every name is well formed, every profile reference
//   exists, each tenant already carries its profile's fields (the tenant's own fields win).
// - Every error is exactly one line, `<file>:<line>:<column>: <field path>: <reason>` (the field
//   path is left out for problems of the file as a whole: YAML syntax, an empty file). Only the
//   first problem is reported.
// - On failure the output Config is untouched, so a refused reload leaves the running
//   configuration as it was.
// - Pure code: no logging, no global state; loadConfig is the only function that touches files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cushare/shim_config.h"

namespace cushare::broker {

struct SourceMark {
  int line = 0;    // 1-based; 0 when the value was not written in the file (a default)
  int column = 0;  // 1-based
};

// An amount of device memory: bytes, or a share of the device's total.
struct MemoryAmount {
  uint64_t bytes = 0;         // when milliPercent == 0
  uint32_t milliPercent = 0;  // 1..100000 (0.001% .. 100%); 0 when bytes is used
  bool isPercent() const { return milliPercent != 0; }
};

// The memory field of a tenant or profile.
struct MemorySpec {
  enum Kind {
    kNone,       // not given: no limit
    kAll,        // one amount for every device
    kPerDevice,  // amounts for the named devices only; other devices: no limit
  };
  struct Entry {
    int ordinal = -1;   // device ordinal (a GPU's NVML index), or -1 when uuid names the device
    int migIndex = -1;  // with ordinal: the MIG device's index under that GPU ("0:1"), or -1
    std::string uuid;   // "GPU-" or "MIG-" + lower-case hex, or empty when ordinal is used
    MemoryAmount amount;
    std::string key;  // the device key as written, for messages
    SourceMark mark;  // of the key
  };
  Kind kind = kNone;
  MemoryAmount all;            // kAll only
  std::vector<Entry> entries;  // kPerDevice only, in the order written
  SourceMark mark;             // of the memory value
  std::string path;            // field path of the memory value, e.g. "tenants[0].memory"
};

// How memory above a tenant's guarantee is backed (docs/memory-elasticity.md).
enum class BurstMode {
  kOff,      // no guarantee below the limit: every byte up to the limit is ordinary device memory
  kManaged,  // above the guarantee, allocations become managed memory, evictable to host memory
  kPlain,    // above the guarantee, ordinary memory, reclaimed cooperatively when a guarantee needs it
};
const char* burstModeName(BurstMode m);  // "off", "managed", "plain"

// The elasticity: block (docs/memory-elasticity.md): reclaim of plain bursts, and the thrashing
// guard of managed bursts.
struct ElasticityConfig {
  // How long an ordinary allocation of a tenant within its guarantee, refused by the driver while
  // other tenants hold plain bursts, waits for them to be reclaimed before it fails.
  uint32_t reclaimWaitMs = 1000;
  // How long a tenant asked to give back plain bursts has before its allocations above its
  // guarantee are refused (until the reclaim is over).
  uint32_t reclaimDeadlineMs = 1000;
  // Managed bursters with work whose bursts do not fit in the device's room together take turns
  // on the device (one at a time, thrashQuantumMs each) instead of evicting each other's pages.
  bool thrashGuard = true;
  uint32_t thrashQuantumMs = 1000;
};

struct Profile {
  std::string name;
  MemorySpec memory;
  MemorySpec guarantee;  // kNone: not set
  std::optional<BurstMode> burst;
  std::optional<int> threadPercentage;
  std::optional<Priority> priority;
  std::optional<uint32_t> weight;
  SourceMark mark;  // of the profile's name
};

struct Tenant {
  std::string name;
  std::string profile;                    // the profile it names; empty when none
  MemorySpec memory;                      // effective: the tenant's own, else the profile's
  // Effective, like memory: what is reserved for it on each device (admission counts this, not
  // memory). kNone: its memory limit (no bursting). Set only together with burst != kOff.
  MemorySpec guarantee;
  BurstMode burst = BurstMode::kOff;
  std::optional<int> threadPercentage;    // effective; unset: no compute cap
  Priority priority = Priority::kNormal;  // effective; normal when neither sets it
  uint32_t weight = 1;                    // effective: its share among contending tenants (1..1000)
  std::optional<uint32_t> uid;            // owner of the tenant's ledger file
  std::optional<uint32_t> gid;            // group of the tenant's ledger file
  SourceMark mark;                        // of the tenant's list item
  std::string path;                       // "tenants[<index>]"
};

// The broker's NVIDIA MPS control daemon (the mps: block; docs/mps.md).
struct MpsConfig {
  enum class Mode { kOff, kOn, kAuto };  // auto: on when the control binary runs
  Mode mode = Mode::kOff;
  // The control binary: an absolute path, or a name looked up on PATH. Empty: the default, the
  // simulated one beside simgpu's NVML when the broker runs on simgpu, else
  // nvidia-cuda-mps-control on PATH.
  std::string control;
  std::string pipeDir = "/run/cushare/mps";      // CUDA_MPS_PIPE_DIRECTORY
  std::string logDir = "/var/log/cushare/mps";   // CUDA_MPS_LOG_DIRECTORY
  // Added to a tenant's memory limit for its MPS pinned-memory limit (the CUDA context and module
  // images count there, not in the shim's limit).
  uint64_t contextReserve = uint64_t{512} << 20;
  // -multiuser-server: one server, root's, serves the clients of every uid. Off: NVIDIA's default
  // of one server per uid at a time, where a client of another uid waits until every client of
  // the running server's uid has exited (docs/mps.md, "Tenants on their own uids").
  bool multiuser = true;
  SourceMark mark;  // of the mps: key's value
};

const char* mpsModeName(MpsConfig::Mode m);  // "off", "on", "auto"

// The compute scheduler's settings (`compute:` block; docs/compute.md). Its own struct and parser
// function, apart from the rest, so that other blocks merge without conflicts.
struct ComputeConfig {
  uint32_t periodMs = 100;            // budgets are cap x period
  uint32_t priorityFloorPercent = 10; // what lower-priority tenants keep next to a busy high one
  // Lower priorities are held to the floor only while a higher one has work on the device, or had
  // within this many ms (docs/compute.md, Priorities): work-conserving.
  uint32_t priorityGuardMs = 2;
  bool metering = true;               // measure every tenant's GPU busy time (launch markers)
  bool fairShare = true;              // contending tenants share devices by weight (docs/compute.md)
  // Weights also gate MPS clients whose SMs overlap (docs/compute.md, "Weights under MPS"): off by
  // default, as gating binds cooperating processes only, where the server binds every client.
  bool mpsWeights = false;
  // The busy-time source of every tenant process, published in the host segment (a tenant's
  // CUSHARE_METERING does not change it), and the only file a tenant process may load CUPTI
  // from: absolute, checked like cdi.shim (root's or the broker's, nobody else may write it or
  // a directory above it) and mounted read-only at the same path in tenant containers. Empty:
  // no CUPTI (auto meters with events; cupti needs it). docs/compute.md, "Measuring GPU time".
  MeteringSource meteringSource = MeteringSource::kAuto;
  std::string cuptiLibrary;
};

// Probe rounds (`probes:` block; docs/probes.md): every interval, the probes run at one instant
// in one process of each tenant with processes on a device; the broker turns their records into
// each tenant's achieved share over a window.
struct ProbeConfig {
  bool on = true;  // probes: off turns them off (docs/probes.md, "Configuration")
  uint32_t intervalMs = 1000;   // between rounds on a device (a random phase within it)
  uint32_t windowS = 10;        // shares are estimated over this many seconds of rounds
  uint32_t budgetUs = 200;      // the SM probe's time box (memory: 3/4 of it, tick: 1/2)
  uint32_t kinds = 1u | 4u;     // ProbeSet bits: sm 1, mem 2, tick 4 (default sm and tick)
};

// The CDI spec the broker writes (the cdi: block; docs/containers.md).
struct CdiConfig {
  bool enabled = true;                  // cdi: off turns it off
  std::string specDir = "/var/run/cdi";  // where the spec goes (CDI's directory for generated specs)
  // The shim's path on the host (the spec's mount source). Empty: the one installed beside the
  // broker (<prefix>/lib/cushare/libcushare.so), as `cushare run` finds it.
  std::string shim;
  bool removeOnStop = false;            // remove the spec when the broker stops
  SourceMark mark;                      // of the cdi: key's value; line 0: not in the file
};

// The kubelet device plugin the broker serves (the kubernetes: block; docs/kubernetes.md). Off
// unless the block is written.
struct KubernetesConfig {
  bool enabled = false;
  std::string devicePluginDir = "/var/lib/kubelet/device-plugins";  // kubelet.sock is here
  uint32_t devicesPerGpu = 8;  // devices (container slots) of each tenant's resource per GPU, 1..100
  // The CDI device Allocate adds for each GPU of the allocated IDs ({uuid}, {index}); empty: none.
  std::string gpuCdiDevice;
  // Pod labels (docs/kubernetes.md, "Pods in the metrics"): the kubelet's pod resources socket,
  // asked which pod and container hold each device ID; empty (pod_resources_socket: off): no
  // pod labels and no allocation mounts.
  std::string podResourcesSocket = "/var/lib/kubelet/pod-resources/kubelet.sock";
  // Per allocated device ID a directory <allocationDir>/<tenant>/<uuid>_<n>, which Allocate
  // mounts into the container: how the broker tells a process's container (the same path on the
  // host and in the broker's container).
  std::string allocationDir = "/run/cushare/allocations";
  SourceMark mark;             // of the kubernetes: key's value
};
inline constexpr size_t kMaxDevicePluginDir = 70;  // <dir>/cushare-<name>.sock must fit 107 bytes
inline constexpr size_t kMaxAllocationDir = 200;  // + /<tenant>/<uuid>_<n> stays far below PATH_MAX

// One entry of a MIG layout, in mig-parted's vocabulary (docs/mig.md, "Declarative layout"): the
// GPUs it applies to, whether MIG is on, and how many GPU instances of each profile (each with one
// compute instance spanning it).
struct MigLayoutEntry {
  bool allDevices = true;
  std::vector<int> devices;  // NVML indexes when !allDevices
  bool enabled = false;
  std::vector<std::pair<std::string, uint32_t>> profiles;  // "1g.10gb" -> count, in the order written
  SourceMark mark;
  std::string path;  // "mig.layout[0]" or "<file>: mig-configs.<name>[0]", for messages
};

// The mig: block: the layout the GPUs should have, inline or mig-parted's file and config name.
struct MigConfig {
  bool set = false;
  std::string configFile, configName;  // mig-parted's file and the config in it (loaded when used)
  std::vector<MigLayoutEntry> layout;  // inline; empty with configFile
  bool applyAtStart = false;           // the broker brings the GPUs to it before listing devices
  // The broker starts again on a MIG layout changed under it (docs/mig.md, "When the layout
  // changes"); false: it keeps its device list until restarted. Alone in the block, no layout.
  bool followLayout = true;
  SourceMark mark;
};

// mig-parted's file (version: v1, mig-configs: NAME: [entries]): the entries of config `name`.
// False with one line naming the file, line and field.
bool loadMigPartedConfig(const std::string& path, const std::string& name, std::vector<MigLayoutEntry>* out,
                         std::string* error);
// The layout the mig: block names (inline, or loaded from mig-parted's file).
bool migLayoutOf(const MigConfig& m, std::vector<MigLayoutEntry>* out, std::string* error);

struct Config {
  std::string file;
  ComputeConfig compute;  // the name used in messages (the path given to loadConfig)
  ProbeConfig probes;
  ElasticityConfig elasticity;
  std::string ledgerDir = "/dev/shm/cushare";
  std::string socket = "/run/cushare/broker.sock";
  std::string metricsHost = "127.0.0.1";  // as written; an IPv6 address without brackets; empty:
                                          // metrics off (metrics_listen: off)
  uint16_t metricsPort = 9464;            // 0: any free port (cushare status shows which)
  std::string stateFile = "/run/cushare/broker.state";  // live limits (set-limit) kept here
  std::string unknownTenantsProfile;  // empty: refuse unknown tenants
  // Unknown tenants the broker admits at a time, in all and per uid (the owner of the ledger
  // file). Their pool, max_unknown_tenants times the profile's memory, is admitted beside the
  // configured tenants' limits.
  uint32_t maxUnknownTenants = 8;
  uint32_t maxUnknownTenantsPerUid = 4;
  std::string adminGroup;             // empty: only root may change things
  // Device memory a process may hold beyond what its tenant's ledger counts that the broker does
  // NOT charge to the tenant. 0 (the default): everything the device holds for the tenant's
  // processes counts against its limit, CUDA contexts and module images included, so nothing can
  // be hidden from the ledger. A larger value exempts that much per process (and lets a tenant
  // hide that much).
  uint64_t hiddenMemoryAllowance = 0;
  // What a process's CUDA context and module images normally hold on the device beyond its
  // allocations. Untracked memory up to this per process is charged but reported as context
  // memory, not as memory hidden from the ledger (no warning, no tamper count).
  uint64_t contextMemory = uint64_t{512} << 20;
  // What the broker does when a tenant's processes allocated past its limit behind its back:
  // kill takes them down (SIGKILL), so the device frees what they took; charge only charges it
  // to the tenant while they keep it (docs/operations.md, "A hostile tenant").
  // kKillPastLimit (hidden memory only): kill, but only while what the device holds for the
  // tenant is past the most its ledger may hold (its limit, or what it held when the operator
  // lowered the limit below it).
  enum class TamperResponse { kKill, kCharge, kKillPastLimit };
  // After a limit or device UUID rewritten in the ledger (an honest shim never writes them).
  TamperResponse tamperResponse = TamperResponse::kKill;
  // For memory hidden from the ledger beyond context_memory per process. kill_past_limit by
  // default: memory that takes the tenant past its limit on the device goes with the processes
  // holding it; hidden memory within the limit (or a context larger than context_memory, which
  // looks the same) is charged and left.
  TamperResponse hiddenMemoryResponse = TamperResponse::kKillPastLimit;
  MpsConfig mps;
  CdiConfig cdi;
  KubernetesConfig kubernetes;
  MigConfig mig;
  std::vector<Profile> profiles;      // in the order written
  std::vector<Tenant> tenants;        // in the order written; names unique
};

inline constexpr size_t kMaxConfigBytes = 1 << 20;

// Parses text (the contents of a file; nameForErrors names it in messages). On success fills
// *out and returns true; otherwise sets *error to one line and returns false, *out untouched.
bool parseConfig(std::string_view text, const std::string& nameForErrors, Config* out,
                 std::string* error);

// Reads the file at path (at most kMaxConfigBytes) and parses it as parseConfig does.
bool loadConfig(const std::string& path, Config* out, std::string* error);

// A device of this host, as the broker sees it.
// A device the broker shares: a whole GPU, or a MIG device (one compute instance of a GPU
// instance on a GPU in MIG mode; docs/mig.md). A GPU in MIG mode is not a device itself: CUDA runs
// only in its MIG devices.
struct DeviceInfo {
  int ordinal = 0;          // the GPU's NVML index (a MIG device's: its parent's)
  int migIndex = -1;        // the MIG device's NVML index under its GPU; -1 for a whole GPU
  std::string uuid;         // "GPU-<lower-case hex>", or "MIG-<lower-case hex>" for a MIG device
  uint64_t totalBytes = 0;  // device memory (a MIG device: its GPU instance's)
  // MIG devices only:
  std::string parentUuid;   // the GPU's "GPU-..." UUID
  std::string profile;      // e.g. "3g.40gb", "1c.3g.40gb" (from NVML's name of the MIG device)
  unsigned gpuInstance = 0, computeInstance = 0;  // GI and CI IDs
  int gpuMinor = -1;        // the N of its GPU's /dev/nvidiaN (NVML's minor number); -1: unknown
  // Index in the device list of the first device sharing this one's memory: itself for a GPU or
  // the first MIG device of its GPU instance (compute instances of one GPU instance share its
  // memory, so memory limits are admitted against it together). SIZE_MAX: its own (group(self)).
  size_t memoryGroup = SIZE_MAX;
  size_t group(size_t self) const { return memoryGroup == SIZE_MAX ? self : memoryGroup; }
  bool mig() const { return migIndex >= 0; }
  // "0" for a GPU, "0:1" for MIG device 1 of GPU 0 (NVIDIA's <gpu>:<mig> naming).
  std::string name() const {
    return std::to_string(ordinal) + (mig() ? ":" + std::to_string(migIndex) : std::string());
  }
};

// One tenant's memory limit on each device: (*limits)[i] for devices[i], kUnlimited where the
// spec sets none. A percentage is of that device's total, rounded down to whole bytes. Fails
// (one line naming the file, line and field) for a device key that names no device in devices,
// or two keys naming the same device.
bool resolveMemory(const Config& config, const MemorySpec& spec,
                   const std::vector<DeviceInfo>& devices, std::vector<uint64_t>* limits,
                   std::string* error);

// A tenant's guarantee on each device: its guarantee where it bursts, else its memory limit
// (kUnlimited where neither sets one). Fails as resolveMemory does, and for a guarantee above the
// memory limit on a device.
bool resolveGuarantee(const Config& config, const Tenant& t, const std::vector<DeviceInfo>& devices,
                      std::vector<uint64_t>* guarantees, std::string* error);

// Resolves every tenant's guarantee (its memory limit unless it bursts) on every device and
// refuses a configuration in which their sum on a device exceeds its total (exactly full is
// accepted), naming the tenant
// whose limit makes the sum overflow and the device. Tenants without a limit on a device do not
// count. With an unknown-tenant profile, its pool (max_unknown_tenants times the profile's memory)
// counts beside them, and a profile without a limit on a device is refused. Also fails as
// resolveMemory does.
bool checkAgainstDevices(const Config& config, const std::vector<DeviceInfo>& devices,
                         std::string* error);

// The memory device d's limits are admitted against, for messages: "device 0 (GPU-...)", or "GPU
// instance 1 of GPU 0 (MIG devices 0:0, 0:1, sharing its memory)" when several compute instances
// (MIG devices) share their GPU instance's memory.
std::string memoryName(const std::vector<DeviceInfo>& devices, size_t d);

// An amount's bytes on a device of total bytes: a percentage is rounded down to whole bytes.
uint64_t bytesOn(const MemoryAmount& a, uint64_t total);

// "12.5%" for 12500 milli-percent.
std::string formatPercent(uint32_t milliPercent);

}  // namespace cushare::broker
