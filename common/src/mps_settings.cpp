// See mps_settings.h. Both files are lines of "key value"; '#' starts a comment line.
#include "cushare/mps_settings.h"

#include "cushare/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <map>
#include <sstream>
#include <string_view>

#include "cushare/parse.h"

namespace cushare {
namespace {

constexpr int kFormat = 1;

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string fmtTenant(const MpsTenantSettings& s, const std::string& prefix) {
  std::string out;
  out += prefix + "threads " + (s.threads ? std::to_string(*s.threads) : std::string("none")) + "\n";
  out += prefix + "priority " + priorityName(s.priority) + "\n";
  for (const auto& [uuid, bytes] : s.memory)
    if (bytes != kUnlimited) out += prefix + "memory " + uuid + " " + std::to_string(bytes) + "\n";
  return out;
}

// Lines of "key value" (value: the rest of the line after one space), with their numbers.
struct Line {
  int number;
  std::string key, value;
};

bool splitLines(std::string_view text, const std::string& name, std::vector<Line>* out, std::string* err) {
  int number = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    if (nl == std::string_view::npos) {
      *err = name + ": the last line has no newline (the file is truncated)";
      return false;
    }
    const std::string_view l = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    ++number;
    if (l.empty() || l[0] == '#') continue;
    for (char c : l)
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        *err = name + ":" + std::to_string(number) + ": a control character in '" + printable(l, 64) + "'";
        return false;
      }
    const size_t sp = l.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 >= l.size()) {
      *err = name + ":" + std::to_string(number) + ": expected 'key value', found '" + printable(l, 64) + "'";
      return false;
    }
    out->push_back(Line{number, std::string(l.substr(0, sp)), std::string(l.substr(sp + 1))});
  }
  return true;
}

std::string where(const std::string& name, const Line& l) {
  return name + ":" + std::to_string(l.number) + ": " + l.key;
}

bool checkFormat(const std::vector<Line>& lines, const std::string& name, std::string* err) {
  if (lines.empty() || lines[0].key != "format") {
    *err = name + ": the first setting must be 'format " + std::to_string(kFormat) + "' (not a cushare MPS file)";
    return false;
  }
  if (lines[0].value != std::to_string(kFormat)) {
    *err = where(name, lines[0]) + ": format '" + printable(lines[0].value, 16) + "' is not " +
           std::to_string(kFormat) + " (a broker of another version wrote it)";
    return false;
  }
  return true;
}

// One tenant field (threads, priority, memory) into *s; *known false for another key.
bool tenantField(const Line& l, const std::string& key, const std::string& name, MpsTenantSettings* s,
                 bool* known, std::string* err) {
  std::string reason;
  *known = true;
  if (key == "threads") {
    int pct = 0;
    if (l.value == "none") s->threads.reset();
    else if (parseThreadPercentage(l.value, &pct, &reason)) s->threads = pct;
    else return *err = where(name, l) + ": " + reason, false;
    return true;
  }
  if (key == "priority") {
    if (!parsePriority(l.value, &s->priority, &reason)) return *err = where(name, l) + ": " + reason, false;
    return true;
  }
  if (key == "memory") {
    const size_t sp = l.value.find(' ');
    unsigned char bytes[16];
    int64_t n = 0;
    // A GPU's UUID, or a MIG device's (its own daemon's clients: MpsHostSettings::mig).
    const bool mig = l.value.compare(0, 4, "MIG-") == 0;
    if (sp == std::string::npos || (!mig && l.value.compare(0, 4, "GPU-") != 0) ||
        !parseGpuUuidBytes(l.value.substr(0, sp), bytes)) {
      *err = where(name, l) + ": expected 'GPU-<uuid> <bytes>' or 'MIG-<uuid> <bytes>', found '" +
             printable(l.value, 64) + "'";
      return false;
    }
    if (!parseInt(l.value.substr(sp + 1), 0, INT64_MAX, &n, &reason)) return *err = where(name, l) + ": " + reason, false;
    const std::string uuid = formatDeviceUuid(bytes, mig);
    for (const auto& e : s->memory)
      if (sameDeviceUuid(e.first, uuid)) return *err = where(name, l) + ": device " + uuid + " is listed twice", false;
    s->memory.emplace_back(uuid, static_cast<uint64_t>(n));
    return true;
  }
  *known = false;
  return true;
}

