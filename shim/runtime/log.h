// The shim's log facade: one line per call, written with a single write(2) to stderr from a stack
// buffer, so it is safe before main, inside a forked child and while cudart tears down (no
// allocation, no locks, no static objects). Messages carry the "cushare:" prefix.
// Every line goes through CUSHARE_LOG_LEVEL: a line above the level is dropped. What a tenant or
// an operator must always see is logged at kError: a configuration refused (fail closed) and an
// allocation denied by the limit (with its stack), so `CUSHARE_LOG_LEVEL=error` still shows both.
#pragma once

#include <atomic>

namespace cushare::shim {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

// Set once from CUSHARE_LOG_LEVEL at init; readable from any thread.
inline std::atomic<int> gLogLevel{static_cast<int>(LogLevel::kWarn)};

// One line, if level is within CUSHARE_LOG_LEVEL.
void logLine(LogLevel level, const char* fmt, ...) noexcept __attribute__((format(printf, 2, 3)));

// Logs the calling thread's stack (libunwind, local unwinding, symbol names via the unwinder),
// one frame per line, at most `maxFrames`, rate-limited process-wide to one stack per second and
// 20 per process: used where an allocation is denied, to show the allocation site.
void logStackRateLimited(LogLevel level, int maxFrames = 24) noexcept;

#define CUSHARE_LOG(level, ...)                                                                  \
  do {                                                                                           \
    if (static_cast<int>(level) <= ::cushare::shim::gLogLevel.load(std::memory_order_relaxed)) \
      ::cushare::shim::logLine(level, __VA_ARGS__);                                              \
  } while (0)

}  // namespace cushare::shim
