#!/usr/bin/env bash
# The demo: a GPU host shared by two tenants under cushare-broker. Builds cushare, starts a broker
# with tenants alpha (512 MiB, compute cap 30 %, priority high) and beta (1 GiB, cap 50 %), runs
# one tenant program for each (they allocate until denied), shows alpha stopped at its limit while
# beta proceeds, raises alpha's limit live, kills a tenant and shows its memory returned at once;
# then both run kernels that would fill the device and get their caps (beta yields to alpha's
# priority while alpha has work), metered in busy time and measured by the probe kernels; then
# cleans up.
# On simgpu, the simulated GPU, unless a real NVIDIA GPU answers (nvidia-smi); DEMO_SIMGPU=1 forces
# simgpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# Builds what the demo runs, and only that (the test command builds the tests), saying so from the
# first second: a first build takes several minutes on a small machine.
demo_targets=(cushare-broker cushare cushare_shim simgpu_cuda simgpu_nvml alloc_until_denied busy_for)
echo "== building cushare for the demo: ${demo_targets[*]}"
echo "   (a first build takes about 2.5 minutes on 2 cores; later runs rebuild only what changed;"
echo "    the build's output goes to build/demo-build.log)"
t0=$(date +%s)
mkdir -p build
if ! scripts/install-deps.sh >build/demo-build.log 2>&1; then
  echo "demo: installing the build's Debian packages failed:" >&2
  tail -20 build/demo-build.log >&2
  exit 1
fi
echo "   packages in place; configuring ($(($(date +%s) - t0)) s)"
if ! cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >>build/demo-build.log 2>&1; then
  echo "demo: configuring the build failed (build/demo-build.log):" >&2
  tail -20 build/demo-build.log >&2
  exit 1
fi
# Ninja's "[done/total]" lines, shown at every tenth of the way and at least every 20 s.
progress() {
  local shown=-1 last=$SECONDS line step
  while IFS= read -r line; do
    printf '%s\n' "$line" >>build/demo-build.log
    [[ $line =~ ^\[([0-9]+)/([0-9]+)\] ]] && ((BASH_REMATCH[2] > 10)) || continue  # not CMake's re-check
    step=$((10 * BASH_REMATCH[1] / BASH_REMATCH[2]))
    if ((step > shown || SECONDS - last >= 20)); then
      echo "   built ${BASH_REMATCH[1]} of ${BASH_REMATCH[2]} ($(($(date +%s) - t0)) s)"
      shown=$step last=$SECONDS
    fi
  done
}
if ! cmake --build build -j "$(nproc)" --target "${demo_targets[@]}" 2>&1 | progress; then
  echo "demo: the build failed (build/demo-build.log):" >&2
  grep -m5 -E "error|Error" build/demo-build.log >&2 || tail -20 build/demo-build.log >&2
  exit 1
fi
echo "   built in $(($(date +%s) - t0)) s"
root="$PWD"
bin="$root/build/bin"
work="$(mktemp -d /tmp/cushare-demo.XXXXXX)"
chmod 755 "$work"

