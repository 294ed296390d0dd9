// The device nodes of a MIG device; see mig_nodes.h.
#include "container/mig_nodes.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cushare::container {
namespace {

constexpr unsigned kGpus = 32, kGpuInstances = 15, kComputeInstances = 8;  // the driver's table
constexpr unsigned kFirstMinor = 3;                                          // after config, monitor
constexpr size_t kMaxTableBytes = 1 << 20;

bool fail(std::string* err, std::string why) {
  if (err) *err = std::move(why);
  return false;
}

std::string capKey(unsigned gpu, unsigned gi, int ci) {
  return "gpu" + std::to_string(gpu) + "/gi" + std::to_string(gi) +
         (ci < 0 ? std::string() : "/ci" + std::to_string(ci)) + "/access";
}

}  // namespace

bool parseMigMinors(std::string_view text, MigMinors* out, std::string* err) {
  MigMinors t;
  t.fromFile = true;
  size_t lineNo = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++lineNo;
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    const std::string_view key = line.substr(0, sp), num = sp == std::string_view::npos ? "" : line.substr(sp + 1);
    unsigned value = 0;
    bool ok = !key.empty() && !num.empty() && num.size() <= 7;
    for (const char c : num) {
      ok = ok && c >= '0' && c <= '9';
      value = value * 10 + static_cast<unsigned>(c - '0');
    }
    for (const char c : key) ok = ok && c > ' ' && c < 0x7f;
    const std::string shown(line.substr(0, 80));
    if (!ok)
      return fail(err, "line " + std::to_string(lineNo) + " ('" + shown + "') is not '<capability> <minor>'");
    if (!t.minors.emplace(std::string(key), value).second)
      return fail(err, "line " + std::to_string(lineNo) + " ('" + shown + "') names " + std::string(key) + " again");
  }
  *out = std::move(t);
  return true;
}

bool loadMigMinors(const std::string& path, MigMinors* out, std::string* err) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) {
      *out = MigMinors{};
      return true;
    }
    return fail(err, "cannot read " + path + ": " + std::strerror(errno));
  }
  // A /proc file says size 0: read to the end.
  std::string text;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      return fail(err, "cannot read " + path + ": " + why);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxTableBytes) {
      ::close(fd);
      return fail(err, path + " is larger than 1 MiB");
    }
  }
  ::close(fd);
  std::string why;
  if (!parseMigMinors(text, out, &why)) return fail(err, path + ": " + why);
  return true;
}

bool migCapMinor(const MigMinors& table, unsigned gpuMinor, unsigned gi, int ci, unsigned* out, std::string* err) {
  const std::string key = capKey(gpuMinor, gi, ci);
  if (table.fromFile) {
    const auto it = table.minors.find(key);
    if (it == table.minors.end()) return fail(err, "the driver's MIG capability table has no " + key);
    *out = it->second;
    return true;
  }
  if (gpuMinor >= kGpus || gi >= kGpuInstances || ci >= static_cast<int>(kComputeInstances))
    return fail(err, "no MIG capability " + key + " in the driver's numbering");
  *out = kFirstMinor + (gpuMinor * kGpuInstances + gi) * (1 + kComputeInstances) + (ci < 0 ? 0 : 1 + ci);
  return true;
}

bool migDeviceNodes(const MigMinors& table, unsigned gpuMinor, unsigned gi, unsigned ci,
                    std::vector<std::string>* nodes, std::string* err) {
  unsigned giMinor = 0, ciMinor = 0;
  if (!migCapMinor(table, gpuMinor, gi, -1, &giMinor, err) ||
      !migCapMinor(table, gpuMinor, gi, static_cast<int>(ci), &ciMinor, err))
    return false;
  *nodes = {"/dev/nvidia" + std::to_string(gpuMinor), std::string(kCapsNodeDir) + "/nvidia-cap" + std::to_string(giMinor),
            std::string(kCapsNodeDir) + "/nvidia-cap" + std::to_string(ciMinor)};
  return true;
}

}  // namespace cushare::container
