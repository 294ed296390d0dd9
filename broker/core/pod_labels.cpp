// Pods in the metrics; see pod_labels.h.
#include "core/pod_labels.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <climits>
#include <cstdlib>

#include <fstream>
#include <iterator>
#include <vector>

#include "core/log.h"
#include "core/snapshot.h"

namespace cushare::broker {
namespace {

constexpr char kResourcePrefix[] = "cushare.io/";
constexpr size_t kMaxMountinfo = 1 << 20;  // a process's mount table read at most this far

// proc(5): mountinfo escapes space, tab, newline and backslash as \ooo (three octal digits).
std::string unescape(std::string_view s) {
  const auto octal = [](char c) { return c >= '0' && c <= '7'; };
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && octal(s[i + 1]) && octal(s[i + 2]) && octal(s[i + 3])) {
      out.push_back(static_cast<char>(((s[i + 1] - '0') << 6) | ((s[i + 2] - '0') << 3) | (s[i + 3] - '0')));
      i += 3;
      continue;
    }
    out.push_back(s[i]);
  }
  return out;
}

std::vector<std::string_view> fields(std::string_view line) {
  std::vector<std::string_view> f;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    const size_t start = i;
    while (i < line.size() && line[i] != ' ') ++i;
    if (i > start) f.push_back(line.substr(start, i - start));
  }
  return f;
}

bool number(std::string_view s, unsigned* out) {
  if (s.empty() || s.size() > 9) return false;
  unsigned v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  *out = v;
  return true;
}

}  // namespace

bool deviceIdOfDirName(std::string_view name, std::string* deviceId) {
  const size_t sep = name.rfind('_');
  if (sep == std::string_view::npos || sep == 0 || sep + 1 == name.size()) return false;
  unsigned n = 0;
  if (!number(name.substr(sep + 1), &n)) return false;
  const std::string_view uuid = name.substr(0, sep);
  for (char c : uuid)
    if (c == '/' || c == ':' || static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return false;
  if (uuid == "." || uuid == "..") return false;
  *deviceId = std::string(uuid) + "::" + std::string(name.substr(sep + 1));
  return true;
}

namespace {

// A mount table, at most kMaxMountinfo bytes of it (a process can grow its own table; what lies
// beyond is ignored, and the allocation mount, made by the runtime first, lies before it).
std::string readMountinfo(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  char buf[16384];
  while (in && text.size() < kMaxMountinfo) {
    in.read(buf, sizeof buf);
    text.append(buf, static_cast<size_t>(in.gcount()));
  }
  if (text.size() > kMaxMountinfo) text.resize(kMaxMountinfo);
  return text;
}

bool onDevice(std::string_view dev, unsigned major, unsigned minor) {
  const size_t colon = dev.find(':');
  unsigned ma = 0, mi = 0;
  return colon != std::string_view::npos && number(dev.substr(0, colon), &ma) && number(dev.substr(colon + 1), &mi) &&
         ma == major && mi == minor;
}

// Calls f(fields) for each line of a mountinfo text with at least 5 fields.
template <typename F>
void eachMount(std::string_view text, F f) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::vector<std::string_view> line = fields(text.substr(pos, end - pos));
    pos = end + 1;
    if (line.size() >= 5) f(line);
  }
}

}  // namespace

