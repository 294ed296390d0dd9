#!/usr/bin/env bash
# On a host with a real NVIDIA GPU: measures what docs/simgpu.md marks [unverified] and compares
# simgpu with the real driver, without and with libcushare.so preloaded.
#   usage: perf/gpu_check.sh [--no-build] [build dir]   (default: build)
#
# On a borrowed GPU machine without network access, stage the binaries here first and carry them:
#   perf/gpu_check_stage.sh build build-gpu        (about 7 MiB: the programs below, stripped)
#   perf/gpu_check.sh --no-build build-gpu         (on the GPU machine, from the repository root)
# Everything it prints also goes to $OUT/gpu_check.log as it runs ($OUT: the device tool's output
# folder; default ./gpu-check-out), beside nvidia-smi -q and the MPS logs. Every program runs
# under a timeout (GPU_CHECK_STEP_TIMEOUT, default 60 s); a program that fails or times out is
# reported ("FAILED"), counted, and the next one runs; MPS daemons started here are quit on exit,
# also after a failure, or after INT or TERM once the program then running has ended (a daemon a
# killed run left behind is quit by the next run, whose pipe directories are the same).
# GPU_CHECK_STEPS (default "1 2 3 4 5 6 7 8 9 10") picks the steps below, for a rerun of one of them.
# GPU_CHECK_DRY_RUN=1 runs every step with simgpu standing in for the driver too (ctest
# gpu_check_dry_run), so the script itself is tested without a GPU.
#
# Steps:
# 1. Device visibility: perf/visibility_probe for each CUDA_VISIBLE_DEVICES value below, once
#    against the real driver and once against simgpu set up with as many devices as the host has
#    (UUIDs are written as {U0}, {U1}, ... and replaced by each side's own), both with
#    CUDA_DEVICE_ORDER=PCI_BUS_ID so that indices are nvidia-smi's; the probe's devices are printed
#    as host indices. Then the same with the shim preloaded (a 1 GiB limit): the devices seen must
#    not change, and on each visible device 1 GiB is granted and one more byte denied (checked on
#    the driver's side: "SHIM NOT ENFORCING" otherwise). "DIFFERENT" where the two sides disagree.
# 2. The constants docs/simgpu.md ("Device time", "MPS") marks as guesses, each measured by a small
#    nvcc-built probe (perf/*.cu): the event timer's resolution; the time slice and switch cost
#    between two processes; when nvidia-cuda-mps-control is found, whether its daemon starts with
#    -multiuser-server as the broker starts it (DIFFERENT if not), the multiprocessor count an MPS
#    client sees at several active thread percentages (counts that differ are DIFFERENT), and the
#    probe kernels in a client alone and beside another client's hog that fills every SM.
# 3. The probe kernels (cuda_kernels/probes.cu through perf/probe_check) alone and next to a hog
#    in another process: timer tick, launch-to-start latency, distinct SMs, block durations, work
#    rates and clock, to fit the guesses of simgpu's twins (docs/simgpu.md, "Probe kernels").
# 4. How the device accounts VMM memory only an exported descriptor keeps alive after its maker
#    exited (perf/vmm_export_probe; the broker's left-behind charge relies on it).
# 5. The demo's tenant program (examples/tenant/busy_for: a PTX kernel spinning on %globaltimer)
#    alone: about 100 % of the device's time each second.
# 6. NVML's per-process utilization as the broker reads it to check what tenants meter
#    (perf/process_util_probe beside a saturating hog): the driver's sampling period and how much
#    of the hog's time the samples add up to (docs/simgpu.md, "NVML").
# 7. What one process holds beyond its allocations (perf/context_memory_probe): its context, the
#    probe module, a 64 MiB device malloc heap and an 8 KiB stack limit, as NVML's per-process
#    figure shows them: the broker's context_memory (docs/broker-configuration.md) should be at
#    least the context's and module's `beyond`.
# 8. What the driver answers where simgpu's answer is a classification (perf/driver_answers_probe,
#    simgpu/driver_api_cuda13.txt): a memset captured at an unallocated address, the profiler
#    calls, stream memory operations (v2, v1, bad flags), the attributes behind the `absent`
#    entries and their answers, a CUDA 2.x ABI; DIFFERENT where the driver and simgpu disagree
#    (an attribute that differs explains the answer after it).
# 9. MIG, read-only (nothing is created or switched): GPU 0's GPU instance profiles and their
#    placements as NVML lists them (tools/simgpu_smi_mig.cpp: `simgpu-smi mig -lgip`, `-lgipp`),
#    beside simgpu's table for the same board (SIMGPU_GPU_MODEL picked from the name); DIFFERENT
#    where a line differs (docs/simgpu.md, "MIG", lists the guesses). A board simgpu has no model
#    for is only listed. Also /proc/driver/nvidia-caps/mig-minors against the fixed numbering the
#    broker names MIG capability nodes by where that file is missing (docs/mig.md, "Containers").
# 10. Managed memory when another process needs the room (perf/managed_evict_probe; what bursting
#    tenants rely on, docs/memory-elasticity.md): whether a managed allocation takes device memory
#    before it is touched, whether a prefetch to the device does, whether NVML's per-process figure
#    leaves it out, whether another process's cuMemAlloc evicts it (and how long that takes), whether
#    the data survives, the time of a prefetch back to the host, and what a page-fault migration
#    costs per 2 MiB (simgpu's SIMGPU_FAULT_US guess, 200 us: the thrashing guard's premise). The
#    `facts` line of each side is compared: DIFFERENT where they disagree (docs/simgpu.md, "Managed
#    memory", lists the guesses); the fault cost is printed beside simgpu's.
# Exits 1 if a comparison differs, the shim did not enforce its limit, a program failed or an MPS
# daemon did not quit; 2 if it could not run.
# Changes nothing on the host: the shim's ledger, simgpu's state and the MPS daemons' pipe
# directories live in temporary or fixed /tmp directories, and no GPU setting is touched.
set -uo pipefail
build_it=1
if [ "${1:-}" = --no-build ]; then build_it=0; shift; fi
build=${1:-build}
out=${OUT:-$PWD/gpu-check-out}
mkdir -p "$out" || exit 2
dry=${GPU_CHECK_DRY_RUN:-0}
T=${GPU_CHECK_STEP_TIMEOUT:-60}
steps=" ${GPU_CHECK_STEPS:-1 2 3 4 5 6 7 8 9 10} "