// A count with an optional binary unit, as the driver reads CUDA_MPS_PINNED_DEVICE_MEM_LIMIT:
// "1G", "512MB", "512M", "1048576".
bool parseMpsSize(const std::string& v, uint64_t* out) {
  size_t i = 0;
  uint64_t n = 0;
  for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) {
    if (n > (UINT64_MAX - 9) / 10) return false;
    n = n * 10 + static_cast<uint64_t>(v[i] - '0');
  }
  if (i == 0) return false;
  std::string unit = v.substr(i);
  if (unit.size() == 2 && (unit[1] == 'B' || unit[1] == 'b')) unit.pop_back();
  int shift = 0;
  if (unit == "K" || unit == "k") shift = 10;
  else if (unit == "M" || unit == "m") shift = 20;
  else if (unit == "G" || unit == "g") shift = 30;
  else if (unit == "T" || unit == "t") shift = 40;
  else if (!unit.empty()) return false;
  if (n > (UINT64_MAX >> shift)) return false;
  *out = n << shift;
  return n != 0;
}

std::string mpsSize(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 20)) return std::to_string(bytes >> 20) + "M";  // rounded down
  return std::to_string(bytes >= 1024 ? bytes >> 10 : 1) + "K";
}

int readFile(const std::string& dir, const std::string& file, std::string* text, std::string* err) {
  const std::string path = dir + "/" + file;
  struct stat ds, st, ls;
  // In a sticky directory others may write (unknown tenants admitted) anyone can create an entry
  // under these names: one the directory's owner (the broker) did not make is not the broker's
  // word, and is as good as absent (never a reason to refuse every process of the host).
  if (::lstat(path.c_str(), &ls) == 0 && ::stat(dir.c_str(), &ds) == 0 && ls.st_uid != ds.st_uid) return 0;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) return 0;  // no such file, or no directory (yet)
    *err = sysErr("cannot open " + path);
    return -1;
  }
  int r = -1;
  if (::stat(dir.c_str(), &ds) != 0) {
    *err = sysErr("cannot access " + dir);
  } else if (::fstat(fd, &st) != 0) {
    *err = sysErr("cannot stat " + path);
  } else if (!S_ISREG(st.st_mode)) {
    *err = path + " is not a regular file";
  } else if (st.st_uid != ds.st_uid || (st.st_mode & 022) != 0) {
    *err = path + " was not written by the broker (owner uid " + std::to_string(st.st_uid) + ", the directory's " +
           std::to_string(ds.st_uid) + "; mode " + std::to_string(st.st_mode & 0777) + " decimal): refused";
  } else if (static_cast<uint64_t>(st.st_size) > kMaxMpsFileBytes) {
    *err = path + " is larger than " + std::to_string(kMaxMpsFileBytes) + " bytes";
  } else {
    text->resize(static_cast<size_t>(st.st_size));
    const ssize_t n = ::pread(fd, text->data(), text->size(), 0);
    if (n == static_cast<ssize_t>(text->size())) r = 1;
    else *err = n < 0 ? sysErr("cannot read " + path) : path + ": short read";
  }
  ::close(fd);
  return r;
}

}  // namespace

std::string formatMpsHost(const MpsHostSettings& s) {
  std::string out = "# written by cushare-broker: MPS is on (docs/mps.md); do not edit\nformat 1\n";
  out += "pipe_dir " + s.pipeDir + "\n";
  if (s.pipeDev != 0 || s.pipeIno != 0)
    out += "pipe_id " + std::to_string(s.pipeDev) + ":" + std::to_string(s.pipeIno) + "\n";
  out += "context_reserve " + std::to_string(s.contextReserve) + "\n";
  out += std::string("unknown_tenants ") + (s.unknown ? "admit" : "refuse") + "\n";
  if (s.unknown) out += fmtTenant(*s.unknown, "unknown_");
  if (!s.wholeGpus) out += "whole_gpus no\n";
  for (const MpsHostSettings::MigDaemon& m : s.mig)
    out += "mig_daemon " + m.uuid + " " + m.gpuUuid + " " + std::to_string(m.gi) + " " + std::to_string(m.ci) + "\n";
  return out;
}

std::string formatMpsTenant(const MpsTenantSettings& s) {
  return "# written by cushare-broker: this tenant's MPS client settings (docs/mps.md)\nformat 1\n" +
         fmtTenant(s, "");
}

