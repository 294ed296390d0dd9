#!/usr/bin/env bash
# deploy/Containerfile's runtime stage installs every Debian package whose libraries the image's
# binaries load (cushare-broker with the device plugin, cushare, libcushare.so: what ldd resolves
# them to here, on Debian 12 as the image is), beyond what debian:bookworm-slim has; and it copies
# what the install puts in place. (No registry is reachable here: the image itself is not built.)
#   usage: containerfile_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
file=$src/deploy/Containerfile
fail() { echo "containerfile_test: $*" >&2; exit 1; }
# debian:bookworm-slim: libc, the compiler's runtime and what apt itself loads.
base=" libc6 libgcc-s1 libstdc++6 zlib1g liblzma5 libzstd1 libsystemd0 libgcrypt20 libgpg-error0 liblz4-1 libcap2 libudev1 "
# The packages of the slim stage's apt-get install (up to its clean-up).
runtime=$(awk '/^FROM debian:\$\{DEBIAN\}-slim/ {r=1} r && /apt-get install/ {a=1} a && /rm -rf/ {a=0} a' "$file" |
  tr -s ' \\\n' '\n' | grep -E '^lib[a-z0-9.+-]+$' | sort -u)
[ -n "$runtime" ] || fail "no runtime packages found in the slim stage of $file"
needed=$(for b in "$build/bin/cushare-broker" "$build/bin/cushare" "$build/lib/libcushare.so"; do
  ldd "$b" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  path=$(readlink -f "$lib")
  # dpkg knows a file by the path its package ships (before or after Debian's /usr merge).
  dpkg -S "$path" 2>/dev/null || dpkg -S "${path#/usr}" 2>/dev/null || dpkg -S "$(dirname "$lib")/$(basename "$path")" 2>/dev/null ||
    echo "?:$path"
done | cut -d: -f1 | sort -u)
for p in $needed; do
  [ "$p" = "?" ] && fail "a library the binaries load belongs to no Debian package: $(echo "$needed" | tr '\n' ' ')"
  [[ $base == *" $p "* ]] && continue
  grep -qx -- "$p" <<<"$runtime" || fail "the binaries need $p, which the runtime stage does not install"
done
for p in $runtime; do
  grep -qx -- "$p" <<<"$needed" || fail "the runtime stage installs $p, which no binary loads"
done
# What it copies is what cmake --install puts there.
for f in bin/cushare-broker bin/cushare lib/cushare/libcushare.so lib/cushare/probes.fatbin; do
  grep -q "/usr/local/$f" "$file" || fail "$file does not copy $f"
  # The build tree holds what the install copies, laid out as installed (the shim beside lib/cushare).
  [ -e "$build/$f" ] || [ -e "$build/lib/$(basename "$f")" ] || fail "$f is not something the build provides"
done
echo "containerfile_test: the runtime stage installs exactly the $(wc -w <<<"$runtime") packages beyond the base the binaries load"
