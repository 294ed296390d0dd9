// Parsing of the CUSHARE_* environment (see shim_config.h for the contract and
// docs/configuration.md for the accepted forms). Every reason quotes the offending piece so a user
// can find it in a long per-device list; reasons never contain a newline.
#include "cushare/shim_config.h"

#include <climits>
#include <cstdio>
#include <cstring>

#include "cushare/parse.h"

namespace cushare {
namespace {

constexpr size_t kMaxQuotedValue = 200;  // longer values are shortened in messages
constexpr size_t kMaxQuotedPiece = 64;
constexpr size_t kMaxTenant = 63;
constexpr size_t kMaxLedgerDir = 4095;  // PATH_MAX - 1

char lowerAscii(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }
bool isDigit(char c) { return c >= '0' && c <= '9'; }
bool isHex(char c) { return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }



std::string quote(std::string_view piece) { return "'" + printable(piece, kMaxQuotedPiece) + "'"; }

bool fail(std::string* reason, std::string why) {
  if (reason) *reason = std::move(why);
  return false;
}

std::string errorLine(const char* var, std::string_view value, const std::string& reason) {
  return std::string("cushare: invalid ") + var + "='" + printable(value, kMaxQuotedValue) +
         "': " + printable(reason, 2 * kMaxQuotedValue);
}

// A limit of one device (or all): a size, not zero. `where` is "" or "device 0: ".
bool parseLimitBytes(std::string_view text, const std::string& where, uint64_t* out,
                     std::string* reason) {
  std::string err;
  uint64_t bytes = 0;
  if (!parseSize(text, &bytes, &err)) return fail(reason, where + err);
  if (bytes == 0)
    return fail(reason, where + "a limit of " + quote(trim(text)) +
                            " would deny every allocation; unset the variable for no limit");
  *out = bytes;
  return true;
}

// "GPU-" or "MIG-" + 8-4-4-4-12 hex digits, any case; *out gets the prefix in upper case and the
// digits in lower case. The legacy "MIG-GPU-<uuid>/<gi>/<ci>" form is not a UUID.
bool parseGpuUuid(std::string_view key, std::string* out) {
  static constexpr size_t kLen = 4 + 36;
  const bool mig = startsWithNoCase(key, "MIG-");
  if (key.size() != kLen || !(startsWithNoCase(key, "GPU-") || mig)) return false;
  std::string u = mig ? "MIG-" : "GPU-";
  for (size_t i = 4; i < kLen; ++i) {
    const size_t j = i - 4;
    const bool dash = j == 8 || j == 13 || j == 18 || j == 23;
    if (dash ? key[i] != '-' : !isHex(key[i])) return false;
    u += lowerAscii(key[i]);
  }
  *out = std::move(u);
  return true;
}

bool parseDeviceKey(std::string_view key, MemoryLimitSpec::Entry* e, std::string* reason) {
  if (key.empty()) return fail(reason, "an item has no device before '='");
  if (startsWithNoCase(key, "GPU-") || startsWithNoCase(key, "MIG-")) {
    if (!parseGpuUuid(key, &e->uuid)) {
      const bool mig = startsWithNoCase(key, "MIG-");
      return fail(reason, "malformed UUID " + quote(key) + ": expected " + (mig ? "MIG" : "GPU") +
                              "-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (hex digits), as nvidia-smi -L prints it" +
                              (mig ? " (not the legacy MIG-GPU-<uuid>/<gi>/<ci> form)" : ""));
    }
    return true;
  }
  for (char c : key)
    if (!isDigit(c))
      return fail(reason, "device " + quote(key) +
                              " is neither a non-negative integer ordinal nor GPU-<uuid> or MIG-<uuid>");
  int64_t v = 0;
  if (!parseInt(key, 0, INT_MAX, &v, nullptr))
    return fail(reason, "device ordinal " + quote(key) + " is too large");
  e->ordinal = static_cast<int>(v);
  return true;
}

bool parsePerDevice(std::string_view s, MemoryLimitSpec* out, std::string* reason) {
  std::vector<MemoryLimitSpec::Entry> entries;
  size_t index = 0;
  for (size_t pos = 0;;) {
    const size_t comma = s.find(',', pos);
    const std::string_view raw =
        s.substr(pos, comma == std::string_view::npos ? s.npos : comma - pos);
    ++index;
    const std::string_view item = trim(raw);
    if (item.empty())
      return fail(reason, "item " + std::to_string(index) +
                              " is empty (two commas in a row, or a comma at either end)");
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      return fail(reason, "item " + quote(item) +
                              " has no '=': give one size for all devices, or a list of "
                              "<ordinal>=<size> and GPU-<uuid>=<size>");
    const std::string_view key = trim(item.substr(0, eq));
    MemoryLimitSpec::Entry e;
    if (!parseDeviceKey(key, &e, reason)) return false;
    if (!parseLimitBytes(item.substr(eq + 1), "device " + quote(key) + ": ", &e.bytes, reason))
      return false;
    for (const MemoryLimitSpec::Entry& prev : entries) {
      const bool same = e.uuid.empty() ? prev.ordinal == e.ordinal : sameDeviceUuid(prev.uuid, e.uuid);
      if (same)
        return fail(reason, "duplicate device " + quote(key) + ": " +
                                (e.uuid.empty() ? "ordinal " + std::to_string(e.ordinal)
                                                : e.uuid + " (UUIDs compare case-insensitively)") +
                                " already has a limit");
    }
    entries.push_back(std::move(e));
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  out->kind = MemoryLimitSpec::kPerDevice;
  out->all = 0;
  out->entries = std::move(entries);
  return true;
}

// One of names[] exactly; a hint when only the case differs.
template <size_t N>
bool parseName(std::string_view text, const char* const (&names)[N], int* index,
               std::string* reason) {
  if (text.empty()) return fail(reason, "empty; unset the variable for the default");
  std::string list;
  for (size_t i = 0; i < N; ++i) {
    if (text == names[i]) {
      *index = static_cast<int>(i);
      return true;
    }
    list += (i ? ", " : "") + std::string(names[i]);
  }
  std::string why = quote(text) + " is not one of " + list + " (lower case)";
  for (size_t i = 0; i < N; ++i) {
    const std::string_view n = names[i];
    if (n.size() == text.size() && startsWithNoCase(text, n))
      why += "; did you mean '" + std::string(n) + "'?";
  }
  return fail(reason, why);
}

constexpr const char* kPriorityNames[] = {"high", "normal", "low"};
constexpr const char* kLogLevelNames[] = {"error", "warn", "info", "debug", "trace"};
constexpr const char* kMeteringNames[] = {"events", "cupti", "auto"};

}  // namespace

bool startsWithNoCase(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i)
    if (lowerAscii(s[i]) != lowerAscii(prefix[i])) return false;
  return true;
}

std::string firstMigEntry(std::string_view visible) {
  while (!visible.empty()) {
    const size_t comma = visible.find(',');
    const std::string_view item = trim(visible.substr(0, comma));
    if (startsWithNoCase(item, "MIG-")) return std::string(item);
    visible = comma == std::string_view::npos ? std::string_view() : visible.substr(comma + 1);
  }
  return "";
}

bool parseMemoryLimit(std::string_view text, MemoryLimitSpec* out, std::string* reason) {
  const std::string_view s = trim(text);
  if (s.empty()) return fail(reason, "empty; unset the variable for no limit");
  if (s.find('=') == s.npos && s.find(',') == s.npos) {
    uint64_t bytes = 0;
    if (!parseLimitBytes(s, "", &bytes, reason)) return false;
    out->kind = MemoryLimitSpec::kAll;
    out->all = bytes;
    out->entries.clear();
    return true;
  }
  return parsePerDevice(s, out, reason);
}

bool parseTenant(std::string_view text, std::string* out, std::string* reason) {
  if (text.empty()) return fail(reason, "empty; unset the variable for tenant 'default'");
  if (text.size() > kMaxTenant)
    return fail(reason, std::to_string(text.size()) + " characters, at most " +
                            std::to_string(kMaxTenant) + " allowed");
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool ok = isDigit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok)
      return fail(reason, "character " + quote(text.substr(i, 1)) + " at position " +
                              std::to_string(i + 1) + " is not allowed (use A-Z a-z 0-9 . _ -)");
  }
  if (text == "." || text == "..")
    return fail(reason, quote(text) + " is not allowed (tenant names are used in file names)");
  *out = std::string(text);
  return true;
}

