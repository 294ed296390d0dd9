#!/usr/bin/env bash
# Installs the Debian packages cushare builds and tests with. The CUDA 13 toolkit is expected at
# /usr/local/cuda (it is not a Debian package). Safe to run again: apt-get skips what is there.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build python3 pkg-config
  libspdlog-dev libfmt-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc python3-yaml python3-venv
  libunwind-dev
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev valgrind
  libyaml-dev
  clang libclang-rt-14-dev
  prometheus  # promtool: the alerting rules' tests (ctest prometheus_rules); the server is not used
  help2man    # the man pages, generated from --help
  zsh         # install_layout checks the zsh completion's syntax
)

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: the CUDA toolkit is missing: expected /usr/local/cuda/bin/nvcc" >&2
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == *"install ok installed"* ]] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
