// NVML's per-process utilization as the broker reads it (broker/core/devices.cpp,
// ProcessBusyReader): polls nvmlDeviceGetProcessUtilization on device 0 with the newest timestamp
// seen, for a while, and reports per process what the samples say, so perf/gpu_check.sh can
// measure on a GPU what simgpu guesses (docs/simgpu.md, "NVML"): the driver's sampling period,
// and how much of a saturating process's time the samples add up to.
//
//   usage: process_util_probe [seconds] [poll_ms] [label]   (defaults: 3, 50, util)
//   prints one line per process with samples:
//     <label> pid=<pid> samples=<n> period_us=<min>/<median>/<max> (between its samples)
//       busy_s=<sum of smUtil x period, the broker's reading> over_s=<first to last sample>
//       busy_fraction=<busy_s / over_s>
//   and "<label> calls=<n> not_found=<n> errors=<n>" (NOT_FOUND: nothing newer than the last).
// Loads libnvidia-ml.so.1 at run time, as the broker does (simgpu's where LD_LIBRARY_PATH says).
#include <dlfcn.h>
#include "cushare/nvml_api.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Seen {
  std::vector<unsigned long long> ts;
  std::vector<unsigned> util;
};

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 3.0;
  const int pollMs = argc > 2 ? std::atoi(argv[2]) : 50;
  const std::string label = argc > 3 ? argv[3] : "util";
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::printf("%s error=cannot load libnvidia-ml.so.1: %s\n", label.c_str(), dlerror());
    return 1;
  }
  using Init = nvmlReturn_t (*)();
  using Handle = nvmlReturn_t (*)(unsigned, nvmlDevice_t*);
  using Util = nvmlReturn_t (*)(nvmlDevice_t, nvmlProcessUtilizationSample_t*, unsigned*, unsigned long long);
  auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
  auto handle = reinterpret_cast<Handle>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  auto util = reinterpret_cast<Util>(dlsym(lib, "nvmlDeviceGetProcessUtilization"));
  nvmlDevice_t dev{};
  if (init == nullptr || handle == nullptr || util == nullptr || init() != NVML_SUCCESS || handle(0, &dev) != NVML_SUCCESS) {
    std::printf("%s error=NVML did not start or has no nvmlDeviceGetProcessUtilization\n", label.c_str());
    return 1;
  }
  std::map<unsigned, Seen> seen;
  unsigned long long last = 0;
  int calls = 0, notFound = 0, errors = 0;
  std::vector<nvmlProcessUtilizationSample_t> samples(256);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    unsigned n = static_cast<unsigned>(samples.size());
    const nvmlReturn_t r = util(dev, samples.data(), &n, last);
    ++calls;
    if (r == NVML_ERROR_NOT_FOUND) ++notFound;
    else if (r != NVML_SUCCESS) ++errors;
    for (unsigned i = 0; r == NVML_SUCCESS && i < n && i < samples.size(); ++i) {
      Seen& s = seen[samples[i].pid];
      if (!s.ts.empty() && samples[i].timeStamp <= s.ts.back()) continue;
      s.ts.push_back(samples[i].timeStamp);
      s.util.push_back(samples[i].smUtil);
      last = std::max(last, samples[i].timeStamp);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(pollMs));
  }
  for (const auto& [pid, s] : seen) {
    std::vector<unsigned long long> gaps;
    double busyUs = 0;
    for (size_t i = 1; i < s.ts.size(); ++i) {
      gaps.push_back(s.ts[i] - s.ts[i - 1]);
      busyUs += static_cast<double>(gaps.back()) * s.util[i] / 100.0;  // as the broker reads it
    }
    std::sort(gaps.begin(), gaps.end());
    const double overUs = s.ts.size() > 1 ? static_cast<double>(s.ts.back() - s.ts.front()) : 0;
    std::printf("%s pid=%u samples=%zu period_us=%llu/%llu/%llu busy_s=%.3f over_s=%.3f busy_fraction=%.3f\n",
                label.c_str(), pid, s.ts.size(), gaps.empty() ? 0ull : gaps.front(),
                gaps.empty() ? 0ull : gaps[gaps.size() / 2], gaps.empty() ? 0ull : gaps.back(), busyUs / 1e6,
                overUs / 1e6, overUs > 0 ? busyUs / overUs : 0.0);
  }
  std::printf("%s calls=%d not_found=%d errors=%d\n", label.c_str(), calls, notFound, errors);
  return 0;
}
