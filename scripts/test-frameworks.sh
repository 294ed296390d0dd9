#!/usr/bin/env bash
# Optional test tier: real frameworks nobody on the team wrote (CuPy, PyTorch, ONNX Runtime), unmodified, on
# simgpu, then under the cushare shim; and a first CUDA program against every CUDA 13 runtime PyPI
# ships (nvidia-cuda-runtime 13.0 to 13.5, shared and static). Never part of the build or of
# scripts/test.sh; needs PyPI access the first time (about 23 GB downloaded; 37 GB on disk: a 6 GB
# venv and 31 GB of unpacked runtime, cuBLAS and cuDNN wheels), reused afterwards.
#
#   scripts/test-frameworks.sh            # extra arguments go to every pytest run
#
# FRAMEWORK_VENV          venv to create or reuse (default: build/venv-frameworks)
# FRAMEWORK_CACHE         where the runtime wheels are kept (default: build/framework-cache)
# PIP_CACHE_DIR           pip's own cache (pip's default unless set)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# Pinned: cupy-cuda13x 14.2.0 links cudart 13.2 statically; with its [ctk] extra (the toolkit's
# libraries as nvidia-* wheels) it loads NVRTC and cuBLAS from those wheels.
# torch 2.15.0 from PyPI is the CUDA 13 build (+cu132): it brings its own libcudart.so.13 (13.2, the
# nvidia-cuda-runtime wheel, found through its RPATH) and the other nvidia-* CUDA 13 wheels.
# onnxruntime-gpu 1.31.1 with its [cuda,cudnn] extras: the nvidia-* CUDA 13 wheels it names (pip
# picks cuBLAS and cuDNN versions torch's pins also accept), loaded by onnxruntime.preload_dlls().
pins=("cupy-cuda13x[ctk]==14.2.0" numpy==2.4.6 pytest==9.2.0 torch==2.15.0 nvidia-ml-py==13.615.71
  "onnxruntime-gpu[cuda,cudnn]==1.31.1" onnx==1.23.2)
# Every nvidia-cuda-runtime 13.x build on PyPI, for the runtime probe.
runtimes=(13.0.48 13.0.88 13.0.96 13.1.80 13.2.51 13.2.75 13.2.86 13.3.29 13.4.49 13.4.92 13.5.37)
# Every cuBLAS 13.x and cuDNN 9.x wheel for CUDA 13 on PyPI, for their first-call probe (about
# 450 MB and 300-700 MB each, 51 wheels, about 28 GB in all, fetched once into the cache). cuBLAS
# asks the driver for a stream's green context from 13.5.1.27, cuDNN from 9.23.2.1.
cublases=(13.0.0.19 13.0.2.14 13.1.0.3 13.1.1.3 13.1.2.11 13.2.0.9 13.2.1.1 13.2.2.2 13.3.0.5 13.4.0.1
  13.4.1.1 13.4.1.3 13.4.2.4 13.4.3.11 13.5.1.27 13.6.0.2 13.6.1.10 13.6.2.16 13.7.0.27 13.8.0.4
  13.8.1.7 13.8.2.12 13.10.0.20)
cudnns=(9.12.0.46 9.13.0.50 9.13.1.26 9.14.0.64 9.15.0.57 9.15.1.9 9.16.0.29 9.17.0.29 9.17.1.4 9.18.0.77
  9.18.1.3 9.19.0.56 9.19.1.2 9.20.0.48 9.21.0.82 9.21.1.3 9.22.0.52 9.23.0.39 9.23.1.3 9.23.2.1
  9.24.0.43 9.24.1.1 9.25.1.1 9.26.0.51 9.26.1.1 9.27.0.42 9.28.0.42 9.28.1.4)

cuda_lib=/usr/local/cuda/lib64
simgpu_lib=$root/build/lib/simgpu
shim=$root/build/lib/libcushare.so

if [[ ! -e $simgpu_lib/libcuda.so.1 || ! -e $shim ]]; then
  echo "test-frameworks: build/ is missing or incomplete; running scripts/build.sh" >&2
  scripts/build.sh
fi
for f in "$simgpu_lib/libcuda.so.1" "$simgpu_lib/libnvidia-ml.so.1" "$shim" "$root/build/bin/cushare-broker"; do
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