bool parseThreadPercentage(std::string_view text, int* out, std::string* reason) {
  if (trim(text).empty()) return fail(reason, "empty; unset the variable for no compute share");
  int64_t v = 0;
  if (!parseInt(text, INT64_MIN, INT64_MAX, &v, nullptr))
    return fail(reason, "expected a whole percentage 1..100 (without '%')");
  if (v < 1 || v > 100) return fail(reason, std::to_string(v) + " is out of range 1..100");
  *out = static_cast<int>(v);
  return true;
}

bool parsePriority(std::string_view text, Priority* out, std::string* reason) {
  int i = 0;
  if (!parseName(text, kPriorityNames, &i, reason)) return false;
  *out = static_cast<Priority>(i);
  return true;
}

bool parseLogLevel(std::string_view text, LogLevel* out, std::string* reason) {
  int i = 0;
  if (!parseName(text, kLogLevelNames, &i, reason)) return false;
  *out = static_cast<LogLevel>(i);
  return true;
}

bool parseRequireBroker(std::string_view text, bool* out, std::string* reason) {
  if (text == "1" || text == "0") {
    *out = text == "1";
    return true;
  }
  return fail(reason, quote(text) + " is not 1 (refuse to run without a broker) or 0");
}

bool parseMetering(std::string_view text, MeteringSource* out, std::string* reason) {
  int i = 0;
  if (!parseName(text, kMeteringNames, &i, reason)) return false;
  *out = static_cast<MeteringSource>(i);
  return true;
}

