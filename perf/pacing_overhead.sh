#!/usr/bin/env sh
# What compute scheduling costs a tenant (docs/performance.md, "Compute scheduling: what it costs"):
# the same nvcc-built worker with and without the shim, under a broker on simgpu with device time,
# in PAIRS pairs of runs of MS interleaved ABBA; prints each pair and the median ratio with its
# distribution-free 95 % interval.
#   usage: perf/pacing_overhead.sh [build dir] [case] [pairs] [run ms]
#     case: loop (a capped tenant's launch-bound loop, far under its cap), alone-prio (a high
#           priority tenant alone, a low one configured and idle), bursty (a bursty high tenant
#           next to a saturating low one); PACING_BENCH_US, _DEPTH, _THREADS pass through
#   (defaults: build, loop, 10, 1000)
set -eu
build=${1:-build}
case=${2:-loop}
pairs=${3:-10}
ms=${4:-1000}
PACING_BENCH_CASE="$case" PACING_BENCH_PAIRS="$pairs" PACING_BENCH_MS="$ms" \
  exec "$(dirname "$0")/compute_bench.sh" "$build" 'PacingBench.*' '^(pair|loop|alone-prio|bursty)'
