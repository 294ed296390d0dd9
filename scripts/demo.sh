#!/usr/bin/env bash
# The demo: builds cushare, then runs an unmodified CUDA program on simgpu, the simulated GPU,
# shows the device being shared host-wide (one process's memory is seen by all, and comes back
# when that process is killed), and then the shim: two tenants with memory limits.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
export LD_LIBRARY_PATH="$PWD/build/lib/simgpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SIMGPU_STATE_DIR="$(mktemp -d /tmp/cushare-demo.XXXXXX)"
export SIMGPU_MEMORY=16GiB
trap 'kill -9 $holder 2>/dev/null || true; rm -rf "$SIMGPU_STATE_DIR"' EXIT

echo "== 1. an ordinary CUDA program (nvcc-built, cudart static) on simgpu"
build/examples/vector_add
echo
echo "== 2. one process holds 6 GiB; every process on the host sees it"
build/examples/vector_add 6144 30 &
holder=$!
for _ in $(seq 1 100); do
  build/tools/simgpu-smi | grep -q "pid $holder" && break
  sleep 0.1
done
build/tools/simgpu-smi
echo
echo "== 3. kill -9 the holder: its memory comes back"
kill -9 "$holder"
wait "$holder" 2>/dev/null || true
build/tools/simgpu-smi

echo
echo "== 4. the shim: tenant alpha (limit 4GiB) asks for 6 GiB and is refused; beta (8GiB) gets it"
export CUSHARE_LEDGER_DIR="$SIMGPU_STATE_DIR/ledgers"
LD_PRELOAD="$PWD/build/lib/libcushare.so" CUSHARE_TENANT=alpha CUSHARE_MEMORY_LIMIT=4GiB \
  build/examples/vector_add 6144 0 || echo "(alpha's program failed its allocation, as it should)"
LD_PRELOAD="$PWD/build/lib/libcushare.so" CUSHARE_TENANT=beta CUSHARE_MEMORY_LIMIT=8GiB \
  build/examples/vector_add 6144 0
