// See log.h.
#include "log.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>

namespace cushare::shim {

void logLine(LogLevel level, const char* fmt, ...) noexcept {
  static constexpr const char* kNames[] = {"error", "warn", "info", "debug", "trace"};
  char buf[1024];
  int n = std::snprintf(buf, sizeof buf, "cushare[%d] %s: ", static_cast<int>(getpid()),
                        kNames[static_cast<int>(level)]);
  va_list ap;
  va_start(ap, fmt);
  const int m = std::vsnprintf(buf + n, sizeof buf - static_cast<size_t>(n) - 1, fmt, ap);
  va_end(ap);
  n = m < 0 ? n : std::min<int>(n + m, static_cast<int>(sizeof buf) - 2);
  buf[n++] = '\n';
  ssize_t w = write(STDERR_FILENO, buf, static_cast<size_t>(n));
  (void)w;
}

}  // namespace cushare::shim
