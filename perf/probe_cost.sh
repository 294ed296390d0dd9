#!/usr/bin/env sh
# A probe round's GPU cost on simgpu (docs/performance.md, "Probe rounds"): perf/probe_cost
# (Google Benchmark) in a fresh simgpu state directory, with the hog's cost table and 2 ms time
# slices. Extra arguments go to the benchmark (e.g. --benchmark_format=json). With --check (the
# ctest perf_probe_cost) it checks what the issue asks instead of printing: every probe round
# costs under 1 ms of whole-device time by simgpu's count, next to a hog as alone, and the records
# say no less than the device counted.
#   usage: perf/probe_cost.sh [build dir] [--check | benchmark options...]
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
src=$(cd "$(dirname "$0")/.." && pwd)
state=$(mktemp -d /tmp/cushare-perf.XXXXXX)
trap 'rm -rf "$state"' EXIT
run() {
  LD_LIBRARY_PATH="$build/lib/simgpu" SIMGPU_STATE_DIR="$state/sim" SIMGPU_MEMORY=4GiB \
    SIMGPU_KERNEL_COSTS="$src/tests/probes/probes.costs" SIMGPU_TIME_SLICE_US=2000 \
    "$build/perf/probe_cost" "$@"
}
if [ "${1:-}" != "--check" ]; then
  run "$@"
  exit
fi
run --benchmark_format=json > "$state/out.json"
python3 - "$state/out.json" <<'PY'
import json, sys
rows = {b["name"].split("/iterations")[0]: b for b in json.load(open(sys.argv[1]))["benchmarks"]}
bad = []
for name, b in sorted(rows.items()):
    if b.get("error_occurred"):
        bad.append(f"{name}: {b.get('error_message')}")
        continue
    print(f"{name}: device {b['device_us']:.1f} us, records {b['records_us']:.1f} us, "
          f"{b['of_1ms']:.3f} of 1 ms, host time x{b.get('wall_per_empty', 1):.1f} an empty round's")
    if not name.startswith("BM_ProbeRound"):
        continue
    if not 0 < b["device_us"] < 1000:
        bad.append(f"{name}: {b['device_us']:.1f} us of device time a round (must be under 1000)")
    if b["records_us"] < b["device_us"] * 0.99:
        bad.append(f"{name}: the records say {b['records_us']:.1f} us, the device counted {b['device_us']:.1f}")
for mem in ("0", "1"):
    alone, hog = rows.get(f"BM_ProbeRound/mem:{mem}/hog:0"), rows.get(f"BM_ProbeRound/mem:{mem}/hog:1")
    if alone and hog and "device_us" in alone and "device_us" in hog and hog["device_us"] > alone["device_us"] * 1.05:
        bad.append(f"mem:{mem}: {hog['device_us']:.1f} us next to the hog, {alone['device_us']:.1f} alone: the time box does not hold")
if len(rows) != 6:
    bad.append(f"{len(rows)} benchmarks ran, 6 expected")
for b in bad:
    print("FAIL " + b)
sys.exit(1 if bad else 0)
PY