if [ "${DEMO_SIMGPU:-0}" != 1 ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "== on the real GPU: $(nvidia-smi -L | head -1)"
else
  export LD_LIBRARY_PATH="$root/build/lib/simgpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export SIMGPU_STATE_DIR="$work/simgpu" SIMGPU_MEMORY=4GiB
  # busy_for's kernel: each block lasts 1 ms, as it spins on a GPU.
  export SIMGPU_KERNEL_COSTS="$root/examples/tenant/busy_for.costs"
  echo "== on simgpu, the simulated GPU (one device, 4 GiB)"
fi

broker_pid="" alpha_pid="" beta_pid=""
cleanup() {
  for p in $alpha_pid $beta_pid; do kill -TERM "$p" 2>/dev/null || true; done
  wait $alpha_pid $beta_pid 2>/dev/null || true
  [ -n "$broker_pid" ] && kill -TERM "$broker_pid" 2>/dev/null && wait "$broker_pid" 2>/dev/null
  [ "${DEMO_KEEP:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/broker.yaml" <<YAML
ledger_dir: $work/ledgers
socket: $work/broker.sock
state_file: $work/broker.state
metrics_listen: 127.0.0.1:0
unknown_tenants: refuse
profiles:
  balanced: {memory: 1GiB, thread_percentage: 50, priority: normal}
tenants:
  - {name: alpha, memory: 512MiB, thread_percentage: 30, priority: high}
  - {name: beta, profile: balanced}
probes: {interval_ms: 25, window_s: 2}   # probe rounds every 25 ms, shares over the last 2 s
YAML
export CUSHARE_SOCKET="$work/broker.sock"
cushare() { "$bin/cushare" "$@"; }

echo
echo "== 1. start cushare-broker with two tenants (config: $work/broker.yaml)"
"$bin/cushare-broker" --config "$work/broker.yaml" 2>"$work/broker.log" &
broker_pid=$!
for _ in $(seq 1 200); do cushare status >/dev/null 2>&1 && break; sleep 0.05; done
cushare status

# Waits until the file has N (default 1) lines matching the pattern (a tenant program's progress).
wait_for() {
  for _ in $(seq 1 400); do [ "$(grep -c "$2" "$1" 2>/dev/null)" -ge "${3:-1}" ] && return 0; sleep 0.05; done
  echo "timed out waiting for '$2' in $1" >&2
  cat "$1" >&2
  return 1
}

echo
echo "== 2. one tenant program each, started by 'cushare run'; each allocates 64 MiB at a time until denied"
"$bin/cushare" run --tenant alpha -- build/examples/tenant/alloc_until_denied --name alpha --step 64MiB >"$work/alpha.out" 2>"$work/alpha.err" &
alpha_pid=$!
"$bin/cushare" run --tenant beta -- build/examples/tenant/alloc_until_denied --name beta --step 64MiB >"$work/beta.out" 2>"$work/beta.err" &
beta_pid=$!
wait_for "$work/alpha.out" denied
wait_for "$work/beta.out" denied
echo "-- alpha:"; cat "$work/alpha.out"
echo "-- beta:"; cat "$work/beta.out"
echo "-- the shim's line for alpha's refused allocation:"; grep -m1 denied "$work/alpha.err" || true
echo
cushare tenants

echo
echo "== 3. raise alpha's limit live to 768 MiB; its running program tries again (SIGUSR1)"
cushare set-limit alpha --memory 768MiB
seen=$(wc -l <"$work/alpha.out")
kill -USR1 "$alpha_pid"
wait_for "$work/alpha.out" denied 2
tail -n +"$((seen + 1))" "$work/alpha.out"
echo
cushare tenants
cushare processes

echo
echo "== 4. kill -9 beta's program: the broker returns its memory at once, no allocation needed"
kill -9 "$beta_pid"; wait "$beta_pid" 2>/dev/null || true; beta_pid=""
sleep 0.1
cushare tenants

echo
echo "== 5. compute: alpha's program frees its memory and exits; then alpha (cap 30 %, priority high)"
echo "   runs kernels for 3 s and beta (cap 50 %) for 6 s, each enough to fill the device alone."
echo "   While alpha has work (and for 0.5 s after), beta is held to the priority floor (10 %)."
kill -TERM "$alpha_pid"; wait "$alpha_pid" 2>/dev/null || true; tail -1 "$work/alpha.out"; alpha_pid=""
"$bin/cushare" run --tenant beta -- build/examples/tenant/busy_for --seconds 6 >"$work/beta-busy.out" 2>&1 &
beta_pid=$!
"$bin/cushare" run --tenant alpha -- build/examples/tenant/busy_for --seconds 3 >"$work/alpha-busy.out" 2>&1 &
alpha_pid=$!
sleep 2.5
echo "-- 2.5 s in, what the probe kernels measured in each tenant's context over its last 2 s window"
echo "   (REGIME turns: the broker paces them; SHARE: the part of the time it held the device):"
cushare probe
for t in alpha beta; do
  pid_var="${t}_pid"
  wait "${!pid_var}" || { echo "busy_for ($t) failed:" >&2; cat "$work/$t-busy.out" >&2; exit 1; }
  printf -v "$pid_var" ''
done
echo "-- alpha:"; cat "$work/alpha-busy.out"
echo "-- beta:"; cat "$work/beta-busy.out"
echo
cushare tenants

echo
echo "== 6. what Prometheus scrapes (http://$(cushare --json status | sed -n 's/.*"metrics_address":"\([^"]*\)".*/\1/p')/metrics), tenant lines:"
addr=$(cushare --json status | sed -n 's/.*"metrics_address":"\([^"]*\)".*/\1/p')
python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://$addr/metrics').read().decode())" |
  grep -E '^cushare_tenant_memory_(used|limit)_bytes|^cushare_tenant_processes|^cushare_tenant_gpu_busy_seconds_total'

echo
echo "== 7. clean up: stop the broker"
kill -TERM "$broker_pid"; wait "$broker_pid" 2>/dev/null || true; broker_pid=""
tail -1 "$work/broker.log"
