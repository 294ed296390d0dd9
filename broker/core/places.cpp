// See places.h.
#include "core/places.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/log.h"
#include "cushare/atomic_file.h"
#include "cushare/limits_file.h"

namespace cushare::broker {
namespace {

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string octal(unsigned mode) {
  char b[16];
  std::snprintf(b, sizeof b, "%04o", mode);
  return b;
}

std::string dirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

// Refuses a place whose directories would let another user replace what the broker keeps there.
// Every existing directory above path must belong to root or the broker's user and may be
// writable by others only with the sticky bit (like /dev/shm or /tmp); with strict, the directory
// holding path may not be writable by others at all (in a sticky one, another user could create
// the name first). Directories still missing are created by the broker itself.
bool checkParents(const std::string& path, const std::string& what, bool strict, std::string* err) {
  const std::string holder = dirOf(path);
  for (size_t i = 1; i <= holder.size(); ++i) {
    if (i < holder.size() && holder[i] != '/') continue;
    const std::string d = i == 1 && holder.size() == 1 ? "/" : holder.substr(0, i);
    struct stat st;
    if (::stat(d.c_str(), &st) != 0) {
      if (errno == ENOENT) return true;  // created by the broker, below
      *err = sysErr("cannot access " + d + " (above " + what + " " + path + ")");
      return false;
    }
    if (!S_ISDIR(st.st_mode)) {
      *err = what + " " + path + " cannot be created: " + d + " is not a directory";
      return false;
    }
    const bool others = (st.st_mode & 022) != 0;
    std::string why;
    if (st.st_uid != 0 && st.st_uid != ::geteuid())
      why = "belongs to uid " + std::to_string(st.st_uid);
    else if (others && (d == holder && strict))
      why = "is writable by other users (mode " + octal(st.st_mode & 07777) + ")";
    else if (others && (st.st_mode & S_ISVTX) == 0)
      why = "is writable by other users without the sticky bit (mode " + octal(st.st_mode & 07777) + ")";
    if (!why.empty()) {
      *err = what + " " + path + " refused: the directory " + d + " " + why +
             ", so another user could replace it; use a directory only root or the broker's user can write "
             "(e.g. under /run/cushare, mode 0755)";
      return false;
    }
    if (d == holder) break;
  }
  return true;
}

}  // namespace

bool checkParentsOf(const std::string& path, const std::string& what, bool strict, std::string* err) {
  return checkParents(path, what, strict, err);
}

bool checkTrustedFile(const std::string& path, const std::string& what, std::string* resolved, std::string* err) {
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr) {  // missing: whoever uses it says so; where it would appear is checked
    *resolved = path;
    return checkParents(path, what, /*strict=*/true, err);
  }
  const std::string target = real;
  std::free(real);
  *resolved = target;
  const std::string named = target == path ? path : path + " (" + target + ")";
  if (!checkParents(target, what, /*strict=*/true, err)) return false;
  struct stat st;
  if (::stat(target.c_str(), &st) != 0) {
    *err = sysErr("cannot access " + what + " " + named);
    return false;
  }
  std::string why;
  if (!S_ISREG(st.st_mode))
    why = "is not a regular file";
  else if (st.st_uid != 0 && st.st_uid != ::geteuid())
    why = "belongs to uid " + std::to_string(st.st_uid);
  else if ((st.st_mode & 022) != 0)
    why = "is writable by other users (mode " + octal(st.st_mode & 07777) + ")";
  if (why.empty()) return true;
  *err = what + " " + named + " refused: it " + why +
         ", so another user could change what runs in tenants' processes; install it as root, mode 0644 or 0755";
  return false;
}

bool checkCuptiLibrary(const Config& c, std::string* resolved, std::string* err) {
  const std::string& path = c.compute.cuptiLibrary;
  resolved->clear();
  if (path.empty()) return true;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    *err = sysErr("compute.cupti_library " + path);
    return false;
  }
  return checkTrustedFile(path, "compute.cupti_library", resolved, err);
}

bool checkPlaces(const Config& c, std::string* err) {
  std::string cupti;
  if (!checkCuptiLibrary(c, &cupti, err)) return false;
  const std::string& dir = c.ledgerDir;
  if (!checkParents(dir, "ledger_dir", /*strict=*/false, err) ||
      !checkParents(c.stateFile, "state_file", /*strict=*/true, err) ||
      !checkParents(c.socket, "socket", /*strict=*/true, err))
    return false;
  struct stat st;
  if (::lstat(dir.c_str(), &st) == 0) {
    // Another user's (whatever it is) is moved aside at start; the broker's own must be a directory.
    if (st.st_uid == ::geteuid() && !S_ISDIR(st.st_mode)) {
      *err = "ledger_dir " + dir + " is not a directory";
      return false;
    }
    return true;
  }
  return checkDirWritable(dir, "ledger_dir", err);
}

