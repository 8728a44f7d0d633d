#!/usr/bin/env bash
# Configures and builds Morse into ${MORSE_BUILD_DIR:-build} (Ninja, release
# with debug info). Extra arguments go to cmake's configure step.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MORSE_BUILD_DIR:-$root/build}"
jobs="${MORSE_JOBS:-$(nproc)}"
mkdir -p "$build"
# The CUDA kernels build wherever nvcc is, on PATH or in CUDA's default place.
if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
cmake -S "$root" -B "$build" -G Ninja "$@" >"$build/configure.log" 2>&1 || {
  cat "$build/configure.log" >&2
  exit 1
}
grep -E "^-- Morse" "$build/configure.log" || true
cmake --build "$build" -j "$jobs"
