// See overrides.h.
#include "core/overrides.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/devices.h"
#include "cushare/atomic_file.h"
#include "cushare/ledger.h"
#include "cushare/parse.h"
#include "cushare/shim_config.h"

namespace cushare::broker {
namespace {

constexpr char kHeader[] = "cushare-broker-state 1";
constexpr uint64_t kNone = UINT64_MAX;

std::string octal(unsigned mode) {
  char b[16];
  std::snprintf(b, sizeof b, "%04o", mode);
  return b;
}

// The whole file, opened without following a link, if it is the broker's own: a state file
// someone else wrote could hand a tenant another limit.
bool readOwnFile(const std::string& path, std::string* text, bool* missing, std::string* err) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  *missing = fd < 0 && errno == ENOENT;
  if (fd < 0) {
    if (*missing) return true;
    *err = path + ": cannot read: " + std::strerror(errno);
    return false;
  }
  struct stat st;
  std::string why;
  if (::fstat(fd, &st) != 0)
    why = std::string("cannot stat: ") + std::strerror(errno);
  else if (!S_ISREG(st.st_mode))
    why = "not a regular file";
  else if (st.st_uid != ::geteuid())
    why = "belongs to uid " + std::to_string(st.st_uid) + ", not to the broker's user (uid " +
          std::to_string(::geteuid()) + ")";
  else if ((st.st_mode & 022) != 0)
    why = "writable by other users (mode " + octal(st.st_mode & 07777) + ")";
  char buf[65536];
  for (ssize_t n = 0; why.empty() && (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) why = std::string("cannot read: ") + std::strerror(errno);
    else text->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (why.empty()) return true;
  *err = path + ": " + why +
         " (the state file must be the broker's own; remove it to fall back to the configured limits)";
  return false;
}

}  // namespace

bool loadState(const std::string& path, BrokerState* out, std::string* err) {
  std::string text;
  bool missing = false;
  if (!readOwnFile(path, &text, &missing, err)) return false;
  if (missing) {
    *out = BrokerState();
    return true;
  }
  BrokerState s;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  auto bad = [&](const std::string& why) {
    *err = path + ":" + std::to_string(n) + ": " + why +
           " (written by the broker; remove the file to fall back to the configured limits)";
    return false;
  };
  auto uuidField = [&](std::string* uuid) {
    uint8_t raw[16];
    if (!parseGpuUuid(*uuid, raw)) return bad("'" + printable(*uuid, 64) + "' is not a GPU or MIG device UUID");
    // The one spelling the broker compares (a hand edit may differ): GPU- or, for a MIG device, MIG-.
    const bool mig = uuid->size() > 3 && (((*uuid)[0] | 0x20) == 'm');
    *uuid = formatDeviceUuid(raw, mig);
    return true;
  };
  auto number = [&](const std::string& text, const char* what, uint64_t* v) {
    int64_t x = 0;
    std::string why;
    if (!parseInt(text, 0, INT64_MAX, &x, &why)) return bad(std::string(what) + ": " + why);
    *v = static_cast<uint64_t>(x);
    return true;
  };
  while (std::getline(in, line)) {
    ++n;
    if (n == 1) {
      if (line != kHeader) return bad("expected the header '" + std::string(kHeader) + "'");
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("ledger_dir ", 0) == 0) {
      s.ledgerDir = line.substr(std::strlen("ledger_dir "));
      continue;
    }
    std::istringstream fields(line);
    std::string verb, tenant, a, b, c, extra;
    fields >> verb >> tenant >> a >> b;
    if (verb == "file") fields >> c;
    std::string why;
    if (verb == "limit" || verb == "last") {
      if (b.empty() || (fields >> extra)) return bad("expected '" + verb + " <tenant> <GPU-uuid> <bytes>'");
      if (!Ledger::validTenantName(tenant, &why)) return bad(why);
      if (!uuidField(&a)) return false;
      uint64_t v = kNone;
      if ((verb == "limit" || b != "none") && !number(b, "bytes", &v)) return false;
      (verb == "limit" ? s.limits : s.last)[tenant][a] = v;
    } else if (verb == "threads" || verb == "priority") {
      if (a.empty() || !b.empty()) return bad("expected '" + verb + " <tenant> <value>'");
      if (!Ledger::validTenantName(tenant, &why)) return bad(why);
      if (verb == "threads") {
        int64_t pct = 0;
        if (!parseInt(a, 1, 100, &pct, &why)) return bad("threads: " + why);
        s.threads[tenant] = static_cast<int>(pct);
      } else if (!parsePriority(a, &s.priorities[tenant], &why)) {
        return bad("priority: " + why);
      }
    } else if (verb == "file") {
      if (c.empty() || (fields >> extra)) return bad("expected 'file <tenant> <file> <dev> <ino>'");
      if (!Ledger::validTenantName(tenant, &why)) return bad(why);
      if (a.rfind(tenant + ".ledger.", 0) != 0 || a.find('/') != std::string::npos)
        return bad("'" + printable(a, 64) + "' is not a ledger of tenant " + tenant);
      KeptFile f{tenant, a, 0, 0};
      if (!number(b, "dev", &f.dev) || !number(c, "ino", &f.ino)) return false;
      s.files.push_back(f);
    } else {
      return bad("expected 'limit <tenant> <GPU-uuid> <bytes>'");
    }
  }
  if (n == 0) return bad("empty file");
  *out = std::move(s);
  return true;
}

bool saveState(const std::string& path, const BrokerState& s, std::string* err) {
  std::ostringstream text;
  text << kHeader << "\n# written by cushare-broker: live limits (cushare set-limit), limits in force\n";
  if (!s.ledgerDir.empty()) text << "ledger_dir " << s.ledgerDir << "\n";
  for (const auto& [tenant, devices] : s.limits)
    for (const auto& [uuid, bytes] : devices) text << "limit " << tenant << " " << uuid << " " << bytes << "\n";
  for (const auto& [tenant, devices] : s.last)
    for (const auto& [uuid, bytes] : devices)
      text << "last " << tenant << " " << uuid << " " << (bytes == kNone ? "none" : std::to_string(bytes)) << "\n";
  for (const auto& [tenant, pct] : s.threads) text << "threads " << tenant << " " << pct << "\n";
  for (const auto& [tenant, p] : s.priorities) text << "priority " << tenant << " " << priorityName(p) << "\n";
  for (const KeptFile& f : s.files)
    text << "file " << f.tenant << " " << f.file << " " << f.dev << " " << f.ino << "\n";
  std::string why;
  if (writeFileAtomically(path, path + ".XXXXXX", text.str(), 0600, &why)) return true;
  *err = "the state file: " + why;
  return false;
}

}  // namespace cushare::broker
