// A guaranteed allocation the driver refused while other tenants hold plain bursts waits for them
// to be given back (reclaim.cpp; docs/memory-elasticity.md, "burst: plain"): memory.cpp's roads and
// the pools' stream-ordered allocations (pools.cpp).
#pragma once

#include <cuda.h>
#include <unistd.h>

#include <cstdint>

namespace cushare::shim {

// reclaim.cpp
bool reclaimWaitBegin(int ordinal, uint64_t bytes, uint64_t* deadlineNs, uint64_t* postedNs) noexcept;
uint64_t reclaimWaitRefresh(int ordinal, uint64_t bytes) noexcept;
void reclaimWaitEnd(int ordinal, uint64_t bytes, bool granted, uint64_t startedNs, uint64_t postedNs) noexcept;
uint64_t reclaimNowNs() noexcept;

// r: what alloc (whose reservation is held) answered first. If the driver was out of memory while
// other tenants' plain bursts could be given back, waits for them (every millisecond a new try,
// the wait posted again every 10 ms, at most elasticity.reclaim_wait_ms) and returns the last try's.
template <typename Alloc>
CUresult waitForReclaimAndRetry(int ordinal, uint64_t bytes, CUresult r, Alloc&& alloc) noexcept {
  uint64_t deadline = 0, posted = 0;
  if (r != CUDA_ERROR_OUT_OF_MEMORY || !reclaimWaitBegin(ordinal, bytes, &deadline, &posted)) return r;
  const uint64_t start = posted;
  for (uint64_t now = start; r == CUDA_ERROR_OUT_OF_MEMORY && now < deadline; now = reclaimNowNs()) {
    ::usleep(1000);
    if (now - posted >= 10000000ull) posted = reclaimWaitRefresh(ordinal, bytes);
    r = alloc();
  }
  reclaimWaitEnd(ordinal, bytes, r == CUDA_SUCCESS, start, posted);
  return r;
}

template <typename Alloc>
CUresult allocOrWaitForReclaim(int ordinal, uint64_t bytes, Alloc&& alloc) noexcept {
  return waitForReclaimAndRetry(ordinal, bytes, alloc(), alloc);
}

}  // namespace cushare::shim
