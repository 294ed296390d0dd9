#!/usr/bin/env bash
# The whole process's instructions per paced launch (docs/performance.md, "Launches: instructions
# and time"): the launching thread's (perf/launch_instructions.sh, cuLaunchKernel with a cap in
# force) plus the pacer's, which runs on its own thread on a clock (a pass every 100 us while work
# is pending), not per launch. callgrind cannot count the pacer's share of a real run directly: it
# slows the launching thread some fifty-fold but not the pacer's sleeps, so a run under it makes
# fifty times more passes per launch. So the two factors are measured apart, on simgpu under a
# broker, in the launch-bound loop of perf/pacing_overhead.sh (cap 50, far under budget):
#   passes per launch      a run without valgrind (the shim counts its passes, said at exit)
#   instructions per pass  a run under callgrind collecting only inside the pass (its driver calls
#                          included: simgpu's, not a GPU driver's)
# and the pacer's instructions per launch are their product.
#   usage: perf/pacer_instructions.sh [build dir] [native run ms] [callgrind run ms]
#   (defaults: build, 3000, 1000; PACING_BENCH_US, _DEPTH, _THREADS pass through)
set -euo pipefail
build=${1:-build}
ms=${2:-3000}
cgms=${3:-1000}
here=$(dirname "$0")
if ! command -v valgrind >/dev/null; then
  apt-get install -y valgrind >/dev/null || { echo "pacer_instructions: needs valgrind" >&2; exit 1; }
fi
native=$(PACING_BENCH_MS=$ms "$here/compute_bench.sh" "$build" 'PacingBench.PacerPassesPerLaunch' '^pacer')
echo "without valgrind: $native"
cg=$(mktemp /tmp/cushare-cg.XXXXXX)
trap 'rm -f "$cg"' EXIT
wrapped=$(PACING_BENCH_MS=$cgms \
  PACING_BENCH_WRAP="$(command -v valgrind) --tool=callgrind --collect-atstart=no --toggle-collect=*::pass(bool) --callgrind-out-file=$cg" \
  "$here/compute_bench.sh" "$build" 'PacingBench.PacerPassesPerLaunch' '^pacer')
echo "under callgrind: $(echo "$wrapped" | tr '\n' ' ')"
perLaunch=$(sed -n 's/.* \([0-9.]*\) passes per launch$/\1/p' <<<"$native")
perPass=$(sed -n 's/.*, \([0-9]*\) per pass$/\1/p' <<<"$wrapped")
[ -n "$perLaunch" ] && [ -n "$perPass" ] || { echo "pacer_instructions: a run gave no figure" >&2; exit 1; }
launch=$("$here/launch_instructions.sh" "$build" 10000 --check |
  sed -n 's/^cuLaunchKernel, a cap in force.*, added \([0-9-]*\) .*/\1/p')
[ -n "$launch" ] || { echo "pacer_instructions: perf/launch_instructions.sh gave no figure" >&2; exit 1; }
awk -v l="$launch" -v p="$perPass" -v r="$perLaunch" 'BEGIN {
  printf "instructions added per paced launch: launching thread %d, pacer %.0f (%d per pass x %.5f passes per launch), whole process %.0f (target <= 1000)\n", l, p * r, p, r, l + p * r }'
