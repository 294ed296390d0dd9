// The resolution of cudaEventElapsedTime (perf/gpu_check.sh on a real GPU; mps_test.cpp on
// simgpu): kernels of 0.25 us to 10 us, each between two events, five times each; prints the
// smallest step between the distinct elapsed times seen (the timer's resolution) and the shortest
// elapsed time (launch overhead included on a real GPU).
//
//   usage: event_resolution
//   prints: events resolution_us=<smallest step> min_us=<shortest elapsed>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "probe_spin.cuh"

int main() {
  cudaEvent_t a, b;
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) return 1;
  std::vector<double> seen;
  for (int d = 1; d <= 40; ++d)
    for (int rep = 0; rep < 5; ++rep) {
      cudaEventRecord(a, 0);
      probe_spin<<<1, 32>>>(d * 250LL);
      cudaEventRecord(b, 0);
      if (cudaEventSynchronize(b) != cudaSuccess) return 1;
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      seen.push_back(ms * 1000.0);
    }
  std::sort(seen.begin(), seen.end());
  double step = 1e9;
  for (size_t i = 1; i < seen.size(); ++i)
    if (seen[i] - seen[i - 1] > 1e-6) step = std::min(step, seen[i] - seen[i - 1]);
  std::printf("events resolution_us=%.3f min_us=%.3f\n", step, seen.front());
  return 0;
}
