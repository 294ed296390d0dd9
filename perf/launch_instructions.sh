#!/usr/bin/env bash
# The launch path's cost (docs/compute.md, docs/performance.md): instructions libcushare.so adds to
# one launch, counted by valgrind's callgrind on the main thread only (--toggle-collect=main: the
# shim's pacer thread is left out), over the null driver (perf/null_driver.cpp), N and 2N
# launches, so start-up and exit cancel out:
#   ((with 2N - with N) - (without 2N - without N)) / N
# for three launch roads (cuLaunchKernel, cuLaunchKernelEx, cuLaunchCooperativeKernel) in three
# configurations: without the shim; with it and no compute mode (standalone: no broker); with it
# and a cap in force (the broker's words written as during the tenant's turn: paced, gate open,
# under the in-flight bound). Then the same loops timed (ns per launch, best of 5 runs of 200,000
# launches), as ratios against the run without the shim.
#   usage: perf/launch_instructions.sh [build dir] [N] [--check]   (defaults: build, 10000)
# --check (the shim_launch_instructions test, in optimised builds without sanitizers) counts only,
# and exits 1 when a paced launch adds more than 150 instructions (issue 11's target) or a launch
# with no compute mode more than 10 (the trampoline's two loads, a test and two branches are 7).
set -euo pipefail
build=${1:-build}
n=${2:-10000}
check=${3:-}
max_paced=150
max_plain=10
status=0
if ! command -v valgrind >/dev/null; then
  apt-get install -y valgrind >/dev/null || { echo "launch_instructions: needs valgrind" >&2; exit 1; }
fi
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
export LD_LIBRARY_PATH="$build/lib/nulldriver"
shim=(LD_PRELOAD="$build/lib/libcushare.so" CUSHARE_TENANT=perf CUSHARE_LEDGER_DIR="$state/ledger")
count() {  # count CALLS MODE ROAD [VAR=VALUE...]
  local calls=$1 mode=$2 road=$3; shift 3
  rm -rf "$state/ledger"
  env "$@" valgrind --tool=callgrind --toggle-collect=main --callgrind-out-file="$state/cg.out" \
    "$build/perf/launch_loop" "$calls" "$mode" "$road" 2>&1 >/dev/null | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
timed() {  # timed MODE ROAD [VAR=VALUE...]: best ns per launch of 5 runs
  local mode=$1 road=$2; shift 2
  local best=
  for _ in 1 2 3 4 5; do
    rm -rf "$state/ledger"
    local t
    t=$(env "$@" "$build/perf/launch_loop" 200000 "$mode" "$road")
    if [ -z "$best" ] || awk "BEGIN{exit !($t < $best)}"; then best=$t; fi
  done
  echo "$best"
}
for road in kernel ex coop; do
  name=$(case $road in kernel) echo cuLaunchKernel ;; ex) echo cuLaunchKernelEx ;; *) echo cuLaunchCooperativeKernel ;; esac)
  b1=$(count "$n" plain "$road" X=1); b2=$(count $((2 * n)) plain "$road" X=1)
  base=$(( (b2 - b1) / n ))
  for mode in plain paced; do
    w1=$(count "$n" "$mode" "$road" "${shim[@]}"); w2=$(count $((2 * n)) "$mode" "$road" "${shim[@]}")
    with=$(( (w2 - w1) / n ))
    max=$([ "$mode" = paced ] && echo $max_paced || echo $max_plain)
    label=$([ "$mode" = paced ] && echo "a cap in force (paced, under budget)" || echo "no compute mode")
    printf '%s, %s: instructions per launch without shim %d, with shim %d, added %d (target <= %d)\n' \
      "$name" "$label" "$base" "$with" $((with - base)) "$max"
    if [ "$check" = --check ] && [ $((with - base)) -gt "$max" ]; then status=1; fi
  done
  if [ "$check" != --check ]; then
    t0=$(timed plain "$road" X=1); t1=$(timed plain "$road" "${shim[@]}"); t2=$(timed paced "$road" "${shim[@]}")
    printf '%s, ns per launch: without shim %s, shim without compute mode %s (x%s), shim with a cap in force %s (x%s)\n' \
      "$name" "$t0" "$t1" "$(awk "BEGIN{printf \"%.2f\", $t1/$t0}")" "$t2" "$(awk "BEGIN{printf \"%.2f\", $t2/$t0}")"
  fi
done
exit $status
