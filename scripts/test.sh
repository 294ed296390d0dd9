#!/usr/bin/env bash
# The whole test suite: installs what the build needs, builds once, runs every CTest test in
# parallel. Tests need no GPU: they run on simgpu, the simulated GPU built here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
cd build
ctest --output-on-failure -j "$(nproc)" --timeout 600 "$@"