bool parseMpsHost(std::string_view text, const std::string& name, MpsHostSettings* out, std::string* err) {
  std::vector<Line> lines;
  if (!splitLines(text, name, &lines, err) || !checkFormat(lines, name, err)) return false;
  MpsHostSettings s;
  bool pipe = false, reserve = false, policy = false;
  MpsTenantSettings unknown;
  bool unknownFields = false;
  std::map<std::string, int> seen;
  for (size_t i = 1; i < lines.size(); ++i) {
    const Line& l = lines[i];
    if (l.key != "unknown_memory" && l.key != "mig_daemon" && seen[l.key]++)
      return *err = where(name, l) + ": set twice", false;
    std::string reason;
    if (l.key == "pipe_dir") {
      if (l.value[0] != '/' || l.value.size() > kMaxMpsPipeDir)
        return *err = where(name, l) + ": expected an absolute path of at most " + std::to_string(kMaxMpsPipeDir) +
                      " bytes, found '" + printable(l.value, 64) + "'", false;
      s.pipeDir = l.value;
      pipe = true;
    } else if (l.key == "pipe_id") {
      const size_t colon = l.value.find(':');
      int64_t dev = 0, ino = 0;
      if (colon == std::string::npos || !parseInt(l.value.substr(0, colon), 0, INT64_MAX, &dev, &reason) ||
          !parseInt(l.value.substr(colon + 1), 1, INT64_MAX, &ino, &reason))
        return *err = where(name, l) + ": expected <device>:<inode> of the pipe directory, found '" +
                      printable(l.value, 64) + "'", false;
      s.pipeDev = static_cast<uint64_t>(dev);
      s.pipeIno = static_cast<uint64_t>(ino);
    } else if (l.key == "context_reserve") {
      int64_t n = 0;
      if (!parseInt(l.value, 0, INT64_MAX, &n, &reason)) return *err = where(name, l) + ": " + reason, false;
      s.contextReserve = static_cast<uint64_t>(n);
      reserve = true;
    } else if (l.key == "whole_gpus") {
      if (l.value != "yes" && l.value != "no")
        return *err = where(name, l) + ": expected 'yes' or 'no', found '" + printable(l.value, 32) + "'", false;
      s.wholeGpus = l.value == "yes";
    } else if (l.key == "mig_daemon") {
      // MIG-<uuid> GPU-<uuid> <gi> <ci>
      std::istringstream in(l.value);
      std::string uuid, gpu, extra;
      int64_t gi = -1, ci = -1;
      std::string giText, ciText;
      unsigned char b[16];
      in >> uuid >> gpu >> giText >> ciText;
      if (uuid.rfind("MIG-", 0) != 0 || !parseGpuUuidBytes(uuid, b) || gpu.rfind("GPU-", 0) != 0 ||
          !parseGpuUuidBytes(gpu, b) || !parseInt(giText, 0, 14, &gi, &reason) || !parseInt(ciText, 0, 7, &ci, &reason) ||
          (in >> extra))
        return *err = where(name, l) + ": expected MIG-<uuid> GPU-<uuid> <gpu instance> <compute instance>, found '" +
                      printable(l.value, 120) + "'", false;
      for (const MpsHostSettings::MigDaemon& m : s.mig)
        if (sameDeviceUuid(m.uuid, uuid)) return *err = where(name, l) + ": " + uuid + " listed twice", false;
      s.mig.push_back({uuid, gpu, static_cast<unsigned>(gi), static_cast<unsigned>(ci)});
    } else if (l.key == "unknown_tenants") {
      if (l.value != "admit" && l.value != "refuse")
        return *err = where(name, l) + ": expected 'admit' or 'refuse', found '" + printable(l.value, 32) + "'", false;
      if (l.value == "admit") s.unknown = MpsTenantSettings{};
      policy = true;
    } else {
      bool known = false;
      if (l.key.rfind("unknown_", 0) == 0 && !tenantField(l, l.key.substr(8), name, &unknown, &known, err))
        return false;
      if (!known) return *err = where(name, l) + ": unknown setting", false;
      unknownFields = true;
    }
  }
  if (!pipe || !reserve || !policy) {
    *err = name + ": missing " + std::string(!pipe ? "pipe_dir" : !reserve ? "context_reserve" : "unknown_tenants") +
           " (the file is incomplete)";
    return false;
  }
  if (unknownFields && !s.unknown) return *err = name + ": unknown_* settings while unknown_tenants is refuse", false;
  if (!s.mig.empty() && s.pipeDir.size() > kMaxMpsPipeDirWithMig)
    return *err = name + ": pipe_dir is longer than the " + std::to_string(kMaxMpsPipeDirWithMig) +
                  " bytes that leave room for a MIG device's daemon", false;
  if (s.unknown) *s.unknown = unknown;
  *out = std::move(s);
  return true;
}

