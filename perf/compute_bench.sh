#!/usr/bin/env sh
# Runs one of compute_test's benchmarks (not ctest tests) on simgpu with device time, in a state
# directory of its own: the simulated device, a cost table where each block of `spin` lasts its
# parameter in ns (the compute worker's kernels), and the broker's test cases. Used by
# perf/metering_overhead.sh and perf/pacing_overhead.sh; the benchmark's variables pass through.
#   usage: perf/compute_bench.sh BUILD_DIR GTEST_FILTER OUTPUT_LINES_REGEX
set -eu
build=$1
filter=$2
lines=$3
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
echo "spin block_ns_param=1" > "$state/costs"
# The benchmark's lines (at its end); a failed check (a worker that did not answer, a broker that
# did not start) is printed whole and fails the script: a run that stopped early must not pass
# for a shorter one.
rc=0
LD_LIBRARY_PATH="$build/lib/simgpu" SIMGPU_STATE_DIR="$state/sim" SIMGPU_MEMORY=4GiB \
  SIMGPU_KERNEL_COSTS="$state/costs" BROKER_TEST_DIR="$state/cases" \
  "$build/tests/compute/compute_test" --gtest_filter="$filter" > "$state/out" 2>&1 || rc=$?
grep -E "$lines" "$state/out" || true
if [ "$rc" -ne 0 ] || grep -q '^\[  FAILED  \]' "$state/out"; then
  echo "compute_bench: the benchmark failed (exit $rc); its output:" >&2
  cat "$state/out" >&2
  exit 1
fi
