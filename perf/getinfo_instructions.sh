#!/usr/bin/env bash
# Counts the instructions libcushare.so adds to one cuMemGetInfo, deterministically: runs
# perf/getinfo_loop.cpp under valgrind's callgrind over the null driver (perf/null_driver.cpp),
# N and 2N calls, without and with the shim (a limit set, so the tenant view runs), and prints
#   ((with 2N - with N) - (without 2N - without N)) / N
# start-up and exit cancel out. Twice: with the process holding nothing, and holding 1 MiB (the
# tenant then uses memory, which the view subtracts). Installs valgrind with apt-get if it is missing.
#   usage: perf/getinfo_instructions.sh [build dir] [N] [--check]   (defaults: build, 10000)
# The target (issue 9) is at most 250 instructions per call; --check exits 1 above it (the
# shim_getinfo_instructions test of the suite, in optimised builds without sanitizers).
set -euo pipefail
build=${1:-build}
n=${2:-10000}
check=${3:-}
max=250
status=0
if ! command -v valgrind >/dev/null; then
  apt-get install -y valgrind >/dev/null || { echo "getinfo_instructions: needs valgrind (apt-get install valgrind)" >&2; exit 1; }
fi
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
export LD_LIBRARY_PATH="$build/lib/nulldriver"
# Total instructions of one run (callgrind's "Collected" line): count CALLS HOLD [VAR=VALUE...]
count() {
  local calls=$1 hold=$2; shift 2
  rm -rf "$state/ledger"  # every run creates its ledger: the same start-up in all four
  env "$@" valgrind --tool=callgrind --callgrind-out-file="$state/cg.out" \
    "$build/perf/getinfo_loop" "$calls" "$hold" 2>&1 >/dev/null | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
for hold in 0 1048576; do
  shim=(LD_PRELOAD="$build/lib/libcushare.so" CUSHARE_TENANT=perf CUSHARE_MEMORY_LIMIT=8GiB
        CUSHARE_LEDGER_DIR="$state/ledger")
  b1=$(count "$n" "$hold" X=1); b2=$(count $((2 * n)) "$hold" X=1)
  w1=$(count "$n" "$hold" "${shim[@]}"); w2=$(count $((2 * n)) "$hold" "${shim[@]}")
  base=$(( (b2 - b1) / n )); with=$(( (w2 - w1) / n ))
  printf 'cuMemGetInfo, holding %7d bytes: instructions per call without shim %d, with shim %d, added %d (target <= %d)\n' \
    "$hold" "$base" "$with" $((with - base)) "$max"
  if [ "$check" = --check ] && [ $((with - base)) -gt $max ]; then status=1; fi
done
exit $status