bool parseLedgerDir(std::string_view text, std::string* out, std::string* reason) {
  if (text.empty()) return fail(reason, "empty; unset the variable for /dev/shm/cushare");
  if (text.front() != '/') return fail(reason, "not an absolute path (it must start with '/')");
  if (text.size() > kMaxLedgerDir)
    return fail(reason, "path of " + std::to_string(text.size()) + " bytes, at most " +
                            std::to_string(kMaxLedgerDir) + " allowed");
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7f)
      return fail(reason, "control character at position " + std::to_string(i + 1));
  }
  std::string_view d = text;
  while (d.size() > 1 && d.back() == '/') d.remove_suffix(1);  // "/x/" and "/x" are one dir
  *out = std::string(d);
  return true;
}

bool parseMpsPipeDir(std::string_view text, std::string* out, std::string* reason) {
  constexpr size_t kMaxPipeDir = 99;  // "<dir>/control" must fit sockaddr_un's 107 bytes
  std::string dir;
  if (text.empty()) return fail(reason, "empty; unset the variable for the broker's pipe_dir");
  if (!parseLedgerDir(text, &dir, reason)) return false;
  if (dir.size() > kMaxPipeDir)
    return fail(reason, "path of " + std::to_string(dir.size()) + " bytes, at most " +
                            std::to_string(kMaxPipeDir) + " allowed (<dir>/control must fit a Unix socket address)");
  *out = std::move(dir);
  return true;
}

