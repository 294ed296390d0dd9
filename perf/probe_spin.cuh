// The kernel of the device-time probes (perf/timeslice_probe.cu, perf/event_resolution.cu): one
// thread spins for `ns` of %globaltimer on a real GPU. On simgpu device code does not run; the cost
// table (tests/simgpu/process/mps.costs: `probe_spin block_ns_param=0`) gives each block that time.
#pragma once

__global__ void probe_spin(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (static_cast<long long>(t - t0) < ns);
}
