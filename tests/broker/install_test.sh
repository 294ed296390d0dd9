#!/bin/sh
# The install layout of DESIGN.md, used as an operator would: `cmake --install` into a fresh
# prefix, the installed broker started on simgpu, the installed CLI finding the installed shim
# for `cushare env` and `cushare run`, an installed example run as a tenant.
# usage: install_test.sh BUILD_DIR WORK_DIR
set -eu
build=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/cushare-broker bin/cushare lib/cushare/libcushare.so lib/cushare/probes.fatbin lib/cushare/simgpu/libcuda.so.1 \
         lib/cushare/simgpu/libcuda.so lib/cushare/simgpu/libnvidia-ml.so.1 \
         share/cushare/examples/vector_add share/cushare/examples/alloc_until_denied \
         share/cushare/examples/busy_for share/cushare/examples/busy_for.costs \
         share/man/man1/cushare.1 share/man/man1/cushare-broker.1 \
         share/bash-completion/completions/cushare share/bash-completion/completions/cushare-broker \
         share/zsh/vendor-completions/_cushare; do
  [ -e "$prefix/$f" ] || { echo "install_test: $f is not installed" >&2; exit 1; }
done

export LD_LIBRARY_PATH="$prefix/lib/cushare/simgpu"
export SIMGPU_STATE_DIR="$work/simgpu" SIMGPU_MEMORY=2GiB
# The socket's directory must be writable by the broker's user only (the broker refuses /tmp itself).
sockdir="/tmp/cushare-install-test-$$"
mkdir -m 0755 "$sockdir"
sock="$sockdir/broker.sock"
cat >"$work/broker.yaml" <<YAML
ledger_dir: $work/ledgers
socket: $sock
state_file: $work/broker.state
metrics_listen: off
cdi: {spec_dir: $work/cdi}
tenants:
  - {name: alpha, memory: 256MiB, thread_percentage: 30}
YAML
"$prefix/bin/cushare-broker" --config "$work/broker.yaml" --check
"$prefix/bin/cushare-broker" --config "$work/broker.yaml" 2>"$work/broker.log" &
broker=$!
trap 'kill $broker 2>/dev/null; rm -rf "$sockdir"' EXIT
export CUSHARE_SOCKET="$sock"
i=0
until "$prefix/bin/cushare" status >/dev/null 2>&1; do
  i=$((i + 1))
  [ $i -lt 200 ] || { cat "$work/broker.log" >&2; exit 1; }
  sleep 0.05
done

"$prefix/bin/cushare" env --tenant alpha >"$work/alpha.env"
grep -qx "LD_PRELOAD=$prefix/lib/cushare/libcushare.so" "$work/alpha.env" ||
  { echo "install_test: cushare env did not name the installed shim:" >&2; cat "$work/alpha.env" >&2; exit 1; }
"$prefix/bin/cushare" run --tenant alpha -- "$prefix/share/cushare/examples/vector_add" >"$work/run.out"
grep -q "correct" "$work/run.out" || { cat "$work/run.out" >&2; exit 1; }
# Under the shim the installed example sees alpha's 256 MiB as the device.
grep -q "SMs, 0.2 GiB$" "$work/run.out" || { echo "install_test: not the tenant's view:" >&2; cat "$work/run.out" >&2; exit 1; }
# The CDI spec names the installed shim on the host side and the fixed container path.
grep -q "\"hostPath\": \"$prefix/lib/cushare/libcushare.so\", \"containerPath\": \"/usr/local/cushare/lib/libcushare.so\"" \
  "$work/cdi/cushare.io-tenant.json" ||
  { echo "install_test: the CDI spec does not mount the installed shim:" >&2; cat "$work/cdi/cushare.io-tenant.json" "$work/broker.log" >&2; exit 1; }
# The installed busy_for under alpha's cap of 30 %: the share it reports for its second second
# (100 alone) is the cap's, within what a loaded host's scheduling moves; a usage error exits 2.
SIMGPU_KERNEL_COSTS="$prefix/share/cushare/examples/busy_for.costs" \
  "$prefix/bin/cushare" run --tenant alpha -- "$prefix/share/cushare/examples/busy_for" --seconds 3 >"$work/busy.out"
share=$(sed -n 's/^\[alpha\] second 2: *\([0-9]*\) % of the device.s time$/\1/p' "$work/busy.out")
[ -n "$share" ] && [ "$share" -ge 15 ] && [ "$share" -le 45 ] ||
  { echo "install_test: busy_for under a cap of 30 % did not report about 30 %:" >&2; cat "$work/busy.out" >&2; exit 1; }
rc=0
"$prefix/share/cushare/examples/busy_for" --seconds 0 2>"$work/busy.err" || rc=$?
[ $rc -eq 2 ] && grep -q "^busy_for: --seconds: " "$work/busy.err" ||
  { echo "install_test: busy_for --seconds 0 exited $rc:" >&2; cat "$work/busy.err" >&2; exit 1; }
# The man pages render without warnings and carry every verb of the help they came from.
for page in cushare cushare-broker; do
  warnings=$(MANWIDTH=100 man --warnings -l "$prefix/share/man/man1/$page.1" 2>&1 >"$work/$page.txt")
  [ -z "$warnings" ] || { echo "install_test: man $page: $warnings" >&2; exit 1; }
done
for verb in $("$prefix/bin/cushare" --help | awk '/^verbs:/ {v=1; next} /^[a-z]/ {v=0} v && /^  [a-z]/ {print $1}'); do
  grep -q "^ *$verb" "$work/cushare.txt" || { echo "install_test: man cushare lacks the verb $verb" >&2; exit 1; }
done
grep -q -- "--check" "$work/cushare-broker.txt" || { echo "install_test: man cushare-broker lacks --check" >&2; exit 1; }
# Completion: bash, as a shell would call it (verbs, a verb's options, tenant names from the
# broker, values), and zsh's file at least parses.
cat >"$work/complete.bash" <<'BASH'
set -u
. "$1"
complete_line() {  # the completions of the last word of $1
  read -r -a COMP_WORDS <<<"$1"
  [[ $1 == *" " ]] && COMP_WORDS+=("")
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
  COMPREPLY=()
  if [[ ${COMP_WORDS[0]} == cushare-broker ]]; then _cushare_broker; else _cushare; fi
  echo "${COMPREPLY[*]}"
}
expect() {
  local got
  got=$(complete_line "$1")
  [[ " $got " == *" $2 "* ]] || { echo "install_test: completing '$1' gave '$got', without $2" >&2; exit 1; }
}
expect "cushare " status
expect "cushare to" top
expect "cushare top --" --interval
expect "cushare top --" --once
expect "cushare set-limit " alpha
expect "cushare run --tenant a" alpha
expect "cushare set-limit alpha --priority " low
expect "cushare --" --socket
expect "cushare-broker --log-level " debug
expect "cushare-broker --c" --check
expect "cushare-broker --log-format " json
expect "cushare run --tenant alpha -- tr" true
[[ -z $(complete_line "cushare status --memory ") ]] || { echo "install_test: a size was completed" >&2; exit 1; }
BASH
PATH="$prefix/bin:$PATH" bash "$work/complete.bash" "$prefix/share/bash-completion/completions/cushare"
zsh -n "$prefix/share/zsh/vendor-completions/_cushare" || { echo "install_test: _cushare does not parse" >&2; exit 1; }
echo "install_test: layout and installed tools work"