bool loadShimConfig(const std::function<const char*(const char*)>& getenv, ShimConfig* out,
                    std::string* error) {
  ShimConfig c;
  std::string reason;
  const char* var = nullptr;
  const char* v = nullptr;
  auto bad = [&]() {
    if (error) *error = errorLine(var, v, reason);
    return false;
  };
  // Returns the value of name (nullptr when unset) and remembers it for bad().
  auto get = [&](const char* name) {
    var = name;
    v = getenv(name);
    return v;
  };
  if (get("CUSHARE_TENANT") && !parseTenant(v, &c.tenant, &reason)) return bad();
  if (get("CUSHARE_MEMORY_LIMIT") && !parseMemoryLimit(v, &c.memory, &reason)) return bad();
  if (get("CUSHARE_THREAD_PERCENTAGE")) {
    int p = 0;
    if (!parseThreadPercentage(v, &p, &reason)) return bad();
    c.threadPercentage = p;
  }
  if (get("CUSHARE_PRIORITY") && !parsePriority(v, &c.priority, &reason)) return bad();
  if (get("CUSHARE_LEDGER_DIR") && !parseLedgerDir(v, &c.ledgerDir, &reason)) return bad();
  if (get("CUSHARE_LOG_LEVEL") && !parseLogLevel(v, &c.logLevel, &reason)) return bad();
  if (get("CUSHARE_REQUIRE_BROKER") && !parseRequireBroker(v, &c.requireBroker, &reason)) return bad();
  if (get("CUSHARE_METERING") && !parseMetering(v, &c.metering, &reason)) return bad();
  c.meteringSet = get("CUSHARE_METERING") != nullptr;
  if (get("CUSHARE_MPS_PIPE_DIR") && !parseMpsPipeDir(v, &c.mpsPipeDir, &reason)) return bad();
  *out = std::move(c);
  return true;
}

bool resolveMemoryLimits(const MemoryLimitSpec& spec, int deviceCount,
                         const std::function<bool(int, std::string*)>& uuidOf,
                         std::vector<uint64_t>* limits, std::string* error) {
  auto failLine = [&](const std::string& why) {
    if (error) *error = "cushare: CUSHARE_MEMORY_LIMIT: " + why;
    return false;
  };
  if (deviceCount < 0) return failLine("invalid device count " + std::to_string(deviceCount));
  const size_t n = static_cast<size_t>(deviceCount);
  std::vector<uint64_t> r(n, kUnlimited);
  if (spec.kind == MemoryLimitSpec::kAll) r.assign(n, spec.all);
  if (spec.kind == MemoryLimitSpec::kPerDevice) {
    // UUIDs of the visible devices, read only when some entry needs them.
    std::vector<std::string> uuids;
    std::vector<int> unreadable;
    std::vector<int> namedBy(n, -1);  // index of the entry that set each device's limit
    std::string unseen;               // the first UUID that matches no visible device
    for (size_t i = 0; i < spec.entries.size(); ++i) {
      const MemoryLimitSpec::Entry& e = spec.entries[i];
      int dev = -1;
      if (e.uuid.empty()) {
        if (e.ordinal < 0 || e.ordinal >= deviceCount)
          return failLine("names device " + std::to_string(e.ordinal) + ", but the process sees " +
                          (deviceCount == 0 ? std::string("no devices")
                                            : std::to_string(deviceCount) + " device" +
                                                  (deviceCount == 1 ? "" : "s") + " (ordinals 0.." +
                                                  std::to_string(deviceCount - 1) + ")"));
        dev = e.ordinal;
      } else {
        if (uuids.empty() && n > 0) {
          uuids.resize(n);
          for (int d = 0; d < deviceCount; ++d)
            if (!uuidOf || !uuidOf(d, &uuids[d])) {
              uuids[d].clear();
              unreadable.push_back(d);
            }
        }
        for (size_t d = 0; d < uuids.size(); ++d)
          if (sameDeviceUuid(uuids[d], e.uuid)) dev = static_cast<int>(d);
        if (dev < 0 && !unreadable.empty())
          return failLine("unknown device " + e.uuid + ": no visible device has this UUID (the UUID of device " +
                          std::to_string(unreadable.front()) + " could not be read)");
        if (dev < 0) {  // a device this process cannot see (judged below, once all are matched)
          if (unseen.empty()) unseen = e.uuid;
          continue;
        }
      }
      if (namedBy[dev] >= 0) {
        const MemoryLimitSpec::Entry& p = spec.entries[namedBy[dev]];
        const std::string first = p.uuid.empty() ? "ordinal " + std::to_string(p.ordinal) : p.uuid;
        return failLine("device " + std::to_string(dev) + " is named twice, as " + first +
                        " and as " +
                        (e.uuid.empty() ? "ordinal " + std::to_string(e.ordinal) : e.uuid));
      }
      namedBy[dev] = static_cast<int>(i);
      r[dev] = e.bytes;
    }
    // A UUID of a device the process cannot see (CUDA_VISIBLE_DEVICES, a container's subset) is
    // harmless while every device it does see has its limit; otherwise it may be a mistyped
    // UUID whose device would silently go unlimited.
    for (size_t d = 0; d < n && !unseen.empty(); ++d)
      if (namedBy[d] < 0)
        return failLine("unknown device " + unseen + ": no visible device has this UUID, and device " +
                        std::to_string(d) + (uuids.empty() || uuids[d].empty() ? "" : " (" + uuids[d] + ")") +
                        " is not named (a mistyped UUID must not leave a device unlimited)");
  }
  *limits = std::move(r);
  return true;
}