std::optional<AllocationMount> allocationFromMountinfo(std::string_view text, unsigned major, unsigned minor,
                                                       std::string_view dirInFs) {
  std::optional<std::vector<std::string_view>> last;  // the last mount at the mount point
  eachMount(text, [&](const std::vector<std::string_view>& f) {
    if (unescape(f[4]) == kAllocationMountPoint) last = f;
  });
  if (!last || !onDevice((*last)[2], major, minor)) return std::nullopt;
  const std::string root = unescape((*last)[3]);
  // <dirInFs>/<tenant>/<uuid>_<n>, exactly
  const std::string prefix = dirInFs == "/" ? "/" : std::string(dirInFs) + "/";
  if (root.size() <= prefix.size() || root.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const std::string rest = root.substr(prefix.size());
  const size_t slash = rest.find('/');
  if (slash == std::string::npos || rest.find('/', slash + 1) != std::string::npos) return std::nullopt;
  AllocationMount m;
  m.tenant = rest.substr(0, slash);
  if (m.tenant.empty() || m.tenant == "." || m.tenant == "..") return std::nullopt;
  if (!deviceIdOfDirName(std::string_view(rest).substr(slash + 1), &m.deviceId)) return std::nullopt;
  return m;
}

std::optional<std::string> pathWithinFilesystem(std::string_view selfMountinfo, const std::string& dir,
                                                unsigned major, unsigned minor) {
  std::optional<std::string> best;
  size_t bestLength = 0;
  eachMount(selfMountinfo, [&](const std::vector<std::string_view>& f) {
    const std::string point = unescape(f[4]);
    const bool holds = point == "/" || dir == point || (dir.size() > point.size() && dir.compare(0, point.size(), point) == 0 &&
                                                        dir[point.size()] == '/');
    // The closest mount point, and of those the last (a later mount hides an earlier one).
    if (!holds || point.size() < bestLength) return;
    bestLength = point.size();
    if (!onDevice(f[2], major, minor)) {
      best.reset();
      return;
    }
    const std::string root = unescape(f[3]);
    const std::string rest = point == "/" ? dir : dir.substr(point.size());  // "" or "/..."
    best = root == "/" ? (rest.empty() ? "/" : rest) : root + rest;
  });
  return best;
}

PodLabeler::PodLabeler(std::string allocationDir, Lookup lookup, std::function<Status()> status)
    : dir_(std::move(allocationDir)), lookup_(std::move(lookup)), status_(std::move(status)) {}

void PodLabeler::label(BrokerSnapshot* s) {
  s->podLabels.on = true;
  const Status st = status_();
  s->podLabels.up = st.up;
  s->podLabels.error = st.error;
  char real[PATH_MAX];
  struct stat root {};
  if (::realpath(dir_.c_str(), real) == nullptr || ::stat(real, &root) != 0 || !S_ISDIR(root.st_mode)) return;
  const unsigned major = ::major(root.st_dev), minor = ::minor(root.st_dev);
  const std::optional<std::string> dirInFs = pathWithinFilesystem(readMountinfo("/proc/self/mountinfo"), real, major, minor);
  if (!dirInFs) return;
  std::set<int> seen;
  for (TenantSnapshot& t : s->tenants)
    for (ProcessSnapshot& p : t.processes) {
      if (p.hostPid <= 0) continue;
      seen.insert(p.hostPid);
      // The slot's holder as the snapshot saw it: a pid reused since then names another process,
      // whose mounts must then pass the same checks (its tenant's directory, the kubelet's list).
      const std::optional<AllocationMount> m =
          allocationFromMountinfo(readMountinfo("/proc/" + std::to_string(p.hostPid) + "/mountinfo"), major, minor, *dirInFs);
      if (!m) continue;
      if (m->tenant != t.name) {
        // Once per process, and within a budget: a tenant can start such processes at will.
        std::lock_guard<std::mutex> g(mu_);
        std::string more;
        if (warned_.insert(p.hostPid).second && logLimit_.allow(&more))
          CUSHARE_BLOG(warn,
                       "kubernetes: process {} of tenant {} has tenant {}'s allocation mounted (a pod that asked "
                       "for cushare.io/{} runs as {}'s user): it gets no pod labels{}",
                       p.hostPid, t.name, m->tenant, m->tenant, t.name, more);
        continue;
      }
      struct stat d {};
      const std::string path = dir_ + "/" + m->tenant + "/" + allocationDirName(m->deviceId);
      if (::stat(path.c_str(), &d) != 0 || !S_ISDIR(d.st_mode) || d.st_dev != root.st_dev) continue;
      if (std::optional<PodRef> pod = lookup_(kResourcePrefix + t.name, m->deviceId)) p.pod = std::move(*pod);
    }
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = warned_.begin(); it != warned_.end();) it = seen.count(*it) ? std::next(it) : warned_.erase(it);
}

}  // namespace cushare::broker
