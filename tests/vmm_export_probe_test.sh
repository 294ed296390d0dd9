#!/usr/bin/env bash
# perf/vmm_export_probe on simgpu: the probe runs, and simgpu keeps shareable memory allocated
# while only an exported descriptor in a process that never used CUDA refers to it, as a real
# driver does, and frees it when that descriptor closes. (On a real GPU, perf/gpu_check.sh runs the
# same probe to learn how NVML shows such memory.)
set -euo pipefail
out=$("$1")
echo "$out"
used() { sed -n "s/^step=$1 device_used=\([0-9]*\).*/\1/p" <<<"$out"; }
base=$(used baseline) exported=$(used exported) orphaned=$(used orphaned) closed=$(used closed)
mib=$((256 << 20))
[[ -n $base && -n $exported && -n $orphaned && -n $closed ]] || { echo "FAIL: missing steps"; exit 1; }
[[ $((exported - base)) -ge $mib ]] || { echo "FAIL: exported memory not on the device"; exit 1; }
[[ $orphaned -eq $exported ]] || { echo "FAIL: the descriptor alone must keep the memory ($orphaned != $exported)"; exit 1; }
[[ $closed -eq $base ]] || { echo "FAIL: closing the last descriptor must free it ($closed != $base)"; exit 1; }
grep -q '^step=orphaned .* fd_target=/' <<<"$out" || { echo "FAIL: no descriptor target"; exit 1; }
echo PASS
