#!/usr/bin/env bash
# perf/managed_evict_probe on simgpu: the probe runs, and every fact bursting tenants rely on holds
# on simgpu as cuda.h and the UVM driver describe the real driver (docs/memory-elasticity.md): a
# managed allocation takes no device memory until populated, a prefetch to the device does, NVML's
# per-process figure leaves it out, another process's cuMemAlloc that needs the room evicts it to
# host memory, the data survives, and a prefetch to the host frees it. (perf/gpu_check.sh step 10
# runs the same probe on a real GPU.)
set -euo pipefail
out=$("$1")
echo "$out"
facts=$(grep '^facts ' <<<"$out") || { echo "FAIL: no facts line"; exit 1; }
for f in alloc_charges_nothing prefetch_charges nvml_process_omits_managed alloc_evicts_managed data_intact host_prefetch_frees; do
  grep -q " $f=1" <<<"$facts" || { echo "FAIL: $f is not 1"; exit 1; }
done
# A kernel that faults the whole allocation back in waits SIMGPU_FAULT_US (200 us by default) per
# 2 MiB chunk; the same kernel with everything resident does not.
us=$(sed -n 's/^step=a-fault-in .*us_per_2mib=\([0-9.]*\).*/\1/p' <<<"$out")
[[ -n $us ]] || { echo "FAIL: no fault-in figure"; exit 1; }
awk -v u="$us" 'BEGIN { exit !(u >= 150 && u <= 400) }' || { echo "FAIL: $us us per 2 MiB, simgpu charges 200"; exit 1; }
echo PASS
