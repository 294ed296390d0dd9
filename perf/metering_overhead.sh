#!/usr/bin/env sh
# Metering's cost to a saturating tenant (docs/compute.md, docs/performance.md): kernels per second
# of one process keeping the device busy with short kernels, under the broker with compute
# metering off and on, on simgpu with device time; best of 3 runs each, and the ratio.
#   usage: perf/metering_overhead.sh [build dir] [kernel us]   (defaults: build, 200)
set -eu
build=${1:-build}
us=${2:-200}
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
cat > "$state/costs" <<COSTS
spin block_ns_param=1
COSTS
LD_LIBRARY_PATH="$build/lib/simgpu" SIMGPU_STATE_DIR="$state/sim" SIMGPU_MEMORY=4GiB \
  SIMGPU_KERNEL_COSTS="$state/costs" BROKER_TEST_DIR="$state/cases" METERING_BENCH_US="$us" \
  "$build/tests/compute/compute_test" --gtest_filter=MeteringBench.* | grep 'kernels of'