bool checkDirWritable(const std::string& dir, const std::string& what, std::string* err) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      *err = what + " " + dir + " is not a directory";
      return false;
    }
    if (::faccessat(AT_FDCWD, dir.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
      *err = sysErr(what + " " + dir + " cannot be written");
      return false;
    }
    return true;
  }
  // Missing: the nearest existing directory above it must let the broker create it.
  std::string above = dirOf(dir);
  while (::stat(above.c_str(), &st) != 0 && errno == ENOENT && above != "/") above = dirOf(above);
  if (::stat(above.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *err = what + " " + dir + " cannot be created: " + above + " is not a directory";
    return false;
  }
  if (::faccessat(AT_FDCWD, above.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    *err = sysErr(what + " " + dir + " cannot be created in " + above);
    return false;
  }
  return true;
}

namespace {
// CAP_CHOWN among this process's effective capabilities (root normally has it; a broker started
// with systemd's AmbientCapabilities=CAP_CHOWN has it without being root).
bool canChown() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("CapEff:", 0) == 0) return (std::strtoull(line.c_str() + 7, nullptr, 16) & 1ull) != 0;  // bit 0
  return ::geteuid() == 0;
}
}  // namespace

bool checkLedgerOwners(const Config& c, std::string* err) {
  const uid_t me = ::geteuid();
  if (canChown()) return true;
  std::vector<gid_t> groups(static_cast<size_t>(std::max(0, ::getgroups(0, nullptr))));
  groups.resize(static_cast<size_t>(std::max(0, ::getgroups(static_cast<int>(groups.size()), groups.data()))));
  groups.push_back(::getegid());
  for (const Tenant& t : c.tenants) {
    if (t.uid && *t.uid != me) {
      *err = "tenant " + t.name + ": uid " + std::to_string(*t.uid) + ": the broker runs as uid " + std::to_string(me) +
             " without CAP_CHOWN and cannot give the tenant's ledger to another user; run it as root (or with "
             "CAP_CHOWN), or drop the tenant's uid";
      return false;
    }
    if (t.gid && std::find(groups.begin(), groups.end(), static_cast<gid_t>(*t.gid)) == groups.end()) {
      *err = "tenant " + t.name + ": gid " + std::to_string(*t.gid) + ": the broker runs as uid " + std::to_string(me) +
             " without CAP_CHOWN, not in that group, and cannot give the tenant's ledger to it; run it as root (or "
             "with CAP_CHOWN), or add its user to the group";
      return false;
    }
  }
  return true;
}

bool prepareLedgerDir(const Config& c, std::string* err) {
  const std::string& dir = c.ledgerDir;
  if (!makeParentDirectories(dir, err)) return false;
  if (::mkdir(dir.c_str(), 0711) != 0 && errno != EEXIST) {
    *err = sysErr("cannot create ledger_dir " + dir);
    return false;
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    *err = sysErr("cannot access ledger_dir " + dir);
    return false;
  }
  if (st.st_uid != ::geteuid()) {
    // Created by someone else before the broker (a tenant, a standalone shim): tenants could
    // replace the ledgers in it. Swapped atomically with a fresh directory of the broker's, never
    // entered, followed or read; what it holds stays, unread, under the other name.
    std::string aside = dir + ".untrusted-XXXXXX";
    const bool made = ::mkdtemp(aside.data()) != nullptr;
    const bool swapped = made && ::renameat2(AT_FDCWD, aside.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0;
    const int e = errno;
    if (!swapped) {
      if (made) ::rmdir(aside.c_str());
      errno = e;
      *err = sysErr("ledger_dir " + dir + " belongs to uid " + std::to_string(st.st_uid) +
                    ", not to the broker's user (uid " + std::to_string(::geteuid()) +
                    "), and could not be moved aside") +
             "; move it away yourself (mv " + dir + " " + dir + ".old) and start the broker again";
      return false;
    }
    CUSHARE_BLOG(warn, "ledger_dir {} belonged to uid {} (created before the broker by someone else): moved "
                 "aside, unread, to {}; a fresh one is used (remove the old one when you have looked at it)",
                 dir, st.st_uid, aside);
    if (::lstat(dir.c_str(), &st) != 0) {
      *err = sysErr("cannot access ledger_dir " + dir);
      return false;
    }
  }
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
    *err = "ledger_dir " + dir + " is not a directory of the broker's user";
    return false;
  }
  // 0711 until the host segment is written (start() then opens it to unknown tenants if
  // configured): a tenant must never be able to plant a host segment of its own.
  const mode_t mode = 0711;
  if ((st.st_mode & 07777) != mode && ::chmod(dir.c_str(), mode) != 0) {
    *err = sysErr("cannot set the mode of ledger_dir " + dir);
    return false;
  }
  // The broker's limits files (limits_file.h), before tenants may create anything in the directory.
  if (!prepareLimitsDir(dir, err)) return false;
  if (!makeParentDirectories(c.stateFile, err) || !makeParentDirectories(c.socket, err)) return false;
  // Checked again now that every directory exists: one created by someone else meanwhile is refused.
  return checkPlaces(c, err);
}

}  // namespace cushare::broker
