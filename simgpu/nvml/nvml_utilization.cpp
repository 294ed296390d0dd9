// Utilisation from what the device engines really ran (the time-slice board, timeslice_board.h):
// each process's engine publishes its cumulative busy time there.
//
// nvmlDeviceGetUtilizationRates: percent of the device time since this process's previous call
// (for the first call: since the busiest process's engine started counting, at most 1 s) during
// which kernels ran, summed over processes (they never overlap without MPS), at most 100.
// nvmlDeviceGetProcessUtilization: one sample per process with counters, timestamped now (us of
// device time), smUtil over the sampling period since that process's previous sample in this
// calling process (its first: over the last second, at most 100); as the driver does, only
// samples newer than lastSeenTimeStamp are returned (0: every one), NVML_ERROR_NOT_FOUND if none.
// Memory, encoder and decoder utilisation are 0 (copies take no time in simgpu).
// A process's counters are as fresh as its engine's last event; a dead process's vanish. An MPS
// client's sample is what its server's engine gave it (BoardClient), the server not listed itself.
#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>

#include "nvml_internal.h"

using namespace simgpu;
using namespace simgpu::nvml;

namespace {

uint64_t deviceNow(const nvmlDevice_st* d) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count();
  return static_cast<uint64_t>(static_cast<double>(ns) / d->timeScale);
}

struct Sampler {
  std::mutex mu;
  uint64_t lastNs[kMaxDevices] = {};
  uint64_t lastBusy[kMaxDevices] = {};
  std::map<std::pair<int, int32_t>, std::pair<uint64_t, uint64_t>> perPid;  // (dev, pid) -> (busy, t)
};
Sampler& sampler() {
  static auto* s = new Sampler;  // leaked: NVML may be called during exit
  return *s;
}

unsigned percent(uint64_t busy, uint64_t period) {
  if (period == 0) return 0;
  return static_cast<unsigned>(std::min<uint64_t>(100, (busy * 100 + period / 2) / period));
}

}  // namespace

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t handle, nvmlUtilization_t* utilization) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
  if (migEnabled(d->host)) return NVML_ERROR_NOT_SUPPORTED;  // as NVML's notes say, on a MIG-enabled GPU
  utilization->gpu = 0;
  utilization->memory = 0;
  if (!d->board) return NVML_SUCCESS;
  const uint64_t now = deviceNow(d);
  uint64_t busy = 0;
  for (const BoardSlot& s : d->board->slot)
    if (pidAlive(s.pid.load(std::memory_order_acquire))) busy += s.busyNs.load(std::memory_order_relaxed);
  Sampler& sm = sampler();
  std::lock_guard l(sm.mu);
  const int i = d->ordinal;
  if (sm.lastNs[i] == 0) {
    sm.lastNs[i] = now - std::min<uint64_t>(now, 1'000'000'000);
    sm.lastBusy[i] = 0;
  }
  const uint64_t delta = busy > sm.lastBusy[i] ? busy - sm.lastBusy[i] : 0;
  utilization->gpu = percent(delta, now - sm.lastNs[i]);
  sm.lastNs[i] = now;
  sm.lastBusy[i] = busy;
  return NVML_SUCCESS;
}

SIMGPU_NVML_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t handle,
                                                             nvmlProcessUtilizationSample_t* utilization,
                                                             unsigned int* processSamplesCount,
                                                             unsigned long long lastSeenTimeStamp) {
  nvmlDevice_st* d;
  if (nvmlReturn_t r = checkDevice(handle, &d); r != NVML_SUCCESS) return r;
  if (!processSamplesCount) return NVML_ERROR_INVALID_ARGUMENT;
  if (migEnabled(d->host)) return NVML_ERROR_NOT_SUPPORTED;
  if (!d->board) {
    *processSamplesCount = 0;
    return NVML_ERROR_NOT_FOUND;
  }
  const uint64_t now = deviceNow(d);
  // MPS: each client's own share (its server's slot is their sum, not a process of its own).
  unsigned n = 0;
  forEachProcess(*d->board, [&](const ProcessDeviceStats& p) { n += !p.isMpsServer; });
  if (!utilization || *processSamplesCount < n) {
    *processSamplesCount = n;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  Sampler& sm = sampler();
  std::lock_guard l(sm.mu);
  unsigned k = 0;
  forEachProcess(*d->board, [&](const ProcessDeviceStats& p) {
    if (p.isMpsServer || k >= n) return;
    const int32_t pid = p.pid;
    const uint64_t busy = p.busyNs;
    if (now / 1000 <= lastSeenTimeStamp) return;  // nothing newer than what the caller has seen
    auto& [prevBusy, prevT] = sm.perPid[{d->ordinal, pid}];
    uint64_t since = prevT;
    if (since == 0 || since > now) since = now - std::min<uint64_t>(now, 1'000'000'000);
    nvmlProcessUtilizationSample_t& out = utilization[k++];
    out = {};
    out.pid = static_cast<unsigned>(pid);
    out.timeStamp = now / 1000;
    out.smUtil = percent(busy > prevBusy ? busy - prevBusy : 0, now - since);
    prevBusy = busy;
    prevT = now;
  });
  *processSamplesCount = k;
  return k == 0 && n != 0 ? NVML_ERROR_NOT_FOUND : NVML_SUCCESS;
}
