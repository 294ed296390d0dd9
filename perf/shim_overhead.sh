#!/usr/bin/env bash
# Measures what libcushare.so adds to each benchmark in shim_bench: runs it without and with the
# shim (a limit set, so the policy path runs) and prints the medians and their difference.
#   usage: perf/shim_overhead.sh [--null] [build dir]   (default: build)
# --null runs against perf/null_driver.cpp, a driver that does nothing, so the shim's own cost is
# what is measured; without it the driver is simgpu, whose own work (mmap, worker threads) is
# microseconds and hides differences of a few hundred nanoseconds.
set -euo pipefail
bench=shim_bench
libdir=simgpu
if [ "${1:-}" = --null ]; then bench=shim_bench_null; libdir=nulldriver; shift; fi
build=${1:-build}
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
export LD_LIBRARY_PATH="$build/lib/$libdir" SIMGPU_STATE_DIR="$state/simgpu"
run() { "$build/perf/$bench" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
          --benchmark_min_time=0.2 --benchmark_format=csv 2>/dev/null | grep '_median' ; }
base=$(run)
with=$(LD_PRELOAD="$build/lib/libcushare.so" CUSHARE_TENANT=perf CUSHARE_MEMORY_LIMIT=8GiB \
       CUSHARE_LEDGER_DIR="$state/ledger" run)
printf '%-32s %12s %12s %10s\n' benchmark "without ns" "with ns" "added ns"
paste -d, <(echo "$base") <(echo "$with") | awk -F, '{gsub(/"/,"",$1); gsub(/_median/,"",$1);
  printf "%-32s %12.1f %12.1f %10.1f\n", $1, $3, $13, $13-$3}'
