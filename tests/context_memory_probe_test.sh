#!/usr/bin/env bash
# perf/context_memory_probe on simgpu: the probe runs every step, NVML lists this process with at
# least what it allocated, and simgpu (which models no context memory) shows nothing beyond it:
# which is why the broker tests run with context_memory: 0. (On a real GPU, perf/gpu_check.sh runs
# the same probe to measure a context's size, docs/broker-configuration.md's context_memory.)
set -euo pipefail
out=$("$1" "$2")
echo "$out"
field() { sed -n "s/^step=$1 .*$2=\([0-9-]*\).*/\1/p" <<<"$out"; }
for step in context module malloc_heap stack; do
  [[ $(field $step rc) == 0 ]] || { echo "FAIL: step $step did not succeed"; exit 1; }
  [[ $(field $step allocated) -eq $((1 << 20)) ]] || { echo "FAIL: step $step: allocated"; exit 1; }
  [[ $(field $step process_used) -ge $((1 << 20)) ]] || { echo "FAIL: step $step: NVML does not list the process"; exit 1; }
  [[ $(field $step beyond) -eq 0 ]] || { echo "FAIL: step $step: simgpu holds memory beyond the allocation"; exit 1; }
done
echo PASS