bool parseMpsTenant(std::string_view text, const std::string& name, MpsTenantSettings* out, std::string* err) {
  std::vector<Line> lines;
  if (!splitLines(text, name, &lines, err) || !checkFormat(lines, name, err)) return false;
  MpsTenantSettings s;
  bool threads = false, priority = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const Line& l = lines[i];
    if ((l.key == "threads" && threads) || (l.key == "priority" && priority))
      return *err = where(name, l) + ": set twice", false;
    bool known = false;
    if (!tenantField(l, l.key, name, &s, &known, err)) return false;
    if (!known) return *err = where(name, l) + ": unknown setting", false;
    threads |= l.key == "threads";
    priority |= l.key == "priority";
  }
  if (!threads || !priority)
    return *err = name + ": missing " + (threads ? "priority" : "threads") + " (the file is incomplete)", false;
  *out = std::move(s);
  return true;
}

int readMpsHost(const std::string& dir, MpsHostSettings* out, std::string* err) {
  std::string text;
  const int r = readFile(dir, kMpsHostFile, &text, err);
  if (r <= 0) return r;
  return parseMpsHost(text, dir + "/" + kMpsHostFile, out, err) ? 1 : -1;
}

int readMpsTenant(const std::string& dir, const std::string& tenant, MpsTenantSettings* out, std::string* err) {
  std::string text;
  const std::string file = tenant + kMpsTenantSuffix;
  const int r = readFile(dir, file, &text, err);
  if (r <= 0) return r;
  return parseMpsTenant(text, dir + "/" + file, out, err) ? 1 : -1;
}

bool writeMpsFile(const std::string& dir, const std::string& name, const std::string& text, std::string* err) {
  const std::string path = dir + "/" + name;
  return writeFileAtomically(path, path + ".XXXXXX", text, 0644, err);
}

