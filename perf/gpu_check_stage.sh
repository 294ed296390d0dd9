#!/usr/bin/env bash
# Stages what perf/gpu_check.sh runs into a small folder, for a GPU machine that cannot build it
# (no network, none of the Debian packages the build needs) and takes at most 64 MiB along:
#   usage: perf/gpu_check_stage.sh [build dir] [stage dir]     (defaults: build, build-gpu)
# Builds the targets in the build dir, copies them stripped of debug information into the same
# places under the stage dir, with the shared libraries the shim needs beyond glibc and
# libstdc++ (libunwind, liblzma) in lib/deps, and checks the total size. Then, on the GPU machine:
#   perf/gpu_check.sh --no-build build-gpu
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
stage=${2:-build-gpu}
cmake --build "$build" --target visibility_probe process_util_probe cushare_shim simgpu_cuda simgpu_nvml timeslice_probe \
  event_resolution mps_sm_probe simgpu_mps_control simgpu_mps_server vmm_export_probe probe_check \
  context_memory_probe driver_answers_probe managed_evict_probe cushare_probes_fatbin busy_for simgpu-smi >/dev/null
rm -rf "$stage"
for f in perf/visibility_probe perf/process_util_probe perf/timeslice_probe perf/event_resolution perf/mps_sm_probe perf/vmm_export_probe \
         perf/probe_check perf/context_memory_probe perf/driver_answers_probe perf/managed_evict_probe lib/libcushare.so lib/simgpu/libcuda.so.1 lib/simgpu/libnvidia-ml.so.1 \
         lib/simgpu/bin/nvidia-cuda-mps-control lib/simgpu/bin/nvidia-cuda-mps-server \
         lib/cushare/probes.fatbin examples/tenant/busy_for tools/simgpu-smi; do
  mkdir -p "$stage/$(dirname "$f")"
  if [ "${f##*.}" = fatbin ]; then cp "$build/$f" "$stage/$f"; else strip --strip-debug -o "$stage/$f" "$build/$f"; fi
done
ln -s libcuda.so.1 "$stage/lib/simgpu/libcuda.so"
ln -s libnvidia-ml.so.1 "$stage/lib/simgpu/libnvidia-ml.so"
mkdir -p "$stage/lib/deps"
for lib in libunwind.so.8 liblzma.so.5; do
  path=$(ldd "$build/lib/libcushare.so" | awk -v l="$lib" '$1 == l { print $3 }')
  [ -n "$path" ] || { echo "gpu_check_stage: the shim does not name $lib" >&2; exit 1; }
  cp -L "$path" "$stage/lib/deps/$lib"
done
size=$(du -sm "$stage" | cut -f1)
echo "gpu_check_stage: $stage holds $size MiB"
[ "$size" -lt 60 ] || { echo "gpu_check_stage: over the 64 MiB a device run carries" >&2; exit 1; }
