#!/usr/bin/env bash
# Installs what Morse needs (Debian packages), builds it, and runs every test
# with ctest. This is the README's test command and what CI runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/deploy/install-deps.sh"
"$root/deploy/build.sh"
build="${MORSE_BUILD_DIR:-$root/build}"
cd "$build"
ctest --output-on-failure -j "${MORSE_JOBS:-$(nproc)}" --timeout 900 "$@"
