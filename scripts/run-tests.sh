#!/usr/bin/env bash
# Runs the CTest suite of a built tree in two stages, as scripts/test.sh and scripts/flake-hunt.sh
# do: first every test not labelled `timing`, in parallel (one job per core); then the `timing`
# tests one at a time on an otherwise idle suite. A `timing` test judges device time, shares or
# latency that follow the host's clock (simgpu's device time runs on the host's CPU), so how the
# cores are shared at that moment must not decide its verdict (docs/testing.md). Both stages always
# run; the exit status is non-zero if either failed. Extra arguments go to both ctest runs.
#   usage: scripts/run-tests.sh BUILD_DIR [ctest arguments...]
set -uo pipefail
build=${1:?usage: scripts/run-tests.sh BUILD_DIR [ctest arguments...]}
shift
[ -f "$build/CTestTestfile.cmake" ] || { echo "run-tests: $build is not a configured build tree" >&2; exit 2; }
rc=0
echo "== parallel stage: every test but the timing ones, $(nproc) at a time"
(cd "$build" && ctest --output-on-failure -j "$(nproc)" --timeout 600 -LE '^timing$' "$@") || rc=1
echo "== timing stage: the tests that judge time, one at a time"
(cd "$build" && ctest --output-on-failure -j 1 --timeout 600 -L '^timing$' "$@") || rc=1
exit "$rc"
