#!/usr/bin/env bash
# perf/gpu_check.sh run through on simgpu (GPU_CHECK_DRY_RUN=1: simgpu stands in for the driver),
# so that the one run it gets on a borrowed GPU does not fail on the script itself: every step
# runs and is logged to $OUT, nothing differs, the shim's limit is checked on the driver's side
# (and a "shim" that does not enforce is caught), the MPS daemons are gone afterwards.
# Runs it from the folder perf/gpu_check_stage.sh stages, as a GPU machine gets it.
#   usage: gpu_check_dry_run.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -uo pipefail
src=$1 build=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
cd "$src" || exit 1
fail() { echo "gpu_check_dry_run: $*" >&2; exit 1; }

# Run from the staged folder a GPU machine gets (perf/gpu_check_stage.sh), as it will be there.
perf/gpu_check_stage.sh "$build" "$work/stage" >"$work/stage.txt" 2>&1 || { cat "$work/stage.txt" >&2; fail "staging failed"; }
# The managed-memory probe writes and reads what it allocates on the host: keep it small here.
MANAGED_PROBE_MAX_MIB=256 GPU_CHECK_DRY_RUN=1 OUT="$work/out" perf/gpu_check.sh --no-build "$work/stage" >"$work/stdout.txt" 2>&1
rc=$?
log="$work/out/gpu_check.log"
[ "$rc" = 0 ] || { cat "$work/stdout.txt" >&2; fail "exited $rc"; }
cmp -s "$work/stdout.txt" "$log" || fail "the log in \$OUT is not what it printed"
for h in "== 1. device visibility" "== 2. event timer" "== 2. time slice" "== 2. MPS: the multiprocessor count" \
         "== 2. MPS: the probe kernels" "== 3. probe kernels" "== 4. memory an exited exporter" "== 5. the demo's busy_for" \
         "== 6. NVML per-process utilization" "== 7. what one process holds beyond its allocations" \
         "== 8. what the driver answers" "== 9. MIG profiles and placements" "== 10. managed memory"; do
  grep -q "^$h" "$log" || fail "no step '$h' in the log"
done
grep -q "^gpu_check: 0 case(s) where simgpu differs from the driver; 0 case(s) where the shim did not enforce; 0 program(s) failed$" "$log" ||
  fail "its summary is missing or not clean"
grep -q "did not quit\|FAILED" "$log" && fail "a daemon did not quit or a program failed"
# The staged shim finds the libraries staged beside it (a GPU image may lack them).
# (ldd's whole output first: `ldd | grep -q` under pipefail fails when grep stops reading early and
# ldd dies of SIGPIPE, a verdict that depended on scheduling; a flake hunt caught it.)
deps=$(LD_LIBRARY_PATH="$work/stage/lib/deps" ldd "$work/stage/lib/libcushare.so")
for lib in libunwind.so.8 liblzma.so.5; do
  grep -q "$lib => $work/stage/lib/deps/$lib" <<<"$deps" || fail "the staged shim does not find the staged $lib"
done
[ "$(grep -c "^shim .*count=[1-9].* alloc=0/2" "$log")" -ge 10 ] || fail "the shim's cases do not show 1 GiB granted and a byte denied"
[ "$(grep -c "^same: " "$log")" -ge 20 ] || fail "step 8 compared fewer than 20 answers"
grep -q "^same:    facts alloc_charges_nothing=1 prefetch_charges=1 nvml_process_omits_managed=1 alloc_evicts_managed=1 data_intact=1 host_prefetch_frees=1$" "$log" ||
  fail "step 10 did not compare the managed-memory facts"
[ "$(grep -c "^same: .*MIG [0-9]g\." "$log")" -ge 14 ] || fail "step 9 compared fewer than 14 MIG profile lines"
[ "$(grep -c "^MPS client at .*sms attribute=" "$log")" = 11 ] || fail "not every MPS percentage was measured"
for side in driver simgpu; do
  grep -q "^$side-mps-hog round=9 probe=sm " "$log" || fail "no $side probe round beside an MPS hog"
  grep -q "^$side-hog round=9 probe=sm " "$log" || fail "no $side probe round beside a hog"
  grep -Eq "^$side-util pid=[0-9]+ samples=[1-9][0-9]* period_us=" "$log" || fail "no $side NVML utilization samples of the hog"
  grep -q "^$side: step=stack rc=0 .* beyond=0$" "$log" || fail "no $side context memory measured to its last step"
  # It ran and reported each second. What share it reports follows how much CPU this host gives
  # simgpu at that moment (the suite's parallel stage: anything from 100 % down), so it is not
  # judged here: install_layout judges busy_for's share under a cap, the demo shows it.
  grep -Eq "^\[$side\] second 2: +[0-9]+ % of the device's time" "$log" || fail "busy_for on the $side side"
done
for f in environment.txt mps-logs.tgz; do [ -s "$work/out/$f" ] || fail "no $f in \$OUT"; done
for d in /tmp/cushare-gpu-check-mps /tmp/cushare-gpu-check-sim-mps; do [ ! -e "$d" ] || fail "$d left behind"; done

# A preloaded library that limits nothing (simgpu's NVML, as a stand-in shim): every shim case
# with a device is reported, and the run fails. Visibility only.
cp -a "$work/stage" "$work/noshim"
cp "$work/stage/lib/simgpu/libnvidia-ml.so.1" "$work/noshim/lib/libcushare.so"
GPU_CHECK_DRY_RUN=1 GPU_CHECK_STEPS=1 OUT="$work/out-noshim" perf/gpu_check.sh --no-build "$work/noshim" >/dev/null 2>&1
rc=$?
[ "$rc" = 1 ] || fail "a shim that limits nothing: exit $rc, not 1"
[ "$(grep -c "SHIM NOT ENFORCING" "$work/out-noshim/gpu_check.log")" -ge 10 ] || fail "a shim that limits nothing was not reported"
grep -q "^== 2\." "$work/out-noshim/gpu_check.log" && fail "GPU_CHECK_STEPS=1 ran other steps"

# A program that runs past its timeout is said, counted, and fails the run; the next one runs.
GPU_CHECK_DRY_RUN=1 GPU_CHECK_STEPS=5 GPU_CHECK_STEP_TIMEOUT=1 OUT="$work/out-timeout" \
  perf/gpu_check.sh --no-build "$work/stage" >/dev/null 2>&1
rc=$?
[ "$rc" = 1 ] || fail "programs past their timeout: exit $rc, not 1"
[ "$(grep -c "^gpu_check: FAILED (exit 124, timed out after 1 s): .*busy_for --seconds 2 --name" "$work/out-timeout/gpu_check.log")" = 2 ] ||
  fail "busy_for past its timeout on both sides was not reported"
grep -q "; 2 program(s) failed$" "$work/out-timeout/gpu_check.log" || fail "the failures were not counted"

# Nothing to run: a clear refusal (2), not a run of missing programs.
OUT="$work/out-empty" GPU_CHECK_DRY_RUN=1 perf/gpu_check.sh --no-build "$work/empty-build" >/dev/null 2>&1
rc=$?
[ "$rc" = 2 ] || fail "a missing build dir: exit $rc, not 2"
echo "gpu_check_dry_run: every step ran, nothing differs, a shim that limits nothing is caught"
