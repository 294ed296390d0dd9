// CLOCK_MONOTONIC in nanoseconds, for the shim's own timing (the pacer, the wait for the broker).
#pragma once

#include <time.h>

#include <cstdint>

namespace cushare::shim {

inline uint64_t nowNs() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace cushare::shim