cache=${FRAMEWORK_CACHE:-build/framework-cache}
mkdir -p "$cache/runtimes"
for v in "${runtimes[@]}"; do
  if [[ ! -e $cache/runtimes/$v/nvidia/cu13/lib/libcudart.so.13 ]]; then
    echo "test-frameworks: fetching nvidia-cuda-runtime $v"
    rm -rf "$cache/runtimes/$v.tmp" && mkdir -p "$cache/runtimes/$v.tmp"
    "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 -d "$cache/runtimes/$v.tmp" "nvidia-cuda-runtime==$v"
    "$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
      "$(ls "$cache/runtimes/$v.tmp"/*.whl)" "$cache/runtimes/$v.tmp"
    rm -f "$cache/runtimes/$v.tmp"/*.whl
    rm -rf "$cache/runtimes/$v" && mv "$cache/runtimes/$v.tmp" "$cache/runtimes/$v"
  fi
done

# fetch_wheel KIND PACKAGE VERSION LIBRARY: the wheel unpacked in $cache/KIND/VERSION (once);
# LIBRARY is the path the runs below use, under the unpacked wheel.
fetch_wheel() {
  local kind=$1 package=$2 v=$3 library=$4
  [[ -e $cache/$kind/$v/$library ]] && return 0
  echo "test-frameworks: fetching $package $v"
  rm -rf "$cache/$kind/$v.tmp" && mkdir -p "$cache/$kind/$v.tmp"
  # The interpreter's own platform: older wheels are tagged manylinux_2_27, which a
  # --platform manylinux2014_x86_64 request would not accept.
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$cache/$kind/$v.tmp" "$package==$v"
  "$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$(ls "$cache/$kind/$v.tmp"/*.whl)" "$cache/$kind/$v.tmp"
  rm -f "$cache/$kind/$v.tmp"/*.whl  # the unpacked wheel is what the runs use
  rm -rf "$cache/$kind/$v" && mv "$cache/$kind/$v.tmp" "$cache/$kind/$v"
}
mkdir -p "$cache/cublas" "$cache/cudnn"
for v in "${cublases[@]}"; do fetch_wheel cublas nvidia-cublas "$v" nvidia/cu13/lib/libcublas.so.13; done
for v in "${cudnns[@]}"; do fetch_wheel cudnn nvidia-cudnn-cu13 "$v" nvidia/cudnn/lib/libcudnn.so.9; done

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
pytest_args=(-m pytest -v -p no:cacheprovider -rfE)

# run_tier NAME TESTS ENV...: runs pytest on TESTS with ENV, prints its output, and fails the tier if
# pytest failed or if no case passed (all skipped means the tier did not really run).
status=0
run_tier() {
  local name=$1 tests=$2; shift 2
  local log=$state/$name.log rc=0
  echo "=== frameworks tier: $name ==="
  env "${common_env[@]}" "$@" "$python" "${pytest_args[@]}" "$tests" "${extra_args[@]}" 2>&1 | tee "$log" \
    || rc=${PIPESTATUS[0]}
  if (( rc != 0 )); then
    echo "test-frameworks: $name: pytest exited $rc" >&2
    status=1
  elif ! tail -n 1 "$log" | grep -Eq '[1-9][0-9]* passed'; then
    echo "test-frameworks: $name: no test passed (all skipped?)" >&2
    status=1
  fi
}
extra_args=("$@")

# The runtime probe: one program, built once, run against every runtime: the shared library first
# on LD_LIBRARY_PATH, and the wheel's libcudart_static.a linked in.
echo "=== frameworks tier: cuda runtimes ==="
probe_dir=$state/probe
mkdir -p "$probe_dir"
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
"$nvcc" -O1 -I simgpu/include -c tests/frameworks/cudart/probe.cu -o "$probe_dir/probe.o"
"$nvcc" -O1 -cudart shared -Xlinker -export-dynamic "$probe_dir/probe.o" -o "$probe_dir/probe_shared"
for v in "${runtimes[@]}"; do
  lib=$cache/runtimes/$v/nvidia/cu13/lib
  g++ "$probe_dir/probe.o" -o "$probe_dir/probe_static_$v" -rdynamic "$lib/libcudart_static.a" -ldl -lpthread -lrt
  for kind in shared static; do
    if [[ $kind == shared ]]; then
      run=(env LD_LIBRARY_PATH="$lib:$simgpu_lib" "$probe_dir/probe_shared")
    else
      run=(env LD_LIBRARY_PATH="$simgpu_lib" "$probe_dir/probe_static_$v")
    fi
    want=$(( ${v%%.*} * 1000 + $(cut -d. -f2 <<<"$v") * 10 ))
    if out=$(SIMGPU_STATE_DIR="$state/probe-$v-$kind" "${run[@]}" 2>&1) && grep -q "^probe ok runtime $want " <<<"$out"; then
      echo "cudart $v $kind: ok"
    else
      echo "cudart $v $kind: FAILED: $out" >&2
      status=1
    fi
  done
done

# cuBLAS's and cuDNN's first calls (a handle on a created stream, one SGEMM; one convolution) with
# each wheel found first on LD_LIBRARY_PATH, without and with the shim.
echo "=== frameworks tier: cublas, cudnn ==="
g++ -O1 -I /usr/local/cuda/include tests/frameworks/libraries/cublas_first_call.cpp \
  -o "$probe_dir/cublas_first_call" -L "$cuda_lib" -lcublas -lcudart
g++ -O1 -I /usr/local/cuda/include tests/frameworks/libraries/cudnn_first_call.cpp \
  -o "$probe_dir/cudnn_first_call" -L "$cuda_lib" -lcudnn -lcudart
newest_cublas=$cache/cublas/${cublases[-1]}/nvidia/cu13/lib
# first_call NAME LIBDIR WANT PROGRAM: runs PROGRAM with LIBDIR first, without and with the shim.
first_call() {
  local name=$1 libdir=$2 want=$3 program=$4 kind out
  for kind in simgpu shim; do
    local run=(env LD_LIBRARY_PATH="$libdir:$simgpu_lib:$cuda_lib" SIMGPU_STATE_DIR="$state/$name-$kind")
    [[ $kind == shim ]] && run+=(LD_PRELOAD="$shim" CUSHARE_TENANT=lib CUSHARE_MEMORY_LIMIT=256MiB \
      CUSHARE_LEDGER_DIR="$state/ledger-$name")
    if out=$("${run[@]}" "$program" 2>&1) && grep -q "^$want$" <<<"$out"; then
      echo "$name $kind: ok"
    else
      echo "$name $kind: FAILED: $out" >&2
      status=1
    fi
  done
}
for v in "${cublases[@]}"; do
  IFS=. read -r major minor patch _ <<<"$v"
  first_call "cublas-$v" "$cache/cublas/$v/nvidia/cu13/lib" "cublas ok $(( 10#$major * 10000 + 10#$minor * 100 + 10#$patch ))" \
    "$probe_dir/cublas_first_call"
done
first_call cudnn-toolkit "$cuda_lib" "cudnn ok [0-9][0-9]*" "$probe_dir/cudnn_first_call"
for v in "${cudnns[@]}"; do
  IFS=. read -r major minor patch _ <<<"$v"
  first_call "cudnn-$v" "$cache/cudnn/$v/nvidia/cudnn/lib:$newest_cublas" \
    "cudnn ok $(( 10#$major * 10000 + 10#$minor * 100 + 10#$patch ))" "$probe_dir/cudnn_first_call"
done

# ONNX Runtime as pip installs it: its CUDA libraries from the nvidia-* wheels, no preload but
# the shim; judged by its own view and by simgpu-smi's count of the device.
run_tier onnxruntime-simgpu tests/frameworks/test_onnxruntime.py LD_LIBRARY_PATH="$simgpu_lib" \
  SIMGPU_SMI="$root/build/tools/simgpu-smi"
run_tier onnxruntime-shim tests/frameworks/test_onnxruntime.py LD_LIBRARY_PATH="$simgpu_lib" \
  SIMGPU_SMI="$root/build/tools/simgpu-smi" LD_PRELOAD="$shim" CUSHARE_TENANT=ort CUSHARE_MEMORY_LIMIT=256MiB \
  CUSHARE_LEDGER_DIR="$state/ledger-ort"
run_tier cupy-simgpu tests/frameworks/test_cupy.py
run_tier cupy-shim tests/frameworks/test_cupy.py \
  LD_PRELOAD="$shim" CUSHARE_TENANT=cupy CUSHARE_MEMORY_LIMIT=256MiB \
  CUSHARE_LEDGER_DIR="$state/ledger"
# PyTorch as pip installs it: no runtime swapped in (LD_LIBRARY_PATH holds simgpu only, so
# PyTorch's own libcudart and CUDA libraries come from its wheels), no preload but the shim.
run_tier torch-simgpu tests/frameworks/test_torch.py LD_LIBRARY_PATH="$simgpu_lib"
run_tier torch-shim tests/frameworks/test_torch.py LD_LIBRARY_PATH="$simgpu_lib" \
  LD_PRELOAD="$shim" CUSHARE_TENANT=torch CUSHARE_MEMORY_LIMIT=512MiB \
  CUSHARE_LEDGER_DIR="$state/ledger"
# PyTorch bursting above its guarantee and being reclaimed (docs/memory-elasticity.md): a broker
# per case on a 1 GiB device; the shim is preloaded into the PyTorch children only.
run_tier torch-bursting tests/frameworks/test_torch_bursting.py LD_LIBRARY_PATH="$simgpu_lib" SIMGPU_MEMORY=1GiB \
  SIMGPU_STATE_DIR="$state/simgpu-bursting" FRAMEWORK_BROKER="$root/build/bin/cushare-broker" FRAMEWORK_SHIM="$shim"

if (( status == 0 )); then
  echo "test-frameworks: all tiers passed"
else
  echo "test-frameworks: FAILED" >&2
fi
exit $status
