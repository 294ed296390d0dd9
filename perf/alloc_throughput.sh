#!/usr/bin/env bash
# Allocation throughput of one tenant with 1 to 16 threads in each of 1 to 8 processes (64 threads
# at most), with and without the shim (perf/alloc_throughput.cpp; figures in docs/performance.md).
# Builds what it needs, runs every (processes, threads) pair with and without the shim in one run
# (repetitions randomly interleaved, so drift of the host hits both alike) and prints the medians.
#   usage: perf/alloc_throughput.sh [build dir]   (default: build)
# The ratio shim/baseline is the figure to compare across machines and days; absolute rates drift
# on shared hosts.
set -euo pipefail
build=${1:-build}
cmake --build "$build" --target alloc_throughput >/dev/null
out=$(mktemp /tmp/cushare-alloc-throughput.XXXXXX.json)
trap 'rm -f "$out"' EXIT
# Every repetition goes to the JSON file (so that an error in any of them is seen); the console,
# on stderr as progress, shows the aggregates.
"$build/perf/alloc_throughput" --benchmark_repetitions=5 --benchmark_min_time=0.3 \
  --benchmark_enable_random_interleaving=true --benchmark_display_aggregates_only=true \
  --benchmark_out="$out" --benchmark_out_format=json >&2
python3 - "$out" "$(nproc)" <<'EOF'
import json, re, sys

runs = json.load(open(sys.argv[1]))["benchmarks"]
cores = int(sys.argv[2])
errors = [r for r in runs if r.get("error_occurred")]
for r in errors:
    print(f"{r['name']}: {r['error_message']}", file=sys.stderr)
if errors:
    sys.exit(1)

med = {}  # (mode, procs, threads) -> median aggregate
for r in runs:
    if r.get("aggregate_name") != "median":
        continue
    m = re.match(r"(\w+)/procs:(\d+)/threads:(\d+)/", r["run_name"])
    med[(m[1], int(m[2]), int(m[3]))] = r

print(f"{'P':>2} {'T':>3} {'P*T':>4} | {'base Mop/s':>10} {'shim Mop/s':>10} {'shim/base':>9} | "
      f"{'shim ns/pair/thr':>16} | {'cpu ns/pair base':>16} {'shim':>6}")
for (mode, p, t), shim in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][2])):
    if mode != "shim":
        continue
    base = med[("baseline", p, t)]
    b, s = base["items_per_second"] / 1e6, shim["items_per_second"] / 1e6
    mark = "*" if p * t > cores else " "
    print(f"{p:>2} {t:>3} {p * t:>3}{mark} | {b:>10.1f} {s:>10.2f} {s / b:>9.3f} | "
          f"{p * t * 1e3 / s:>16.0f} | {base['cpu_ns_per_pair']:>16.1f} "
          f"{shim['cpu_ns_per_pair']:>6.1f}")
print(f"""
Medians of 5 repetitions; a pair is one cuMemAlloc + cuMemFree of 4 KiB, over the null driver.
Mop/s: pairs per second over all threads of all processes (first start to last end).
ns/pair/thr: wall time one thread takes per pair (P*T / rate): includes waiting for a core.
cpu ns/pair: on-core time per pair (thread CPU time): time slicing and other load on the host do
  not raise it, contention on shared cache lines and spinning on a preempted lock holder do.
* P*T > {cores} cores: oversubscribed. The total rate cannot exceed what {cores} cores give; the
  wall time per pair per thread grows with P*T/{cores} from time slicing alone. Compare cpu ns/pair
  with the P*T <= {cores} rows to tell contention from time slicing.""")
EOF
