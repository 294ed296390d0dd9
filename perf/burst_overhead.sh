#!/usr/bin/env sh
# What bursting costs an allocation (docs/performance.md, "Bursting"): cuMemAlloc + cuMemFree pairs
# of 4 KiB and 1 MiB without the shim, under the shim as a broker's tenant that does not burst, and
# as one bursting above its guarantee (managed memory and its prefetch), on simgpu, interleaved;
# prints the medians and their ratios to no shim.
#   usage: perf/burst_overhead.sh [build dir] [rounds]   (defaults: build, 5)
set -eu
build=${1:-build}
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
rc=0
LD_LIBRARY_PATH="$build/lib/simgpu" SIMGPU_STATE_DIR="$state/sim" SIMGPU_MEMORY=4GiB BROKER_TEST_DIR="$state/cases" \
  BURST_BENCH_ROUNDS="${2:-5}" "$build/tests/broker/broker_e2e_test" --gtest_filter='ElasticBench.*' > "$state/out" 2>&1 || rc=$?
grep '^alloc-pair ' "$state/out" || true
if [ "$rc" -ne 0 ] || grep -q '^\[  FAILED  \]' "$state/out"; then
  echo "burst_overhead: the benchmark failed (exit $rc); its output:" >&2
  cat "$state/out" >&2
  exit 1
fi
