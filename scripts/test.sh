#!/usr/bin/env bash
# The whole test suite: installs what the build needs, builds once, runs every CTest test in
# parallel. Tests need no GPU: they run on simgpu, the simulated GPU built here. Then the shim and
# the unit tests again under ThreadSanitizer (the shim's atomics, its once-only start-up and the
# ledger are where races would hide); NO_SANITIZERS=1 skips that stage.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600 "$@")

if [ "${NO_SANITIZERS:-0}" != 1 ]; then
  echo "== ThreadSanitizer: unit and shim tests"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUSHARE_SANITIZE=thread >/dev/null
  targets=$(ninja -C build-tsan -t targets all | grep -o '^shim_[a-z0-9_]*' | grep -v '^shim_bench' | sort -u)
  cmake --build build-tsan -j "$(nproc)" --target unit_tests cushare_shim simgpu_cuda simgpu_nvml $targets
  (cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest -R 'unit|shim' --output-on-failure -j "$(nproc)" --timeout 900)
fi
