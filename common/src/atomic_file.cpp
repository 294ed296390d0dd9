// See atomic_file.h.
#include "cushare/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace cushare {

bool writeFileAtomically(const std::string& path, std::string tmpTemplate, const std::string& text, mode_t mode,
                         std::string* err) {
  auto fail = [&](int e) {
    *err = "cannot write " + path + ": " + std::strerror(e);
    return false;
  };
  const int fd = ::mkostemp(tmpTemplate.data(), O_CLOEXEC);
  if (fd < 0) return fail(errno);
  bool ok = ::fchmod(fd, mode) == 0;
  for (size_t done = 0; ok && done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) done += static_cast<size_t>(n);
  }
  ok = ok && ::fsync(fd) == 0;
  int e = errno;
  ::close(fd);
  if (ok && ::rename(tmpTemplate.c_str(), path.c_str()) != 0) {
    ok = false;
    e = errno;
  }
  if (!ok) {
    ::unlink(tmpTemplate.c_str());
    return fail(e);
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); d >= 0) {
    ::fsync(d);  // the rename itself survives a crash
    ::close(d);
  }
  return true;
}

bool makeDirectories(const std::string& dir, mode_t mode, const std::string& what, std::string* err) {
  auto fail = [&](const std::string& why) {
    if (err) *err = why;
    return false;
  };
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i != dir.size() && dir[i] != '/') continue;
    const std::string part = dir.substr(0, i);
    if (::mkdir(part.c_str(), i == dir.size() ? mode : 0755) != 0 && errno != EEXIST)
      return fail("cannot create " + what + part + ": " + std::strerror(errno));
  }
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0) return fail("cannot use " + what + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) return fail(what + dir + " is not a directory");
  return true;
}

bool makeParentDirectories(const std::string& path, std::string* err) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return true;  // in the working directory, or in /
  return makeDirectories(path.substr(0, slash), 0755, "directory ", err);
}

}  // namespace cushare