main() {
  exec 3>&1  # the log, also from within $(...) whose output is captured (guarded's FAILED lines)
  # The caller's CUDA settings would change what every step sees.
  unset CUDA_VISIBLE_DEVICES LD_PRELOAD CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY \
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE CUDA_DEVICE_MAX_CONNECTIONS SIMGPU_KERNEL_COSTS
  export PATH="$PATH:/usr/local/nvidia/bin"
  export CUDA_DEVICE_ORDER=PCI_BUS_ID
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  [ "$dry" = 1 ] && echo "gpu_check: DRY RUN: simgpu stands in for the driver (nothing here is a GPU measurement)"

  if [ "$build_it" = 1 ]; then
    if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null ||
       ! cmake --build "$build" --target visibility_probe cushare_shim simgpu_cuda simgpu_nvml timeslice_probe \
           event_resolution mps_sm_probe simgpu_mps_control simgpu_mps_server vmm_export_probe probe_check \
           context_memory_probe driver_answers_probe managed_evict_probe cushare_probes_fatbin busy_for simgpu-smi >/dev/null; then
      echo "gpu_check: the build failed; going on with what $build holds"
    fi
  fi
  build=$(realpath "$build") || { echo "gpu_check: no build directory" >&2; return 2; }
  perfdir="$build/perf"
  probe="$perfdir/visibility_probe"
  shim="$build/lib/libcushare.so"
  fatbin="$build/lib/cushare/probes.fatbin"
  busy="$build/examples/tenant/busy_for"
  simlib="$build/lib/simgpu"
  deps="$build/lib/deps"  # libraries the staged shim needs that a GPU image may lack (gpu_check_stage.sh)
  local f missing=0
  for f in "$probe" "$perfdir/process_util_probe" "$shim" "$fatbin" "$simlib/libcuda.so.1" "$simlib/libnvidia-ml.so.1" \
           "$simlib/bin/nvidia-cuda-mps-control" "$simlib/bin/nvidia-cuda-mps-server" "$perfdir/timeslice_probe" \
           "$perfdir/event_resolution" "$perfdir/mps_sm_probe" "$perfdir/vmm_export_probe" "$perfdir/probe_check" "$busy" \
           "$perfdir/context_memory_probe" "$perfdir/driver_answers_probe" "$perfdir/managed_evict_probe" "$build/tools/simgpu-smi"; do
    [ -e "$f" ] || { echo "gpu_check: missing $f"; missing=1; }
  done
  [ "$missing" = 0 ] || { echo "gpu_check: build or stage first (perf/gpu_check_stage.sh)" >&2; return 2; }
  tmp=$(mktemp -d /tmp/cushare-gpu-check.XXXXXX)
  mps_pipe=/tmp/cushare-gpu-check-mps sim_pipe=/tmp/cushare-gpu-check-sim-mps
  trap cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  : >"$tmp/failures"
  printf 'probe_spin block_ns_param=0\ncushare_demo_spin block_ns=1000000\n' >"$tmp/probe.costs"

  # The driver's side. Dry run: a second simgpu of two devices, with its own state.
  if [ "$dry" = 1 ]; then
    drv() {
      guarded env LD_LIBRARY_PATH="$simlib:$deps" SIMGPU_DEVICES=2 SIMGPU_STATE_DIR="$tmp/drv-simgpu" \
        SIMGPU_KERNEL_COSTS="$tmp/probe.costs" "$@"
    }
    mps_control="$simlib/bin/nvidia-cuda-mps-control"
  else
    drv() { guarded env LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$deps" "$@"; }
    mps_control=$(command -v nvidia-cuda-mps-control || true)
  fi
  # Never an MPS client by accident: a daemon running at the default pipe directory would take them.
  nomps() { drv env CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$@"; }

  if [ "$dry" = 1 ]; then
    mapfile -t real_uuids < <(drv "$probe" | sed -n 's/.*uuids=\([^ ]*\).*/\1/p' | tr ',' '\n')
    echo "host: ${#real_uuids[@]} simulated GPU(s) standing in for the driver"
  else
    command -v nvidia-smi >/dev/null || { echo "gpu_check: nvidia-smi not found: not a GPU host" >&2; return 2; }
    mapfile -t real_uuids < <(t nvidia-smi --query-gpu=uuid --format=csv,noheader | tr -d ' ')
    echo "host: ${#real_uuids[@]} GPU(s); driver $(t nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
    t nvidia-smi -q >"$out/nvidia-smi-q.txt" 2>&1
    t nvidia-smi --query-gpu=index,name,mig.mode.current,compute_mode,persistence_mode,clocks.sm,clocks.max.sm \
      --format=csv 2>&1 | sed 's/^/nvidia-smi: /'
  fi
  n=${#real_uuids[@]}
  [ "$n" -ge 1 ] || { echo "gpu_check: no GPU listed" >&2; return 2; }
  compute_mode=Default
  [ "$dry" = 1 ] || compute_mode=$(t nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader | tr -d ' ')
  { echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; echo "PATH=$PATH"
    for f in "$shim" "$probe" "$perfdir/probe_check" "$busy"; do echo "== ldd $f"; drv ldd "$f" 2>&1; done
  } >"$out/environment.txt"
  # The shim must load on both sides, or its cases would run without it (and simgpu be blamed).
  local side
  for side in drv sim; do
    # The whole output first: with pipefail, `ldd | grep -q` is false when grep's early exit
    # kills ldd with SIGPIPE, and a missing library would go unseen.
    if grep -q 'not found' <<<"$($side ldd "$shim" 2>&1)"; then
      echo "gpu_check: the shim's libraries are not all found on the $side side (stage them: perf/gpu_check_stage.sh):"
      $side ldd "$shim" | grep 'not found'
      return 2
    fi
  done

  differ=0 shim_bad=0
  [[ "$steps" == *" 1 "* ]] && step_visibility
  [[ "$steps" == *" 2 "* ]] && step_device_time
  if [ "$compute_mode" = Default ]; then
    [[ "$steps" == *" 2 "* ]] && step_mps
    [[ "$steps" == *" 3 "* ]] && step_probes
  else
    echo "== compute mode $compute_mode: the steps with two processes on the GPU are left out"
  fi
  [[ "$steps" == *" 4 "* ]] && step_vmm
  [[ "$steps" == *" 5 "* ]] && step_busy_for
  [[ "$steps" == *" 6 "* ]] && step_process_util
  [[ "$steps" == *" 7 "* ]] && step_context_memory
  [[ "$steps" == *" 8 "* ]] && step_driver_answers
  [[ "$steps" == *" 9 "* ]] && step_mig
  [[ "$steps" == *" 10 "* ]] && step_managed

  local failed
  failed=$(wc -l <"$tmp/failures")
  echo "gpu_check: $differ case(s) where simgpu differs from the driver; $shim_bad case(s) where the shim did not enforce;" \
    "$failed program(s) failed"
  [ "$differ" = 0 ] && [ "$shim_bad" = 0 ] && [ "$failed" = 0 ]
}

# Every program runs under a timeout: external ones through t, the rest through the runners below
# (drv: the driver's side; nomps: it outside MPS; sim, simt: simgpu, with the probes' cost table),
# which start with one. A program that fails is said and counted.
guarded() {
  timeout -k 5 "$T" "$@"
  local rc=$?
  # A hog (start_hog) ends by hog_done's TERM once what ran beside it is measured.
  if [ "${GPU_CHECK_HOG:-0}" = 1 ] && [ "$rc" = 143 ]; then return 0; fi
  if [ "$rc" != 0 ]; then
    echo "gpu_check: FAILED (exit $rc$([ "$rc" = 124 ] && echo ", timed out after $T s")): ${*: -5}" >&3
    echo "$rc" >>"$tmp/failures"
  fi
  return "$rc"
}
t() { guarded "$@"; }
# simgpu with as many devices as the driver's side (the staged shim's libraries found there too).
sim() { guarded env LD_LIBRARY_PATH="$simlib:$deps" SIMGPU_DEVICES="$n" SIMGPU_STATE_DIR="$tmp/simgpu" "$@"; }
simt() { sim env SIMGPU_KERNEL_COSTS="$tmp/probe.costs" CUDA_MPS_PIPE_DIRECTORY="$tmp/no-mps" "$@"; }

# Quits the MPS daemons of a pipe directory (waiting up to 10 s for the daemon to go).
quit_mps() {  # $1: control binary, $2: pipe directory, $3: runner (drv or sim)
  local control=$1 pipe=$2 runner=$3
  [ -e "$pipe/control" ] || return 0
  local pid
  pid=$(cat "$pipe/nvidia-cuda-mps-control.pid" 2>/dev/null)
  echo quit | T=15 $runner env CUDA_MPS_PIPE_DIRECTORY="$pipe" "$control" >/dev/null 2>&1
  for _ in $(seq 1 100); do
    { [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; } && break
    sleep 0.1
  done
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "gpu_check: the MPS daemon $pid did not quit"
    return 1
  fi
}

cleanup() {
  local rc=$? left=0
  if [ -n "${mps_control:-}" ] && declare -F drv >/dev/null; then quit_mps "$mps_control" "$mps_pipe" drv || left=1; fi
  quit_mps "$simlib/bin/nvidia-cuda-mps-control" "$sim_pipe" sim || left=1
  tar -C /tmp -czf "$out/mps-logs.tgz" cushare-gpu-check-mps cushare-gpu-check-sim-mps 2>/dev/null
  rm -rf "$tmp" "$mps_pipe" "$sim_pipe"
  if [ "$left" = 1 ] && [ "$rc" = 0 ]; then exit 1; fi
}

# A probe line with its UUIDs turned into host indices of that side.
indices() {  # $1: line, rest: that side's UUIDs in host order
  local line=$1; shift
  local list u i k found idx=()
  list=$(sed -n 's/.*uuids=\([^ ]*\).*/\1/p' <<<"$line")
  IFS=, read -ra seen <<<"$list"
  for u in "${seen[@]}"; do
    k=0 found='?'
    for i in "$@"; do [ "$i" = "$u" ] && found=$k; k=$((k + 1)); done
    idx+=("$found")
  done
  echo "$(sed 's/ uuids=[^ ]*//' <<<"$line") devices=$(IFS=,; echo "${idx[*]}")"
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

run_cases() {  # $1: label, rest: extra env for both sides
  local label=$1; shift
  local c v_real v_sim real simg
  for c in "${cases[@]}"; do
    if [ "$c" = "<unset>" ]; then
      real=$(nomps env -u CUDA_VISIBLE_DEVICES "$@" "$probe" "${allocs[@]}" 2>>"$out/stderr.txt")
      simg=$(sim env -u CUDA_VISIBLE_DEVICES "$@" "$probe" "${allocs[@]}" 2>>"$out/stderr.txt")
    else
      v_real=$(subst "$c" "${real_uuids[@]}")
      v_sim=$(subst "$c" "${sim_uuids[@]}")
      real=$(nomps env "$@" CUDA_VISIBLE_DEVICES="$v_real" "$probe" "${allocs[@]}" 2>>"$out/stderr.txt")
      simg=$(sim env "$@" CUDA_VISIBLE_DEVICES="$v_sim" "$probe" "${allocs[@]}" 2>>"$out/stderr.txt")
    fi
    real=$(indices "$real" "${real_uuids[@]}")
    simg=$(indices "$simg" "${sim_uuids[@]}")
    local mark=""
    if [ "$real" != "$simg" ]; then mark="   DIFFERENT (simgpu: $simg)"; differ=$((differ + 1)); fi
    # With the shim, every device the driver shows grants 1 GiB and denies one byte more.
    if [ "${#allocs[@]}" -gt 0 ] && [[ "$real" == *" count="[1-9]* ]]; then
      local pairs bad
      pairs=$(sed -n 's/.* alloc=\(.*\) devices=.*/\1/p' <<<"$real")
      bad=$(tr ' ' '\n' <<<"$pairs" | grep -cv '^0/2$')
      if [ -z "$pairs" ] || [ "$bad" != 0 ]; then mark="$mark   SHIM NOT ENFORCING"; shim_bad=$((shim_bad + 1)); fi
    fi
    printf '%-8s CUDA_VISIBLE_DEVICES=%-14s driver: %s%s\n' "$label" "'$c'" "$real" "$mark"
  done
}

step_visibility() {
  echo "== 1. device visibility, without and with the shim"
  mapfile -t sim_uuids < <(sim env -u CUDA_VISIBLE_DEVICES "$probe" | sed -n 's/.*uuids=\([^ ]*\).*/\1/p' | tr ',' '\n')
  if [ "${#sim_uuids[@]}" != "$n" ]; then
    echo "gpu_check: simgpu does not show $n devices (${#sim_uuids[@]}): visibility not compared"
    differ=$((differ + 1))
    return
  fi
  cases=("<unset>" "" "0" "+0" " 0" "0abc" "0,-1" "0,0" "{U0}" "{P0}" "{X0}" "{N0}" "0,{U0}" "{U0},0" "MIG-{U0}" "GPU-")
  if [ "$n" -ge 2 ]; then cases+=("1" "1,0" "1,1" "0,1,0" "1,7,0" "1,{U0}" "{U1},{U0}" "{U1},1" "{P1},{P0}" "{C}"); fi
  allocs=()
  run_cases "no shim"
  allocs=($((1 << 30)) 1)
  run_cases "shim" LD_PRELOAD="$shim" CUSHARE_TENANT=gpucheck CUSHARE_MEMORY_LIMIT=1GiB \
    CUSHARE_LEDGER_DIR="$tmp/ledger" CUSHARE_LOG_LEVEL=error
  echo "codes: 0 success, 2 out of memory, 3 not initialized, 100 no device. {U0}: device 0's UUID,"
  echo "{P0}: its shortest unique prefix, {X0}: it in upper case, {N0}: it without GPU-, {C}: the"
  echo "prefix devices 0 and 1 share."
}

# Two timeslice probes at once; prints both lines. $1: runner, $2: kernel us.
two_probes() {
  local runner=$1
  $runner "$perfdir/timeslice_probe" 3 "$2" >"$tmp/ts1" 2>&1 &
  local first=$!
  $runner "$perfdir/timeslice_probe" 3 "$2" >"$tmp/ts2" 2>&1
  wait "$first"
  cat "$tmp/ts1" "$tmp/ts2"
}

step_device_time() {
  echo "== 2. event timer resolution (simgpu: 0.5 us)"
  echo "driver: $(nomps "$perfdir/event_resolution" 2>&1)"
  echo "simgpu: $(simt "$perfdir/event_resolution" 2>&1)"
  if [ "$compute_mode" != Default ]; then return; fi
  echo "== 2. time slice and switch cost between two processes, back-to-back kernels"
  echo "   (simgpu: SIMGPU_TIME_SLICE_US=2000, SIMGPU_SWITCH_US=25; fit them to the driver's lines)"
  two_probes nomps 20 | sed 's/^/driver (20 us kernels): /'
  two_probes simt 500 | sed 's/^/simgpu (500 us kernels): /'
}

# Starts a hog in the background (its runner's pid in $hog) and gives it time to start (2 s on the
# driver, 1 s on simgpu). Its command runs for longer than anything measured beside it (30 s):
# hog_done checks that it still runs, so what was measured ran beside it however slow the host,
# then ends it (TERM) and waits for it.
start_hog() {  # $1: driver|simgpu, rest: the command
  local side=$1; shift
  GPU_CHECK_HOG=1 "$@" >/dev/null 2>&1 &
  hog=$!
  if [ "$side" = driver ] && [ "$dry" != 1 ]; then sleep 2; else sleep 1; fi
}
hog_done() {  # $1: what was measured beside it
  if ! kill -0 "$hog" 2>/dev/null; then
    echo "gpu_check: FAILED: the hog ended before $1 did: not measured beside it"
    echo hog >>"$tmp/failures"
  fi
  pkill -TERM -P "$hog" timeout 2>/dev/null
  wait "$hog"
}

step_mps() {
  echo "== 2. MPS: the multiprocessor count a client sees (simgpu: ceil(pct x SMs) rounded up to even)"
  if [ -z "$mps_control" ]; then
    echo "nvidia-cuda-mps-control not found: MPS not measured"
    return
  fi
  real_mps() { drv env CUDA_MPS_PIPE_DIRECTORY="$mps_pipe" CUDA_MPS_LOG_DIRECTORY="$mps_pipe/log" "$@"; }
  sim_mps() {
    sim env CUDA_MPS_PIPE_DIRECTORY="$sim_pipe" CUDA_MPS_LOG_DIRECTORY="$sim_pipe/log" \
      SIMGPU_KERNEL_COSTS="$tmp/probe.costs" "$@"
  }
  # Daemons a killed earlier run left on these pipe directories go first.
  quit_mps "$mps_control" "$mps_pipe" drv
  quit_mps "$simlib/bin/nvidia-cuda-mps-control" "$sim_pipe" sim
  rm -rf "$mps_pipe" "$sim_pipe"
  mkdir -p "$mps_pipe/log" "$sim_pipe/log"
  # As the broker starts it (mps.multiuser: on): one server for the clients of every uid.
  if real_mps "$mps_control" -d -multiuser-server; then
    echo "driver: the MPS control daemon started with -multiuser-server"
  else
    echo "gpu_check: the driver's MPS control daemon did not start with -multiuser-server (the broker's default," \
      "docs/mps.md): DIFFERENT from simgpu; trying without it"
    differ=$((differ + 1))
    real_mps "$mps_control" -d || echo "gpu_check: the driver's MPS control daemon did not start"
  fi
  sim_mps "$simlib/bin/nvidia-cuda-mps-control" -d -multiuser-server || echo "gpu_check: simgpu's MPS control daemon did not start"
  for _ in $(seq 1 100); do [ -S "$mps_pipe/control" ] && [ -S "$sim_pipe/control" ] && break; sleep 0.1; done
  echo "driver SMs without MPS: $(nomps "$perfdir/mps_sm_probe" 2>&1)"
  local pct real simg mark active=1
  for pct in 1 5 10 12.5 25 30 33.3 50 70 75 100; do
    real=$(real_mps env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$pct" "$perfdir/mps_sm_probe" 2>&1)
    simg=$(sim_mps env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="$pct" "$perfdir/mps_sm_probe" 2>&1)
    if [ "$pct" = 1 ]; then
      # The first client started the server: without one, the clients ran outside MPS.
      if [ -z "$(echo get_server_list | real_mps "$mps_control" 2>/dev/null)" ]; then
        echo "gpu_check: MPS inactive on the driver's side (no server after a client): counts not compared"
        active=0
      fi
    fi
    mark=""
    if [ "$active" = 1 ] && [ "$real" != "$simg" ]; then mark="   DIFFERENT (simgpu: $simg)"; differ=$((differ + 1)); fi
    printf 'MPS client at %5s %%: driver: %s%s\n' "$pct" "$real" "$mark"
  done
  echo "== 2. MPS: the probe kernels in a client of 100 % alone, then beside another client's hog of 100 %"
  echo "   (timeslice_probe fill: 1 ms kernels of two 1024-thread blocks per SM, every thread slot)"
  echo "   (simgpu guesses blocks of two clients on one SM each run at full rate: the SM probe's"
  echo "   work_per_us and distinct_sms would not change; on a GPU, how far they fall is the intra-SM"
  echo "   factor the probe reads for clients whose percentages overlap: docs/probes.md, \"Limits\")"
  local side runner
  for side in driver simgpu; do
    if [ "$side" = driver ]; then runner=real_mps; else runner=sim_mps; fi
    $runner env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "$perfdir/probe_check" "$fatbin" 3 "$side-mps-alone" 2>&1
    start_hog "$side" $runner env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "$perfdir/timeslice_probe" 30 1000 fill
    $runner env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 "$perfdir/probe_check" "$fatbin" 10 "$side-mps-hog" 2>&1
    hog_done "$side-mps-hog"
  done
  quit_mps "$mps_control" "$mps_pipe" drv || echo mps >>"$tmp/failures"
  quit_mps "$simlib/bin/nvidia-cuda-mps-control" "$sim_pipe" sim || echo mps >>"$tmp/failures"
  echo "(simgpu's SIMGPU_SMS is 132 by default: compare on an H100/H200, or set it to the GPU's count)"
}

step_probes() {
  echo "== 3. probe kernels: timer tick, launch to start, distinct SMs, block durations (perf/probe_check)"
  echo "   (simgpu's twins guess: tick_ns=1000, cycles_per_ns=1.98, sm work_per_us=495/work_per_step (256),"
  echo "   mem 4.8 TB/s split per SM, no launch latency; launch_to_start is the tick probe's (launched first);"
  echo "   on the driver read rt if %globaltimer counts from the Unix epoch, else compare rounds)"
  nomps "$perfdir/probe_check" "$fatbin" 5 driver-alone 2>&1
  start_hog driver nomps "$perfdir/timeslice_probe" 30 1000
  nomps "$perfdir/probe_check" "$fatbin" 10 driver-hog 2>&1
  hog_done driver-hog
  simt "$perfdir/probe_check" "$fatbin" 3 simgpu-alone 2>&1
  start_hog simgpu simt "$perfdir/timeslice_probe" 30 1000
  simt "$perfdir/probe_check" "$fatbin" 10 simgpu-hog 2>&1
  hog_done simgpu-hog
}

step_vmm() {
  echo "== 4. memory an exited exporter left behind (an exported VMM descriptor, never imported)"
  echo "   (the broker charges it from the device's used memory minus its processes': simgpu counts it in"
  echo "   device_used and in no process after the exporter exits; fd_target says what a /proc scan would see)"
  nomps "$perfdir/vmm_export_probe" 2>&1 | sed 's/^/driver: /'
  sim "$perfdir/vmm_export_probe" 2>&1 | sed 's/^/simgpu: /'
}

step_busy_for() {
  echo "== 5. the demo's busy_for alone (a PTX kernel spinning on %globaltimer: about 100 % each second)"
  nomps "$busy" --seconds 2 --name driver 2>&1
  simt "$busy" --seconds 2 --name simgpu 2>&1
}

step_process_util() {
  echo "== 6. NVML per-process utilization beside a saturating hog (1 ms kernels), polled every 50 ms"
  echo "   (the broker bills the larger of what a tenant metered and what these samples add up to;"
  echo "   simgpu: one sample per process per query, over the period since the previous one; the"
  echo "   driver's period is what period_us shows, busy_fraction should be near 1)"
  start_hog driver nomps "$perfdir/timeslice_probe" 30 1000
  nomps "$perfdir/process_util_probe" 3 50 driver-util 2>&1
  hog_done driver-util
  start_hog simgpu simt "$perfdir/timeslice_probe" 30 1000
  simt "$perfdir/process_util_probe" 3 50 simgpu-util 2>&1
  hog_done simgpu-util
}

step_context_memory() {
  echo "== 7. what one process holds beyond its allocations (the broker's context_memory, 512 MiB by default)"
  echo "   (beyond= NVML's per-process figure less the 1 MiB allocated; simgpu models no context memory: 0)"
  nomps "$perfdir/context_memory_probe" "$fatbin" 2>&1 | sed 's/^/driver: /'
  sim "$perfdir/context_memory_probe" "$fatbin" 2>&1 | sed 's/^/simgpu: /'
}

step_driver_answers() {
  echo "== 8. what the driver answers where simgpu's is a classification (simgpu/driver_api_cuda13.txt)"
  nomps "$perfdir/driver_answers_probe" >"$tmp/answers-driver" 2>&1
  sim "$perfdir/driver_answers_probe" >"$tmp/answers-simgpu" 2>&1
  local d s
  while IFS= read -r d && IFS= read -r s <&4; do
    if [ "$d" = "$s" ]; then echo "same:    $d"; else echo "DIFFERENT: driver $d | simgpu $s"; differ=$((differ + 1)); fi
  done <"$tmp/answers-driver" 4<"$tmp/answers-simgpu"
  [ "$(wc -l <"$tmp/answers-driver")" = "$(wc -l <"$tmp/answers-simgpu")" ] ||
    { echo "DIFFERENT: the two sides printed different numbers of lines"; differ=$((differ + 1)); }
}

step_managed() {
  echo "== 10. managed memory when another process needs the room (what bursting tenants rely on)"
  echo "   (a burster prefetches half the device as managed memory; another process allocates what is free plus"
  echo "   half of it: it fits only if the device evicts; then the burster reads its data back)"
  nomps "$perfdir/managed_evict_probe" >"$tmp/managed-driver" 2>&1
  sim "$perfdir/managed_evict_probe" >"$tmp/managed-simgpu" 2>&1
  sed 's/^/driver: /' "$tmp/managed-driver"
  sed 's/^/simgpu: /' "$tmp/managed-simgpu"
  local d s
  d=$(grep '^facts ' "$tmp/managed-driver") s=$(grep '^facts ' "$tmp/managed-simgpu")
  if [ -n "$d" ] && [ "$d" = "$s" ]; then echo "same:    $d"; else echo "DIFFERENT: driver ${d:-none} | simgpu ${s:-none}"; differ=$((differ + 1)); fi
  d=$(sed -n 's/^step=a-fault-in .*us_per_2mib=\([-0-9.]*\).*/\1/p' "$tmp/managed-driver")
  s=$(sed -n 's/^step=a-fault-in .*us_per_2mib=\([-0-9.]*\).*/\1/p' "$tmp/managed-simgpu")
  echo "fault-in per 2 MiB: driver ${d:-none} us, simgpu ${s:-none} us (SIMGPU_FAULT_US; docs/simgpu.md)"
}

step_mig() {
  echo "== 9. MIG profiles and placements of GPU 0 (read-only), against simgpu's table for the board"
  local smi="$build/tools/simgpu-smi" name model nvml
  # simgpu-smi's RUNPATH names simgpu's NVML: the driver's side puts the real one first.
  if [ "$dry" = 1 ]; then
    real() { drv env SIMGPU_GPU_MODEL=h100-80gb SIMGPU_STATE_DIR="$tmp/drv-mig" "$@"; }
  else
    nvml=$(ldconfig -p 2>/dev/null | awk '/libnvidia-ml\.so\.1 .*x86-64/ { print $NF; exit }')
    [ -n "$nvml" ] || { echo "   the driver's libnvidia-ml.so.1 is not in ldconfig's cache: left out"; return; }
    real() { drv env LD_LIBRARY_PATH="$(dirname "$nvml"):$deps" "$@"; }
  fi
  # The capability nodes' numbers the broker names for a MIG device's containers (docs/mig.md,
  # "Containers"): the host's table against the driver's fixed numbering the broker falls back to.
  local minors=/proc/driver/nvidia-caps/mig-minors
  if [ -r "$minors" ]; then
    local bad
    bad=$(awk '$1 ~ /^gpu[0-9]+\/gi[0-9]+(\/ci[0-9]+)?\/access$/ {
        split($1, p, "/"); g = substr(p[1], 4); i = substr(p[2], 3)
        want = 3 + (g * 15 + i) * 9 + (p[3] ~ /^ci/ ? 1 + substr(p[3], 3) : 0); n++
        if ($2 != want) { d++; if (d <= 5) printf "DIFFERENT: %s is %s, fixed numbering %d\n", $1, $2, want }
      } END { printf "%d of %d capability lines differ\n", d + 0, n + 0 }' "$minors")
    echo "$bad" | sed 's/^/   /'
    case "$bad" in *"DIFFERENT"*) differ=$((differ + 1)) ;; esac
  else
    echo "   $minors: not present (the broker numbers MIG capability nodes by the driver's fixed table)"
  fi
  name=$(real "$smi" -L | sed -n 's/^GPU 0: \(.*\) (UUID: .*/\1/p')
  case "$name" in
    *A100*40GB*) model=a100-40gb ;;
    *A100*80GB*) model=a100-80gb ;;
    *H100*80GB*) model=h100-80gb ;;
    *H200*) model=h200 ;;
    *) echo "   GPU 0 is '$name': simgpu has no model of it; its profiles:"
       real "$smi" mig -i 0 -lgip; real "$smi" mig -i 0 -lgipp; return ;;
  esac
  echo "   GPU 0 is '$name': simgpu's $model"
  local what d s
  for what in -lgip -lgipp; do
    real "$smi" mig -i 0 "$what" >"$tmp/mig-driver" 2>&1
    guarded env LD_LIBRARY_PATH="$simlib:$deps" SIMGPU_GPU_MODEL="$model" SIMGPU_STATE_DIR="$tmp/sim-mig" \
      "$smi" mig -i 0 "$what" >"$tmp/mig-simgpu" 2>&1
    while IFS= read -r d && IFS= read -r s <&4; do
      if [ "$d" = "$s" ]; then echo "same:    $d"; else echo "DIFFERENT: driver $d | simgpu $s"; differ=$((differ + 1)); fi
    done <"$tmp/mig-driver" 4<"$tmp/mig-simgpu"
    [ "$(wc -l <"$tmp/mig-driver")" = "$(wc -l <"$tmp/mig-simgpu")" ] ||
      { echo "DIFFERENT: $what printed different numbers of lines"; differ=$((differ + 1)); }
  done
}

# The log outlives a signal to the whole group (INT, TERM): it records the cleanup too.
main "$@" 2>&1 | (trap '' INT TERM; tee "$out/gpu_check.log")
exit "${PIPESTATUS[0]}"
