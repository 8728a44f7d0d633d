#!/usr/bin/env bash
# Installs the Debian 12 packages Morse builds and tests with, skipping the
# ones already installed (so repeated runs cost nothing and need no network).
# Usage: deploy/install-deps.sh [extra-package...]
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  libboost-dev libboost-system-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev python3-sklearn prometheus-cpp-dev prometheus
  python3-dev python3-torch python3-matplotlib iproute2
  openssl systemd dpkg-dev patchelf xz-utils python3-pip python3-setuptools python3-venv
  clang libclang-rt-14-dev clang-format python3-pyflakes
  "$@"
)
# The deploy checks run npm packages (tests/deploy); Debian's npm unless a
# Node.js with npm is already installed.
command -v npm >/dev/null || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "morse: installing Debian packages: ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then
    sudo="sudo"
  else
    echo "morse: need root (or sudo) to apt-get install: ${missing[*]}" >&2
    exit 1
  fi
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
