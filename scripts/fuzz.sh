#!/usr/bin/env bash
# Fuzzes the broker's request decoder (broker/rpc/codec.cpp) with libFuzzer, ASan and UBSan for
# SECONDS (default 20), starting from tests/broker/corpus. Builds tests/fuzz/ with clang in
# build-fuzz/. Exits non-zero on a crash, a leak, undefined behaviour or a broken invariant of
# decodeForFuzzing; the input that did it is kept as build-fuzz/crash-* (or leak-*, timeout-*).
#
# usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail

seconds=${1:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-fuzz

CC=clang CXX=clang++ cmake -S "$root/tests/fuzz" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" -j2 request_fuzzer

# libFuzzer adds what it finds to the first corpus directory: give it a copy, so the checked-in
# corpus changes only on purpose (tests/broker/make_corpus.py).
work=$build/corpus-run
rm -rf "$work"
cp -r "$root/tests/broker/corpus" "$work"

"$build/request_fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=8192 \
  -timeout=10 -artifact_prefix="$build/" -print_final_stats=1 "$work"
echo "fuzz.sh: no crash in ${seconds}s" >&2
