#!/usr/bin/env bash
# examples/tenant/busy_for on simgpu: without the cost table its kernels take no device time, and
# instead of claiming hundreds of percent of the device it says why and exits 1 (issue 26, point
# 8: it printed "846 % of the device's time"); with the table each second reads at most 100 %.
#   usage: busy_for_costs_test.sh BUSY_FOR COSTS
set -uo pipefail
busy=$1 costs=$2
out=$(env -u SIMGPU_KERNEL_COSTS "$busy" --seconds 1 --name bare 2>&1)
rc=$?
echo "$out"
[ "$rc" = 1 ] || { echo "FAIL: exit $rc without the cost table, not 1"; exit 1; }
grep -q "is more than a device has: the kernels finished before their blocks' 1000 us. On simgpu, set SIMGPU_KERNEL_COSTS to busy_for.costs" <<<"$out" ||
  { echo "FAIL: no explanation"; exit 1; }
grep -q "% of the device's time$" <<<"$out" && { echo "FAIL: a share was printed"; exit 1; }
out=$(SIMGPU_KERNEL_COSTS=$costs "$busy" --seconds 1 --name costed 2>&1)
rc=$?
echo "$out"
[ "$rc" = 0 ] || { echo "FAIL: exit $rc with the cost table"; exit 1; }
share=$(sed -n 's/^\[costed\] second 1: *\([0-9]*\) % of the device.s time$/\1/p' <<<"$out")
[ -n "$share" ] && [ "$share" -le 110 ] || { echo "FAIL: share '$share' with the cost table"; exit 1; }
echo PASS
