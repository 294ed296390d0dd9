#!/usr/bin/env bash
# The whole test suite: installs what the build needs, builds once, runs every CTest test (in
# parallel, then the `timing` ones one at a time: scripts/run-tests.sh). Tests need no GPU: they
# run on simgpu, the simulated GPU built here. Then the shim and the unit tests again under
# ThreadSanitizer (the shim's atomics, its once-only start-up and the ledger are where races would
# hide) and the broker's tests (its threads share the tenants' state); NO_SANITIZERS=1 skips that
# stage. Last, the control socket's request decoder is fuzzed briefly
# with libFuzzer (scripts/fuzz.sh; FUZZ_SECONDS, default 20; 0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
# Two stages: the parallel one, then the tests that judge time one at a time (scripts/run-tests.sh).
scripts/run-tests.sh build "$@"

if [ "${NO_SANITIZERS:-0}" != 1 ]; then
  echo "== ThreadSanitizer: unit, shim and broker tests"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUSHARE_SANITIZE=thread >/dev/null
  targets=$(ninja -C build-tsan -t targets all | grep -o '^shim_[a-z0-9_]*' | grep -v '^shim_bench' | sort -u)
  cmake --build build-tsan -j "$(nproc)" --target unit_tests cushare_shim simgpu_cuda simgpu_nvml $targets \
    broker_e2e_test broker_mps_test broker_containers_test
  # broker_reaping is left out: it measures latency, which TSan distorts (the other broker tests
  # reap too); broker_plugin too: the device plugin's gRPC library is not built with TSan, so its
  # threads' synchronisation is invisible to it (the plain stage runs it).
  (cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest -R 'unit|shim|broker' -E 'broker_reaping|broker_plugin' \
    --output-on-failure -j "$(nproc)" --timeout 900)
fi

if [ "${FUZZ_SECONDS:-20}" != 0 ]; then
  echo "== libFuzzer: the control socket's request decoder"
  scripts/fuzz.sh "${FUZZ_SECONDS:-20}"
fi
