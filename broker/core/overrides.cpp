// See overrides.h.
#include "core/overrides.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/devices.h"
#include "cushare/ledger.h"
#include "cushare/parse.h"
#include "cushare/shim_config.h"

namespace cushare::broker {
namespace {

constexpr char kHeader[] = "cushare-broker-state 1";

}  // namespace

bool loadOverrides(const std::string& path, Overrides* out, std::string* err) {
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT) {
      out->clear();
      return true;
    }
    *err = path + ": cannot read: " + std::strerror(errno);
    return false;
  }
  Overrides o;
  std::string line;
  int n = 0;
  auto bad = [&](const std::string& why) {
    *err = path + ":" + std::to_string(n) + ": " + why +
           " (written by the broker; remove the file to fall back to the configured limits)";
    return false;
  };
  while (std::getline(in, line)) {
    ++n;
    if (n == 1) {
      if (line != kHeader) return bad("expected the header '" + std::string(kHeader) + "'");
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string verb, tenant, uuid, bytes, extra;
    fields >> verb >> tenant >> uuid >> bytes;
    if (verb != "limit" || bytes.empty() || (fields >> extra))
      return bad("expected 'limit <tenant> <GPU-uuid> <bytes>'");
    std::string why;
    if (!Ledger::validTenantName(tenant, &why)) return bad(why);
    uint8_t raw[16];
    if (!parseGpuUuid(uuid, raw)) return bad("'" + printable(uuid, 64) + "' is not a GPU UUID");
    uuid = formatGpuUuid(raw);  // the one spelling the broker compares (a hand edit may differ)
    int64_t v = 0;
    if (!parseInt(bytes, 0, INT64_MAX, &v, &why)) return bad("bytes: " + why);
    o[tenant][uuid] = static_cast<uint64_t>(v);
  }
  if (n == 0) return bad("empty file");
  *out = std::move(o);
  return true;
}

bool saveOverrides(const std::string& path, const Overrides& o, std::string* err) {
  std::ostringstream text;
  text << kHeader << "\n# live limits set with `cushare set-limit`; written by cushare-broker\n";
  for (const auto& [tenant, devices] : o)
    for (const auto& [uuid, bytes] : devices) text << "limit " << tenant << " " << uuid << " " << bytes << "\n";
  const std::string data = text.str();
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  bool ok = fd >= 0;
  for (size_t off = 0; ok && off < data.size();) {
    const ssize_t w = ::write(fd, data.data() + off, data.size() - off);
    if (w < 0 && errno == EINTR) continue;
    ok = w > 0;
    if (ok) off += static_cast<size_t>(w);
  }
  ok = ok && ::fsync(fd) == 0;
  const int e = errno;
  if (fd >= 0) ::close(fd);
  if (ok && ::rename(tmp.c_str(), path.c_str()) == 0) return true;
  *err = "cannot write the state file " + path + ": " + std::strerror(ok ? errno : e);
  ::unlink(tmp.c_str());
  return false;
}

}  // namespace cushare::broker
