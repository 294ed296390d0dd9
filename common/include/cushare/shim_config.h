// Configuration of a tenant process: the CUSHARE_* environment, parsed once at load by the shim
// (and by the broker when it checks a tenant's settings). Reference: docs/configuration.md.
//
// Invariants:
// - Pure code: no global state, no logging, no getenv of its own (the caller passes a lookup), so
//   it is testable and safe to run before main. It allocates only the strings and vectors it
//   returns, once, at load; nothing here is on a hooked call's path.
// - Fail closed: every malformed value is an error with one specific reason. Nothing falls back to
//   a default, and nothing becomes unlimited, except a variable that is unset.
// - An error is exactly one line, `cushare: invalid CUSHARE_X='value': reason`, with control
//   characters of the value escaped and long values shortened.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cushare {

// CUSHARE_MEMORY_LIMIT, parsed but not yet matched to devices (that needs the driver; see
// resolveMemoryLimits).
struct MemoryLimitSpec {
  enum Kind {
    kNone,       // variable unset: no limit
    kAll,        // one size ("8GiB"): the same limit on every device
    kPerDevice,  // "0=8GiB,GPU-<uuid>=4GiB": limits on the named devices only
  };
  struct Entry {
    int ordinal = -1;  // device ordinal as the process sees it, or -1 when uuid names the device
    std::string uuid;  // "GPU-" or "MIG-" + 8-4-4-4-12 lower-case hex digits, or empty when ordinal is used
    uint64_t bytes = 0;
  };
  Kind kind = kNone;
  uint64_t all = 0;            // kAll only
  std::vector<Entry> entries;  // kPerDevice only, in the order written
};

enum class Priority { kHigh, kNormal, kLow };
enum class LogLevel { kError, kWarn, kInfo, kDebug, kTrace };  // each includes the ones before
// Where a metered process's GPU busy time comes from (docs/compute.md): timing events on its
// streams, CUPTI activity records, or CUPTI when it starts and events otherwise.
enum class MeteringSource { kEvents, kCupti, kAuto };

struct ShimConfig {
  std::string tenant = "default";
  MemoryLimitSpec memory;
  std::optional<int> threadPercentage;  // 1..100; unset: no compute share is requested
  Priority priority = Priority::kNormal;
  std::string ledgerDir = "/dev/shm/cushare";
  LogLevel logLevel = LogLevel::kWarn;
  // CUSHARE_REQUIRE_BROKER=1: refuse to run standalone (no broker's host segment in ledgerDir),
  // e.g. because the ledger directory was not mounted or its name is misspelt.
  bool requireBroker = false;
  // CUSHARE_METERING: the busy-time source. CUPTI that does not start (simgpu, no libcupti) falls
  // back to events whatever this says.
  MeteringSource metering = MeteringSource::kAuto;
  bool meteringSet = false;  // CUSHARE_METERING was given (under a broker the broker's choice wins)
  // CUSHARE_MPS_PIPE_DIR: where the broker's MPS pipe directory is in this process's view (a
  // container mounts it at a path of its own); empty: the broker's pipe_dir, as mps.conf names it.
  std::string mpsPipeDir;
};

inline constexpr uint64_t kUnlimited = UINT64_MAX;

// Reads every CUSHARE_* variable through getenv (which returns nullptr for an unset variable).
// On success fills *out and returns true. On the first invalid variable (checked in the order of
// ShimConfig's fields) sets *error to one line, `cushare: invalid CUSHARE_X='value': reason`,
// leaves *out untouched and returns false.
bool loadShimConfig(const std::function<const char*(const char*)>& getenv, ShimConfig* out,
                    std::string* error);

// Matches a memory limit to the devices the process sees. Fills (*limits)[ordinal] for every
// ordinal in 0..deviceCount-1: the limit, or kUnlimited where the spec does not name the device
// (kNone everywhere; kPerDevice for the devices it leaves out). uuidOf(ordinal, &uuid) gives a
// device's UUID in the "GPU-<lower-case hex>" form (see formatGpuUuid) or returns false if it
// cannot be read; it is called only when the spec names a device by UUID. Fails closed, with
// *error set to one line naming CUSHARE_MEMORY_LIMIT, for an ordinal >= deviceCount, a device
// named twice (once by ordinal, once by UUID), or a UUID that matches no visible device while some
// visible device is not named (a UUID of a device hidden from this process by CUDA_VISIBLE_DEVICES
// or a container is accepted when every visible device has its limit).
bool resolveMemoryLimits(const MemoryLimitSpec& spec, int deviceCount,
                         const std::function<bool(int, std::string*)>& uuidOf,
                         std::vector<uint64_t>* limits, std::string* error);

