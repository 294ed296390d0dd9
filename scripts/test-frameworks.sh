#!/usr/bin/env bash
# Optional test tier: real frameworks nobody on the team wrote (CuPy), unmodified, on simgpu, then
# under the cushare shim. Never part of the build or of scripts/test.sh; needs PyPI access the first
# time (the venv is reused afterwards).
#
#   scripts/test-frameworks.sh            # extra arguments go to both pytest runs
#
# FRAMEWORK_VENV          venv to create or reuse (default: build/venv-frameworks)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# Pinned: cupy-cuda13x 14.2.0 links cudart 13.2 statically and loads the toolkit's libnvrtc.so.13
# and libcublas*.so.13 by soname from /usr/local/cuda/lib64.
pins=(cupy-cuda13x==14.2.0 numpy==2.4.6 pytest==9.2.0)

cuda_lib=/usr/local/cuda/lib64
simgpu_lib=$root/build/lib/simgpu
shim=$root/build/lib/libcushare.so

if [[ ! -e $simgpu_lib/libcuda.so.1 || ! -e $shim ]]; then
  echo "test-frameworks: build/ is missing or incomplete; running scripts/build.sh" >&2
  scripts/build.sh
fi
for f in "$simgpu_lib/libcuda.so.1" "$simgpu_lib/libnvidia-ml.so.1" "$shim"; do
  [[ -e $f ]] || { echo "test-frameworks: $f not built" >&2; exit 1; }
done
[[ -e $cuda_lib/libnvrtc.so.13 ]] || { echo "test-frameworks: CUDA 13 toolkit not found at $cuda_lib" >&2; exit 1; }

venv=${FRAMEWORK_VENV:-build/venv-frameworks}
if [[ ! -x $venv/bin/python ]]; then
  echo "test-frameworks: creating venv $venv"
  python3 -m venv "$venv" || { echo "test-frameworks: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
python=$(cd "$venv/bin" && pwd)/python

# Fresh simulated host and kernel cache for this run; removed on exit.
state=$(mktemp -d "${TMPDIR:-/tmp}/cushare-frameworks.XXXXXX")
trap 'rm -rf "$state"' EXIT
mkdir -p "$state/ledger"

common_env=(
  LD_LIBRARY_PATH="$simgpu_lib:$cuda_lib"
  SIMGPU_STATE_DIR="$state/simgpu"
  SIMGPU_MEMORY=4GiB
  CUPY_CACHE_DIR="$state/cupy-cache"
  PYTHONDONTWRITEBYTECODE=1
)
pytest_args=(-m pytest -v -p no:cacheprovider -rfE tests/frameworks "$@")

# run_tier NAME ENV...: runs pytest with ENV, prints its output, and fails the tier if pytest
# failed or if no case passed (all skipped means the tier did not really run).
status=0
run_tier() {
  local name=$1; shift
  local log=$state/$name.log rc=0
  echo "=== frameworks tier: $name ==="
  env "${common_env[@]}" "$@" "$python" "${pytest_args[@]}" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
  if (( rc != 0 )); then
    echo "test-frameworks: $name: pytest exited $rc" >&2
    status=1
  elif ! tail -n 1 "$log" | grep -Eq '[1-9][0-9]* passed'; then
    echo "test-frameworks: $name: no test passed (all skipped?)" >&2
    status=1
  fi
}

run_tier simgpu
run_tier shim \
  LD_PRELOAD="$shim" CUSHARE_TENANT=cupy CUSHARE_MEMORY_LIMIT=256MiB \
  CUSHARE_LEDGER_DIR="$state/ledger"

if (( status == 0 )); then
  echo "test-frameworks: all tiers passed"
else
  echo "test-frameworks: FAILED" >&2
fi
exit $status
