#!/usr/bin/env sh
# Metering's cost to a saturating tenant (docs/compute.md, docs/performance.md): kernels per second
# of one process keeping the device busy with short kernels, under the broker with compute
# metering off and on, on simgpu with device time. PAIRS pairs of runs of MS each, off and on
# interleaved (ABBA); the median of the pairs' on/off ratios with its 95 % interval, which says
# whether the 1 % target is confirmed, refuted, or not decidable at this many pairs.
#   usage: perf/metering_overhead.sh [build dir] [kernel us] [pairs] [run ms]
#          (defaults: build, 200, 20, 1000); CUSHARE_METERING=events|cupti|auto passes through
set -eu
build=${1:-build}
us=${2:-200}
pairs=${3:-20}
ms=${4:-1000}
METERING_BENCH_US="$us" METERING_BENCH_PAIRS="$pairs" METERING_BENCH_MS="$ms" \
  exec "$(dirname "$0")/compute_bench.sh" "$build" 'MeteringBench.*' '^(pair|kernels of)'