bool mpsClientEnv(const MpsHostSettings& host, const MpsTenantSettings& tenant, const ShimConfig& config,
                  const std::function<const char*(const char*)>& getenv, MpsClientEnv* out, std::string* err) {
  MpsClientEnv e;
  // A container sees the broker's pipe directory where it is mounted (CUSHARE_MPS_PIPE_DIR): the
  // same directory (device and inode, when the broker published them), or the process would
  // leave MPS through a directory of its own choosing.
  e.pipeDir = config.mpsPipeDir.empty() ? host.pipeDir : config.mpsPipeDir;
  if (!config.mpsPipeDir.empty() && (host.pipeDev != 0 || host.pipeIno != 0)) {
    struct stat st{};
    if (::stat(config.mpsPipeDir.c_str(), &st) != 0 || static_cast<uint64_t>(st.st_dev) != host.pipeDev ||
        static_cast<uint64_t>(st.st_ino) != host.pipeIno) {
      *err = "cushare: CUSHARE_MPS_PIPE_DIR='" + printable(config.mpsPipeDir, 64) +
             "' is not the broker's MPS pipe directory (not the directory mps.conf names, or not mounted there): "
             "refusing to leave MPS";
      return false;
    }
  }
  // A MIG device's daemon (one per MIG device): the one of the MIG device the driver will run the
  // process in, its first MIG- entry of CUDA_VISIBLE_DEVICES.
  const MpsHostSettings::MigDaemon* mine = nullptr;
  const char* visible = getenv("CUDA_VISIBLE_DEVICES");
  const std::string migEntry = firstMigEntry(visible ? visible : "");
  if (!migEntry.empty()) {
    for (const MpsHostSettings::MigDaemon& m : host.mig) {
      // MIG-<uuid>, or the legacy MIG-<GPU-UUID>/<gi>/<ci>.
      if (sameDeviceUuid(migEntry, m.uuid) ||
          (migEntry.size() > 44 && sameDeviceUuid(migEntry.substr(4, 40), m.gpuUuid) &&
           migEntry.substr(44) == "/" + std::to_string(m.gi) + "/" + std::to_string(m.ci)))
        mine = &m;
    }
    if (mine == nullptr) {
      *err = "cushare: CUDA_VISIBLE_DEVICES names the MIG device '" + printable(migEntry, 64) +
             "', for which the broker runs no MPS control daemon (a MIG device made after the broker started, or not "
             "one of this host's): refusing to run outside MPS";
      return false;
    }
    e.pipeDir += "/" + mine->uuid;
  } else if (!host.mig.empty() && !host.wholeGpus) {
    // Every device of the host is a MIG device and the process names none: the driver would pick
    // one for it (or run it where no daemon of the broker listens), outside MPS.
    *err = "cushare: this host's devices are MIG devices, each with its own MPS control daemon, and "
           "CUDA_VISIBLE_DEVICES names none: set it to the MIG device's UUID (MIG-...; the device plugin does), "
           "refusing to run outside MPS";
    return false;
  }
  // Active thread percentage: the lowest of the tenant's cap, CUSHARE_THREAD_PERCENTAGE and the
  // process's own value.
  std::optional<int> cap = tenant.threads;
  if (config.threadPercentage && (!cap || *config.threadPercentage < *cap)) cap = config.threadPercentage;
  if (const char* v = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")) {
    char* end = nullptr;
    const double own = std::strtod(v, &end);
    if (!*v || *end || !(own > 0) || own > 100) {
      *err = std::string("cushare: invalid CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='") + printable(v, 32) +
             "': expected a percentage above 0, at most 100";
      return false;
    }
    if (!cap || own < *cap) e.threads = v;
  }
  if (e.threads.empty() && cap) e.threads = std::to_string(*cap);
  // Priority: below normal (1) if the tenant, CUSHARE_PRIORITY or the process says low.
  bool low = tenant.priority == Priority::kLow || config.priority == Priority::kLow;
  if (const char* v = getenv("CUDA_MPS_CLIENT_PRIORITY")) {
    if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
      *err = std::string("cushare: invalid CUDA_MPS_CLIENT_PRIORITY='") + printable(v, 32) + "': expected 0 or 1";
      return false;
    }
    low |= v[0] == '1';
  }
  e.priority = low ? "1" : "0";
  // Pinned memory: per device the lower of the tenant's limit plus the reserve and the process's own.
  // The devices the process can reach: its MIG device, or the whole GPUs.
  const auto reachable = [&](const std::string& uuid) {
    return mine ? sameDeviceUuid(uuid, mine->uuid) && uuid.rfind("MIG-", 0) == 0 : uuid.rfind("MIG-", 0) != 0;
  };
  std::vector<std::pair<std::string, uint64_t>> limits;
  for (const auto& [uuid, bytes] : tenant.memory)
    if (bytes != kUnlimited && reachable(uuid))
      limits.emplace_back(uuid, bytes > UINT64_MAX - host.contextReserve ? UINT64_MAX : bytes + host.contextReserve);
  if (const char* v = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")) {
    const std::string all = v;
    size_t pos = 0;
    while (pos <= all.size()) {
      const size_t comma = std::min(all.find(',', pos), all.size());
      const std::string item = all.substr(pos, comma - pos);
      pos = comma + 1;
      const size_t eq = item.find('=');
      unsigned char bytes[16];
      uint64_t n = 0;
      const std::string bad = std::string("cushare: invalid CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='") + printable(all, 64) + "': ";
      if (eq == std::string::npos) return *err = bad + "'" + printable(item, 32) + "' is not <device>=<size>", false;
      const bool migItem = startsWithNoCase(item, "MIG-");
      if (migItem && (mine == nullptr || !sameDeviceUuid(item.substr(0, eq), mine->uuid)))
        return *err = bad + "'" + printable(item.substr(0, eq), 48) + "' is not the MIG device this process runs in" +
                      (mine ? " (" + mine->uuid + ")" : std::string(" (it names none in CUDA_VISIBLE_DEVICES)")),
               false;
      if (!migItem && mine != nullptr)
        return *err = bad + "this process runs in the MIG device " + mine->uuid + ": name it, not '" +
                      printable(item.substr(0, eq), 48) + "'",
               false;
      if (!parseGpuUuidBytes(item.substr(0, eq), bytes))
        return *err = bad + "under the broker's MPS, name each device by its full UUID (GPU-...), not '" +
                      printable(item.substr(0, eq), 32) + "': ordinals cannot be matched before the driver starts",
               false;
      if (!parseMpsSize(item.substr(eq + 1), &n))
        return *err = bad + "'" + printable(item.substr(eq + 1), 32) + "' is not a size such as 1G or 512M", false;
      const std::string uuid = formatDeviceUuid(bytes, migItem);
      bool merged = false;
      for (auto& l : limits)
        if (sameDeviceUuid(l.first, uuid)) l.second = std::min(l.second, n), merged = true;
      if (!merged) limits.emplace_back(uuid, n);
    }
  }
  for (const auto& [uuid, bytes] : limits) e.pinnedMem += (e.pinnedMem.empty() ? "" : ",") + uuid + "=" + mpsSize(bytes);
  *out = std::move(e);
  return true;
}

}  // namespace cushare
