#!/usr/bin/env bash
# docs/quickstart.md, sections 2 and 3, run as written: every ```sh block but the build's, in order,
# in one shell, as an ordinary user (uid 2000, as the page says: no root needed), from a copy of
# the build where that user can read it (the checkout may be private). Then what they printed is
# checked against what the page says they print.
#   usage: quickstart_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -uo pipefail
src=$1 build=$2 work=$3
fail() { echo "quickstart_test: $*" >&2; [ -f "$work/out.log" ] && { echo "--- what the page's commands printed:" >&2; cat "$work/out.log" >&2; }; exit 1; }
rm -rf "$work" && mkdir -p "$work" && chmod 755 "$work"
[ "$(id -u)" = 0 ] || { echo "quickstart_test: runs the page as uid 2000, which needs root (CI runs as root)"; exit 77; }

# The build's parts the page uses, laid out as in build/.
stage="$work/build"
mkdir -p "$stage/bin" "$stage/lib" "$stage/examples/tenant"
cp "$build/bin/cushare-broker" "$build/bin/cushare" "$stage/bin/"
cp -r "$build/lib/simgpu" "$build/lib/cushare" "$build/lib/libcushare.so" "$stage/lib/"
cp "$build/examples/tenant/alloc_until_denied" "$stage/examples/tenant/"
chmod -R a+rX "$work"

# The page's blocks: ```sh exactly (```sh build is section 1, done by the suite's own build).
script="$work/quickstart.sh"
{
  echo "set -euo pipefail"
  echo "cd $work"
  awk '/^```sh$/ {on=1; next} /^```/ {on=0} on' "$src/docs/quickstart.md"
} >"$script"
[ "$(grep -c . "$script")" -gt 20 ] || fail "found no commands in docs/quickstart.md"
chmod 644 "$script"
# What the page leaves when it fails half way (a broker, a tenant program, its directory) goes at
# exit; whether it left anything when it succeeded is checked below first.
before=$(ls -d /tmp/cushare-quickstart.* 2>/dev/null)
cleanup() {
  pkill -u 2000 -f "cushare-broker --config /tmp/cushare-quickstart[.]" 2>/dev/null
  pkill -u 2000 -f "examples/tenant/alloc_until_denied" 2>/dev/null
  for d in /tmp/cushare-quickstart.*; do
    [ -d "$d" ] && [ "$(stat -c %u "$d")" = 2000 ] && ! grep -qxF "$d" <<<"$before" && rm -rf "$d"
  done
  return 0
}
trap cleanup EXIT
# A shell of uid 2000's own: its environment is only what the page sets (and BUILD, which
# the page lets the reader point at their build tree).
env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$work" BUILD="$stage" \
  timeout 120 setpriv --reuid=2000 --regid=2000 --clear-groups bash "$script" >"$work/out.log" 2>&1
rc=$?
[ "$rc" = 0 ] || fail "the page's commands failed (exit $rc)"

out=$(cat "$work/out.log")
expect() { grep -qE -- "$1" <<<"$out" || fail "not printed: $2 (/$1/)"; }
expect "broker\.yaml: valid for this host's 1 device\(s\)" "--check's verdict"
expect "^metrics +127\.0\.0\.1:[0-9]+" "cushare status's metrics address"
expect "\[alpha\] \+64 MiB -> holding 512 MiB" "alpha holding 512 MiB"
expect "\[alpha\] denied at 512 MiB: out of memory" "alpha denied at its limit"
expect "^alpha +0 +512 MiB +512 MiB +512 MiB +1 " "cushare tenants: alpha at its 512 MiB limit, one denial"
expect "^alpha +0 +768 MiB +768 MiB\* " "cushare tenants: alpha at the raised limit, set live"
expect "^cushare top " "cushare top's frame"
expect "^ +alpha +high +30% " "cushare top's row for alpha (priority, cap)"
expect "^cushare_tenant_memory_limit_bytes\{tenant=\"alpha\",device=\"0\",uuid=\"GPU-[0-9a-f-]+\"\} 805306368$" \
  "the metric of alpha's raised limit"
expect "^alpha +0 +0 B +768 MiB\* " "cushare tenants: alpha's memory back once it stopped"
expect "^no broker any more$" "the broker gone after teardown"
# Teardown left nothing: no broker, no work directory.
pgrep -u 2000 -f "cushare-broker --config /tmp/cushare-quickstart[.]" >/dev/null && fail "a broker of the page still runs"
for d in /tmp/cushare-quickstart.*; do
  [ -d "$d" ] && ! grep -qxF "$d" <<<"$before" && fail "the page's directory $d is still there"
done
echo "quickstart_test: every command of docs/quickstart.md sections 2-3 ran and printed what the page says"
