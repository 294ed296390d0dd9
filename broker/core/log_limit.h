// A budget for log lines that other users can cause at will: a ledger file dropped into the
// ledger directory, a GPU process started, a malformed request on the control socket. Without it
// any local user could grow the broker's log without bound (one line per file: 3000 files, 3000
// lines). Each kind of line has a LogLimit: up to `burst` lines pass at once, then one per
// `every`; what is held back is counted and said in the next line that passes ("N more like it
// were not logged"), and counted for the metrics (cushare_broker_log_lines_dropped_total).
// Not thread-safe: each one is used under the lock that guards its caller's state.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace cushare::broker {

// Lines every LogLimit of the broker held back, since it started (the metrics read it).
inline std::atomic<uint64_t> gLogLinesDropped{0};

class LogLimit {
 public:
  LogLimit(uint32_t burst, std::chrono::milliseconds every) : burst_(burst), everyNs_(every.count() * 1'000'000) {}

  // Whether this line may be logged now. When it may, *suffix is empty or says how many lines were
  // held back since the last one that passed (to append to it).
  bool allow(std::string* suffix) { return allowAt(nowNs(), suffix); }
  bool allowAt(uint64_t nowNs, std::string* suffix) {
    suffix->clear();
    // Refill: one line per `every` since the last refill, up to the burst.
    if (last_ == 0) {
      tokens_ = burst_;
      last_ = nowNs;
    } else if (nowNs > last_ && everyNs_ > 0) {
      const uint64_t add = (nowNs - last_) / everyNs_;
      if (add > 0) {
        tokens_ = static_cast<uint32_t>(std::min<uint64_t>(burst_, tokens_ + add));
        last_ += add * everyNs_;
      }
    }
    if (tokens_ == 0) {
      ++held_;
      gLogLinesDropped.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    --tokens_;
    if (held_ != 0) *suffix = " (" + std::to_string(held_) + " more like it were not logged)";
    held_ = 0;
    return true;
  }

 private:
  static uint64_t nowNs() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }
  uint32_t burst_;
  uint64_t everyNs_;
  uint32_t tokens_ = 0;
  uint64_t last_ = 0;
  uint64_t held_ = 0;
};

}  // namespace cushare::broker
