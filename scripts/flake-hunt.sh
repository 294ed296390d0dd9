#!/usr/bin/env bash
# Hunts flaky tests: runs the suite's stages (scripts/run-tests.sh) N times on a built tree, the
# last H of them with CPU-bound jobs running beside, never stopping at a failure, and writes a
# report of every failure with the failing test's output. A flake found here is fixed at its root
# (docs/testing.md): no retry-until-green.
#   usage: scripts/flake-hunt.sh N [--hog H] [--hog-jobs J] [--stage parallel|timing|all]
#                                [--build DIR] [--report FILE] [-- ctest arguments...]
#   N           repeats (each runs the chosen stages once)
#   --hog H     the last H repeats run beside J CPU-bound busy loops (default 0)
#   --hog-jobs  J busy loops (default 1)
#   --stage     which stages each repeat runs (default all: parallel, then timing)
#   --build     the built tree (default build; scripts/build.sh makes it)
#   --report    the report (default tests/flake-hunt-report.md); logs go under BUILD/flake-hunt
# Exits 0 when every repeat passed, 1 when any test failed, 2 on bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '3,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

n=${1:-}
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "flake-hunt: N must be a positive number of repeats, not '${n}'" >&2; usage; }
shift
hog=0 hog_jobs=1 stage=all build=build report=tests/flake-hunt-report.md
while [ $# -gt 0 ]; do
  case $1 in
    --hog) hog=${2:-}; shift 2 ;;
    --hog-jobs) hog_jobs=${2:-}; shift 2 ;;
    --stage) stage=${2:-}; shift 2 ;;
    --build) build=${2:-}; shift 2 ;;
    --report) report=${2:-}; shift 2 ;;
    --) shift; break ;;
    *) echo "flake-hunt: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ "$hog" =~ ^[0-9]+$ ]] && [ "$hog" -le "$n" ] || { echo "flake-hunt: --hog must be 0 to N ($n), not '$hog'" >&2; exit 2; }
[[ "$hog_jobs" =~ ^[1-9][0-9]*$ ]] || { echo "flake-hunt: --hog-jobs must be a positive number, not '$hog_jobs'" >&2; exit 2; }
case $stage in parallel | timing | all) ;; *) echo "flake-hunt: --stage must be parallel, timing or all, not '$stage'" >&2; exit 2 ;; esac
[ -f "$build/CTestTestfile.cmake" ] || { echo "flake-hunt: $build is not a built tree (run scripts/build.sh)" >&2; exit 2; }

logs="$build/flake-hunt"
rm -rf "$logs"
mkdir -p "$logs"
hogs=()
stop_hogs() { [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null; wait "${hogs[@]}" 2>/dev/null; hogs=(); }
trap stop_hogs EXIT

# One stage of one repeat: ctest's log and the failed tests' names kept under $logs/rK-STAGE.
run_stage() {  # $1: repeat, $2: stage; appends "repeat stage seconds total failed names..." to $logs/runs
  local k=$1 s=$2 dir="$logs/r$1-$2" label t0 rc
  mkdir -p "$dir"
  if [ "$s" = parallel ]; then label=(-j "$(nproc)" -LE '^timing$'); else label=(-j 1 -L '^timing$'); fi
  rm -f "$build/Testing/Temporary/LastTestsFailed.log"
  t0=$(date +%s)
  (cd "$build" && ctest --timeout 600 "${label[@]}" "$@") >"$dir/ctest.txt" 2>&1
  rc=$?
  local secs=$(($(date +%s) - t0))
  cp "$build/Testing/Temporary/LastTest.log" "$dir/LastTest.log" 2>/dev/null
  local failed=()
  [ -f "$build/Testing/Temporary/LastTestsFailed.log" ] && mapfile -t failed < <(cut -d: -f2- "$build/Testing/Temporary/LastTestsFailed.log")
  local total
  total=$(sed -n 's/.* tests passed, [0-9]* tests failed out of \([0-9]*\)$/\1/p' "$dir/ctest.txt" | tail -1)
  [ "$rc" != 0 ] && [ ${#failed[@]} = 0 ] && failed=("(ctest exit $rc; see $dir/ctest.txt)")
  echo "$k $s $secs ${total:-0} ${#failed[@]} ${failed[*]}" >>"$logs/runs"
  printf 'flake-hunt: repeat %d %-8s %4d s  %s tests, %d failed %s\n' "$k" "$s" "$secs" "${total:-0}" "${#failed[@]}" "${failed[*]}"
}

stages=(parallel timing)
[ "$stage" = all ] || stages=("$stage")
started=$(date -u +%FT%TZ)
for k in $(seq 1 "$n"); do
  if [ "$k" -gt $((n - hog)) ] && [ ${#hogs[@]} = 0 ]; then
    for _ in $(seq 1 "$hog_jobs"); do (while :; do :; done) & hogs+=($!); done
    echo "flake-hunt: from repeat $k on, $hog_jobs CPU-bound job(s) beside"
  fi
  for s in "${stages[@]}"; do run_stage "$k" "$s" "$@"; done
done
stop_hogs

# The report: one row per stage run, then each failure's output (the end of its ctest log).
{
  echo "# Flake hunt report"
  echo
  echo "\`scripts/flake-hunt.sh $n --hog $hog --hog-jobs $hog_jobs --stage $stage${*:+ -- $*}\`, started $started,"
  echo "finished $(date -u +%FT%TZ); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- . ":(exclude)$report" 2>/dev/null || echo ' (with uncommitted changes)');"
  echo "$(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB; stages as scripts/run-tests.sh runs them."
  echo
  echo "| repeat | beside | stage | seconds | tests | failed |"
  echo "|---|---|---|---|---|---|"
  while read -r k s secs total nf names; do
    beside=idle
    [ "$k" -gt $((n - hog)) ] && beside="$hog_jobs busy loop(s)"
    echo "| $k | $beside | $s | $secs | $total | ${names:-0} |"
  done <"$logs/runs"
  echo
  fails=$(awk '$5 > 0' "$logs/runs" | wc -l)
  if [ "$fails" = 0 ]; then
    echo "Every repeat passed."
  else
    echo "## Failures"
    while read -r k s secs total nf names; do
      [ "$nf" -gt 0 ] || continue
      for t in $names; do
        echo
        echo "### $t (repeat $k, $s stage)"
        echo
        echo '```'
        awk -v t="$t" '$0 ~ "^[0-9]+/[0-9]+ Test: " t "$" {on=1} on {print} on && /^<end of output>/ {exit}' \
          "$logs/r$k-$s/LastTest.log" 2>/dev/null | grep -v '^\[ \+\(OK\|RUN\) \+\]' | tail -60
        echo '```'
      done
    done <"$logs/runs"
  fi
} >"$report"
echo "flake-hunt: report in $report; logs under $logs"
awk '$5 > 0 {bad=1} END {exit bad}' "$logs/runs"
