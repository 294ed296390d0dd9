// See log.h. Lines are formatted by spdlog (header-only and hidden inside the shim, so it cannot
// clash with an spdlog the application itself uses) and written by a sink that makes one
// write(2) per line: no registry, no mutex, no async thread. That is what keeps it safe before
// main, in a forked child (no lock another thread could have held at fork) and during exit.
#define SPDLOG_HEADER_ONLY
#define FMT_HEADER_ONLY
#include <spdlog/details/null_mutex.h>
#include <spdlog/logger.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>

#include "log.h"

#include <unistd.h>

#define UNW_LOCAL_ONLY
#include <cxxabi.h>
#include <dlfcn.h>
#include <libunwind.h>
#include <time.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace cushare::shim {
namespace {

// One write(2) per line to stderr. The pattern formatter is not thread-safe, so each thread
// formats with its own copy (leaked with the thread: trivially destructible thread-local).
class StderrSink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    thread_local spdlog::formatter* local = nullptr;
    if (!local) local = formatter_->clone().release();
    spdlog::memory_buf_t buf;
    local->format(msg, buf);
    ssize_t w = ::write(STDERR_FILENO, buf.data(), buf.size());
    (void)w;
  }
  void flush_() override {}
};

spdlog::logger* logger() noexcept {
  // Built on first use and never destroyed (cudart may log through us during exit teardown).
  static spdlog::logger* l = [] {
    auto* made = new spdlog::logger("cushare", std::make_shared<StderrSink>());
    made->set_pattern("cushare[%P] %l: %v");
    made->set_level(spdlog::level::trace);  // filtering is CUSHARE_LOG_LEVEL's, in CUSHARE_LOG
    return made;
  }();
  return l;
}

spdlog::level::level_enum toSpdlog(LogLevel l) {
  switch (l) {
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kDebug: return spdlog::level::debug;
    default: return spdlog::level::trace;
  }
}

}  // namespace

void logLine(LogLevel level, const char* fmt, ...) noexcept {
  if (static_cast<int>(level) > gLogLevel.load(std::memory_order_relaxed)) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  const int n = std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  try {
    logger()->log(toSpdlog(level), "{}", std::string_view(buf, std::min<size_t>(static_cast<size_t>(n), sizeof buf - 1)));
  } catch (...) {
    // Out of memory while logging: drop the line rather than disturb the application.
  }
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
  // The application's frames, from the call into CUDA outwards: the shim's own (this function,
  // the denial, the hook) say nothing to the reader. Names demangled, each with its library.
  Dl_info self{};
  const bool known = dladdr(reinterpret_cast<void*>(&logStackRateLimited), &self) != 0;
  int frame = 0;
  while (frame < maxFrames && unw_step(&cur) > 0) {
    unw_word_t ip = 0, off = 0;
    unw_get_reg(&cur, UNW_REG_IP, &ip);
    Dl_info where{};
    const bool found = dladdr(reinterpret_cast<void*>(ip), &where) != 0;
    if (known && found && where.dli_fbase == self.dli_fbase) continue;
    char name[256];
    if (unw_get_proc_name(&cur, name, sizeof name, &off) != 0) std::snprintf(name, sizeof name, "?");
    int status = -1;
    char* readable = abi::__cxa_demangle(name, nullptr, nullptr, &status);
    const char* lib = found && where.dli_fname != nullptr ? where.dli_fname : "?";
    if (const char* slash = std::strrchr(lib, '/'); slash != nullptr) lib = slash + 1;
    logLine(level, "  #%d %s+0x%llx (%s)", frame++, status == 0 && readable != nullptr ? readable : name,
            static_cast<unsigned long long>(off), lib);
    std::free(readable);
  }
}

}  // namespace cushare::shim