// The limit of one device named by its UUID ("GPU-<lower-case hex>"), for a process that sees its
// devices through NVML only (no cuInit, so no CUDA ordinals): kUnlimited where the spec does not
// name it. Fails closed, with *error set to one line, when the spec names devices by ordinal and
// not this one by UUID: ordinals are CUDA's numbering, which NVML cannot reproduce.
bool memoryLimitOfUuid(const MemoryLimitSpec& spec, const std::string& uuid, uint64_t* limit,
                       std::string* error);

// Parsers of single values, shared with the broker. Each returns false with *reason set to a
// specific reason that quotes the offending part (without the "cushare: invalid ..." prefix).
bool parseMemoryLimit(std::string_view text, MemoryLimitSpec* out, std::string* reason);
bool parseTenant(std::string_view text, std::string* out, std::string* reason);
bool parseThreadPercentage(std::string_view text, int* out, std::string* reason);
bool parsePriority(std::string_view text, Priority* out, std::string* reason);
bool parseLedgerDir(std::string_view text, std::string* out, std::string* reason);
bool parseLogLevel(std::string_view text, LogLevel* out, std::string* reason);
bool parseRequireBroker(std::string_view text, bool* out, std::string* reason);  // "1" or "0"
bool parseMetering(std::string_view text, MeteringSource* out, std::string* reason);  // events|cupti|auto
// An absolute directory whose "<dir>/control" fits a Unix socket address (at most 99 bytes).
bool parseMpsPipeDir(std::string_view text, std::string* out, std::string* reason);

// Every variable loadShimConfig reads. isShimVariable lets the shim find a misspelt CUSHARE_*
// name in the environment (a typo such as CUSHARE_MEMORY_LIMT would otherwise mean no limit).
inline constexpr const char* kShimVariables[] = {
    "CUSHARE_TENANT",   "CUSHARE_MEMORY_LIMIT", "CUSHARE_THREAD_PERCENTAGE",
    "CUSHARE_PRIORITY", "CUSHARE_LEDGER_DIR",   "CUSHARE_LOG_LEVEL",
    "CUSHARE_REQUIRE_BROKER", "CUSHARE_METERING", "CUSHARE_MPS_PIPE_DIR",
};
bool isShimVariable(std::string_view name);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" in lower case, from the 16 bytes of a CUuuid or an
// NVML UUID, as nvidia-smi prints it.
std::string formatGpuUuid(const unsigned char bytes[16]);
// The same with "MIG-" for a MIG device (its own UUID, as cuDeviceGetUuid_v2 gives it inside one).
std::string formatDeviceUuid(const unsigned char bytes[16], bool mig);
// The reverse: "GPU-" or "MIG-" and 32 hex digits grouped 8-4-4-4-12, any case, to 16 bytes.
bool parseGpuUuidBytes(std::string_view text, unsigned char bytes[16]);
// Two UUIDs name the same device: the same 16 bytes, whatever their prefix ("GPU-" or "MIG-": a
// MIG device's UUID may be spelled either way, e.g. by a driver's first cuDeviceGetUuid) or case.
bool sameDeviceUuid(std::string_view a, std::string_view b);

// Whether s starts with prefix, ASCII case ignored.
bool startsWithNoCase(std::string_view s, std::string_view prefix);
// The first "MIG-..." entry of a CUDA_VISIBLE_DEVICES value, trimmed ("" when none): the MIG device
// the driver runs the process in (one MIG device per process). simgpu's driver and the shim's MPS
// set-up both read it here, so that they never disagree.
std::string firstMigEntry(std::string_view visible);

const char* priorityName(Priority p);  // "high", "normal", "low"
const char* logLevelName(LogLevel l);  // "error", "warn", "info", "debug", "trace"
const char* meteringName(MeteringSource m);  // "events", "cupti", "auto"

}  // namespace cushare
