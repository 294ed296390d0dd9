// See log.h.
#include "log.h"

#include <unistd.h>

#define UNW_LOCAL_ONLY
#include <libunwind.h>
#include <time.h>

#include <algorithm>
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

void logStackRateLimited(LogLevel level, int maxFrames) noexcept {
  if (static_cast<int>(level) > gLogLevel.load(std::memory_order_relaxed)) return;
  static std::atomic<int64_t> lastSecond{-1};
  static std::atomic<int> printed{0};
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t last = lastSecond.load(std::memory_order_relaxed);
  if (last == ts.tv_sec || printed.load(std::memory_order_relaxed) >= 20) return;
  if (!lastSecond.compare_exchange_strong(last, ts.tv_sec)) return;  // another thread prints this second
  printed.fetch_add(1, std::memory_order_relaxed);
  unw_context_t ctx;
  unw_cursor_t cur;
  if (unw_getcontext(&ctx) != 0 || unw_init_local(&cur, &ctx) != 0) return;
  int frame = 0;
  while (frame < maxFrames && unw_step(&cur) > 0) {
    unw_word_t ip = 0, off = 0;
    unw_get_reg(&cur, UNW_REG_IP, &ip);
    char name[256];
    if (unw_get_proc_name(&cur, name, sizeof name, &off) != 0) std::snprintf(name, sizeof name, "?");
    logLine(level, "  #%d 0x%llx %s+0x%llx", frame++, static_cast<unsigned long long>(ip), name,
            static_cast<unsigned long long>(off));
  }
}

}  // namespace cushare::shim
