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

}  // namespace cushare
