#!/usr/bin/env bash
# On a host with a real NVIDIA GPU: measures what docs/simgpu.md marks [unverified] and compares
# simgpu with the real driver, without and with libcushare.so preloaded.
#   usage: perf/gpu_check.sh [--no-build] [build dir]   (default: build)
# Builds (unless --no-build) the shim and perf/visibility_probe, then runs the probe for each
# CUDA_VISIBLE_DEVICES value below, once against the real driver and once against simgpu set up
# with as many devices as the host has (UUIDs are written as {U0}, {U1}, ... and replaced by each
# side's own), both with CUDA_DEVICE_ORDER=PCI_BUS_ID so that indices are nvidia-smi's. The
# probe's devices are printed as host indices. Then the same with the shim preloaded (a 1 GiB
# limit): the devices seen must not change, and on each visible device 1 GiB is granted and one
# more byte denied. Prints one line per case and "DIFFERENT" where simgpu and the driver disagree;
# exits 1 if any case differs, 0 otherwise. Needs nvidia-smi; changes nothing on the host (the
# shim's ledger and simgpu's state live in a temporary directory). The test suite's end-to-end
# tests judge limits by simgpu's own count, so they run on simgpu only; these probe runs are their
# counterpart against the real driver.
# Then the constants docs/simgpu.md ("Device time", "MPS") marks as guesses, each measured by a
# small nvcc-built probe (perf/*.cu, also run on simgpu by tests/simgpu/process/mps_test.cpp),
# printed for the driver and for simgpu: the event timer's resolution; the time slice and switch
# cost between two processes (two probes at once); and, when nvidia-cuda-mps-control is found,
# the multiprocessor count an MPS client sees at several active thread percentages (a real
# daemon in a temporary pipe directory, quit afterwards; counts that differ count as DIFFERENT).
# Then the probe kernels (cuda_kernels/probes.cu, through the runner: perf/probe_check) alone and
# next to a hog (timeslice_probe's back-to-back 1 ms kernels in another process), on the driver and
# on simgpu: the timer tick, launch-to-start latency, distinct SMs, per-block durations, work rates
# and clock, to fit the guesses of simgpu's twins (docs/simgpu.md, "Probe kernels").
# Last, how the device accounts VMM memory only an exported descriptor keeps alive after its
# maker exited (perf/vmm_export_probe; the broker's left-behind charge relies on it).
# GPU_CHECK_TIMESLICE_LEVELS=1 also measures the slice at each `nvidia-smi compute-policy
# --set-timeslice` level (needs root; changes the GPU's policy, restored to 0 = default after).
set -uo pipefail
build_it=1
if [ "${1:-}" = --no-build ]; then build_it=0; shift; fi
build=${1:-build}
command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: not a GPU host" >&2; exit 2; }
if [ "$build_it" = 1 ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null &&
    cmake --build "$build" --target visibility_probe cushare_shim simgpu_cuda simgpu_nvml timeslice_probe \
      event_resolution mps_sm_probe simgpu_mps_control simgpu_mps_server vmm_export_probe probe_check \
      cushare_probes_fatbin >/dev/null ||
    { echo "gpu_check: build failed" >&2; exit 2; }
fi
probe="$build/perf/visibility_probe"
shim="$build/lib/libcushare.so"
tmp=$(mktemp -d /tmp/cushare-gpu-check.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export CUDA_DEVICE_ORDER=PCI_BUS_ID

mapfile -t real_uuids < <(nvidia-smi --query-gpu=uuid --format=csv,noheader | tr -d ' ')
n=${#real_uuids[@]}
[ "$n" -ge 1 ] || { echo "gpu_check: nvidia-smi lists no GPU" >&2; exit 2; }
echo "host: $n GPU(s); driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"

# simgpu with as many devices; its UUIDs in host order.
sim() { env LD_LIBRARY_PATH="$build/lib/simgpu" SIMGPU_DEVICES="$n" SIMGPU_STATE_DIR="$tmp/simgpu" "$@"; }
mapfile -t sim_uuids < <(sim env -u CUDA_VISIBLE_DEVICES "$probe" | sed -n 's/.*uuids=\([^ ]*\).*/\1/p' | tr ',' '\n')
[ "${#sim_uuids[@]}" = "$n" ] || { echo "gpu_check: simgpu does not show $n devices" >&2; exit 2; }

# A probe line with its UUIDs turned into host indices of that side.
indices() {  # $1: line, rest: that side's UUIDs in host order
  local line=$1; shift
  local list u i k found out=()
  list=$(sed -n 's/.*uuids=\([^ ]*\).*/\1/p' <<<"$line")
  IFS=, read -ra seen <<<"$list"
  for u in "${seen[@]}"; do
    k=0 found=?
    for i in "$@"; do [ "$i" = "$u" ] && found=$k; k=$((k + 1)); done
    out+=("$found")
  done
  echo "$(sed 's/ uuids=[^ ]*//' <<<"$line") devices=$(IFS=,; echo "${out[*]}")"
}
# The shortest prefix of $1 (at least GPU- and 8 digits) that no other UUID of the side starts with.
unique_prefix() {
  local u=$1; shift
  local len o clash
  for ((len = 12; len < ${#u}; len++)); do
    clash=0
    for o in "$@"; do [ "$o" != "$u" ] && [ "${o:0:len}" = "${u:0:len}" ] && clash=1; done
    [ "$clash" = 0 ] && { echo "${u:0:len}"; return; }
  done
  echo "$u"
}
# A case's value for one side: {U<i>} device i's UUID, {P<i>} its shortest unique prefix, {X<i>}
# it with upper-case hex, {N<i>} it without GPU-, {C} the prefix devices 0 and 1 share (ambiguous).
subst() {  # $1: value; rest: that side's UUIDs in host order
  local v=$1; shift
  local k=0 u c=""
  for u in "$@"; do
    v=${v//\{U$k\}/$u}
    v=${v//\{P$k\}/$(unique_prefix "$u" "$@")}
    v=${v//\{X$k\}/GPU-$(tr a-f A-F <<<"${u#GPU-}")}
    v=${v//\{N$k\}/${u#GPU-}}
    k=$((k + 1))
  done
  if [ $# -ge 2 ]; then
    local a=$1 b=$2 i=0
    while [ "$i" -lt "${#a}" ] && [ "${a:i:1}" = "${b:i:1}" ]; do i=$((i + 1)); done
    c=${a:0:i}
  fi
  echo "${v//\{C\}/$c}"
}

cases=("<unset>" "" "0" "+0" " 0" "0abc" "0,-1" "0,0" "{U0}" "{P0}" "{X0}" "{N0}" "0,{U0}" "{U0},0" "MIG-{U0}" "GPU-")
if [ "$n" -ge 2 ]; then cases+=("1" "1,0" "1,1" "0,1,0" "1,7,0" "1,{U0}" "{U1},{U0}" "{U1},1" "{P1},{P0}" "{C}"); fi

differ=0
run_cases() {  # $1: label, rest: extra env for both sides
  local label=$1; shift
  local c v_real v_sim real simg
  for c in "${cases[@]}"; do
    if [ "$c" = "<unset>" ]; then
      real=$(env -u CUDA_VISIBLE_DEVICES "$@" "$probe" "${allocs[@]}" 2>/dev/null)
      simg=$(sim env -u CUDA_VISIBLE_DEVICES "$@" "$probe" "${allocs[@]}" 2>/dev/null)
    else
      v_real=$(subst "$c" "${real_uuids[@]}")
      v_sim=$(subst "$c" "${sim_uuids[@]}")
      real=$(env "$@" CUDA_VISIBLE_DEVICES="$v_real" "$probe" "${allocs[@]}" 2>/dev/null)
      simg=$(sim env "$@" CUDA_VISIBLE_DEVICES="$v_sim" "$probe" "${allocs[@]}" 2>/dev/null)
    fi
    real=$(indices "$real" "${real_uuids[@]}")
    simg=$(indices "$simg" "${sim_uuids[@]}")
    local mark=""
    if [ "$real" != "$simg" ]; then mark="   DIFFERENT (simgpu: $simg)"; differ=$((differ + 1)); fi
    printf '%-8s CUDA_VISIBLE_DEVICES=%-14s driver: %s%s\n' "$label" "'$c'" "$real" "$mark"
  done
}

allocs=()
run_cases "no shim"
allocs=($((1 << 30)) 1)
run_cases "shim" LD_PRELOAD="$shim" CUSHARE_TENANT=gpucheck CUSHARE_MEMORY_LIMIT=1GiB \
  CUSHARE_LEDGER_DIR="$tmp/ledger" CUSHARE_LOG_LEVEL=error
echo "codes: 0 success, 2 out of memory, 3 not initialized, 100 no device. {U0}: device 0's UUID,"
echo "{P0}: its shortest unique prefix, {X0}: it in upper case, {N0}: it without GPU-, {C}: the"
echo "prefix devices 0 and 1 share."

# ---- Device time and MPS: the constants simgpu guesses ---------------------------------------
perfdir="$build/perf"
printf 'probe_spin block_ns_param=0\n' >"$tmp/probe.costs"
simt() { sim env SIMGPU_KERNEL_COSTS="$tmp/probe.costs" CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$@"; }
# Two timeslice probes at once; prints both lines. $1: driver|simgpu, $2: kernel us.
two_probes() {
  local runner=env
  [ "$1" = simgpu ] && runner=simt
  $runner "$perfdir/timeslice_probe" 1 "$2" >"$tmp/ts1" 2>&1 &
  local first=$!
  $runner "$perfdir/timeslice_probe" 1 "$2" >"$tmp/ts2" 2>&1
  wait "$first"
  cat "$tmp/ts1" "$tmp/ts2"
}
echo "== event timer resolution (simgpu: 0.5 us)"
echo "driver: $(env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$perfdir/event_resolution" 2>&1)"
echo "simgpu: $(simt "$perfdir/event_resolution" 2>&1)"
echo "== time slice and switch cost between two processes, back-to-back kernels"
echo "   (simgpu: SIMGPU_TIME_SLICE_US=2000, SIMGPU_SWITCH_US=25; fit them to the driver's lines)"
two_probes driver 20 | sed 's/^/driver (20 us kernels): /'
two_probes simgpu 500 | sed 's/^/simgpu (500 us kernels): /'
if [ "${GPU_CHECK_TIMESLICE_LEVELS:-0}" = 1 ]; then
  for level in 1 2 3; do
    if nvidia-smi compute-policy -i 0 --set-timeslice "$level" >/dev/null 2>&1; then
      two_probes driver 20 | sed "s/^/driver, timeslice level $level: /"
    else
      echo "driver, timeslice level $level: nvidia-smi compute-policy --set-timeslice failed (root?)"
    fi
  done
  nvidia-smi compute-policy -i 0 --set-timeslice 0 >/dev/null 2>&1
fi
fatbin="$build/lib/cushare/probes.fatbin"
echo "== MPS: the multiprocessor count a client sees (simgpu: ceil(pct x SMs) rounded up to even)"
if command -v nvidia-cuda-mps-control >/dev/null; then
  real_mps() { env CUDA_MPS_PIPE_DIRECTORY="$tmp/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$tmp/mps-log" "$@"; }
  sim_mps() { sim env CUDA_MPS_PIPE_DIRECTORY="$tmp/sim-pipe" CUDA_MPS_LOG_DIRECTORY="$tmp/sim-log" SIMGPU_KERNEL_COSTS="$tmp/probe.costs" "$@"; }
  real_mps nvidia-cuda-mps-control -d && sim_mps "$build/lib/simgpu/bin/nvidia-cuda-mps-control" -d ||
    echo "gpu_check: cannot start an MPS control daemon" >&2
  echo "driver SMs without MPS: $(env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$perfdir/mps_sm_probe" 2>&1)"
  for pct in 1 5 10 12.5 25 30 33.3 50 70 75 100; do
    real=$(real_mps env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$pct" "$perfdir/mps_sm_probe" 2>&1)
    simg=$(sim_mps env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$pct" "$perfdir/mps_sm_probe" 2>&1)
    mark=""
    if [ "$real" != "$simg" ]; then mark="   DIFFERENT (simgpu: $simg)"; differ=$((differ + 1)); fi
    printf 'MPS client at %5s %%: driver: %s%s\n' "$pct" "$real" "$mark"
  done
  echo "== MPS: the probe kernels in a client of 100 % alone, then beside another client's hog of 100 %"
  echo "   (timeslice_probe fill: 1 ms kernels of two 1024-thread blocks per SM, every thread slot)"
  echo "   (simgpu guesses blocks of two clients on one SM each run at full rate: the SM probe's"
  echo "   work_per_us and distinct_sms would not change; on a GPU, how far they fall is the intra-SM"
  echo "   factor the probe reads for clients whose percentages overlap: docs/probes.md, \"Limits\")"
  for side in driver simgpu; do
    if [ "$side" = driver ]; then runner=real_mps; else runner=sim_mps; fi
    $runner env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "$perfdir/probe_check" "$fatbin" 3 "$side-mps-alone" 2>&1
    $runner env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "$perfdir/timeslice_probe" 3 1000 fill >/dev/null 2>&1 &
    hog=$!
    sleep 0.5
    $runner env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "$perfdir/probe_check" "$fatbin" 10 "$side-mps-hog" 2>&1
    wait "$hog"
  done
  echo quit | real_mps nvidia-cuda-mps-control
  echo quit | sim_mps "$build/lib/simgpu/bin/nvidia-cuda-mps-control"
  echo "(simgpu's SIMGPU_SMS is 132 by default: compare on an H100/H200, or set it to the GPU's count)"
else
  echo "nvidia-cuda-mps-control not found: MPS not measured"
fi

echo "== probe kernels: timer tick, launch to start, distinct SMs, block durations (perf/probe_check)"
echo "   (simgpu's twins guess: tick_ns=1000, cycles_per_ns=1.98, sm work_per_us=495/work_per_step (256),"
echo "   mem 4.8 TB/s split per SM, no launch latency; launch_to_start is the tick probe's (launched first);"
echo "   on the driver read rt if %globaltimer counts from the Unix epoch, else compare rounds)"
env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$perfdir/probe_check" "$fatbin" 5 driver-alone 2>&1
env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$perfdir/timeslice_probe" 3 1000 >/dev/null 2>&1 &
hog=$!
sleep 0.5
env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$perfdir/probe_check" "$fatbin" 10 driver-hog 2>&1
wait "$hog"
simt "$perfdir/probe_check" "$fatbin" 3 simgpu-alone 2>&1
simt "$perfdir/timeslice_probe" 3 1000 >/dev/null 2>&1 &
hog=$!
sleep 0.5
simt "$perfdir/probe_check" "$fatbin" 10 simgpu-hog 2>&1
wait "$hog"

echo "== memory an exited exporter left behind (an exported VMM descriptor, never imported)"
echo "   (the broker charges it from the device's used memory minus its processes': simgpu counts it in"
echo "   device_used and in no process after the exporter exits; fd_target says what a /proc scan would see)"
env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$perfdir/vmm_export_probe" 2>&1 | sed 's/^/driver: /'
sim "$perfdir/vmm_export_probe" 2>&1 | sed 's/^/simgpu: /'

echo "gpu_check: $differ case(s) where simgpu differs from the driver"
[ "$differ" = 0 ]
