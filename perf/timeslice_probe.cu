// Time slicing between processes, measured from inside one (perf/gpu_check.sh runs two at once on
// a real GPU; mps_test.cpp runs them on simgpu). The program launches back-to-back kernels of
// <kernel_us> each on one stream for <seconds>, each followed by an event, and reads the events'
// device times: consecutive events normally lie one kernel apart; a larger step is a gap, the time
// another context held the device. Runs between gaps are this process's slices.
//
//   usage: timeslice_probe <seconds> <kernel_us> [fill]
//   fill: each kernel is one full wave of 1024-thread blocks, two per SM (a hog that holds every
//   thread slot of the device or of its MPS client's SMs), not one warp
//   prints: timeslice slice_us=<median run> gap_us=<median gap> switch_us=<(gap - slice) / 2>
//           runs=<runs between gaps, the first and last dropped>
// With two identical processes a gap is the other's slice plus two switches, hence switch_us.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_spin.cuh"

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  const double kernelUs = argc > 2 ? std::atof(argv[2]) : 20.0;
  const long n = std::min<long>(200000, static_cast<long>(seconds * 1e6 / kernelUs));
  if (n < 10) return 2;
  unsigned blocks = 1, threads = 32;
  if (argc > 3 && std::string(argv[3]) == "fill") {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) return 1;
    blocks = 2 * static_cast<unsigned>(sms);
    threads = 1024;
  }
  std::vector<cudaEvent_t> ev(n + 1);
  for (auto& e : ev)
    if (cudaEventCreate(&e) != cudaSuccess) return 1;
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEventRecord(ev[0], s);
  for (long i = 0; i < n; ++i) {
    probe_spin<<<blocks, threads, 0, s>>>(static_cast<long long>(kernelUs * 1000));
    cudaEventRecord(ev[i + 1], s);
  }
  if (cudaStreamSynchronize(s) != cudaSuccess) return 1;
  std::vector<double> runs, gaps;
  double runStart = 0, prev = 0;
  for (long i = 1; i <= n; ++i) {
    float ms = 0;
    cudaEventElapsedTime(&ms, ev[0], ev[i]);
    const double t = ms * 1000.0;
    if (t - prev > 1.5 * kernelUs) {  // a gap: the run before it ended at prev
      runs.push_back(prev - runStart);
      gaps.push_back(t - prev - kernelUs);
      runStart = t - kernelUs;
    }
    prev = t;
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  if (runs.size() > 2) runs = std::vector<double>(runs.begin() + 1, runs.end());  // the first run began before the other
  const double slice = median(runs), gap = median(gaps);
  std::printf("timeslice slice_us=%.0f gap_us=%.0f switch_us=%.1f runs=%zu\n", slice, gap, (gap - slice) / 2,
              runs.size());
  return 0;
}