bool memoryLimitOfUuid(const MemoryLimitSpec& spec, const std::string& uuid, uint64_t* limit,
                       std::string* error) {
  *limit = spec.kind == MemoryLimitSpec::kAll ? spec.all : kUnlimited;
  if (spec.kind != MemoryLimitSpec::kPerDevice) return true;
  bool ordinals = false;
  for (const MemoryLimitSpec::Entry& e : spec.entries) {
    if (sameDeviceUuid(e.uuid, uuid)) {
      *limit = e.bytes;
      return true;
    }
    ordinals = ordinals || e.uuid.empty();
  }
  if (ordinals && error)
    *error = "cushare: CUSHARE_MEMORY_LIMIT names devices by ordinal, which cannot be matched to "
             "NVML's device " + uuid + " before cuInit; name the devices by UUID (GPU-...=SIZE)";
  return !ordinals;
}

bool parseGpuUuidBytes(std::string_view text, unsigned char bytes[16]) {
  std::string u;
  if (!parseGpuUuid(text, &u)) return false;
  auto nibble = [](char c) { return isDigit(c) ? c - '0' : c - 'a' + 10; };
  size_t i = 4;
  for (int b = 0; b < 16; ++b) {
    if (u[i] == '-') ++i;
    bytes[b] = static_cast<unsigned char>(nibble(u[i]) << 4 | nibble(u[i + 1]));
    i += 2;
  }
  return true;
}

std::string formatGpuUuid(const unsigned char bytes[16]) { return formatDeviceUuid(bytes, false); }

bool sameDeviceUuid(std::string_view a, std::string_view b) {
  unsigned char x[16], y[16];
  return parseGpuUuidBytes(a, x) && parseGpuUuidBytes(b, y) && std::memcmp(x, y, 16) == 0;
}

std::string formatDeviceUuid(const unsigned char bytes[16], bool mig) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s = mig ? "MIG-" : "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += kHex[bytes[i] >> 4];
    s += kHex[bytes[i] & 15];
  }
  return s;
}

bool isShimVariable(std::string_view name) {
  for (const char* known : kShimVariables)
    if (name == known) return true;
  return false;
}

const char* priorityName(Priority p) { return kPriorityNames[static_cast<int>(p)]; }
const char* logLevelName(LogLevel l) { return kLogLevelNames[static_cast<int>(l)]; }
const char* meteringName(MeteringSource m) { return kMeteringNames[static_cast<int>(m)]; }

}  // namespace cushare
