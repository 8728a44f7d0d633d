#!/usr/bin/env bash
# Builds the unit tests of compress/, proto/, server/ and worker/ with
# AddressSanitizer and UndefinedBehaviorSanitizer (MORSE_SANITIZE, any report
# fatal) in a build folder of their own, and runs them. ctest runs this as
# `sanitize_unit_tests` (label sanitize); by hand:
#
#   tests/sanitize/run.sh [BUILD_DIR]     (default build/sanitize)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build/sanitize}"
jobs="${MORSE_JOBS:-$(nproc)}"
mkdir -p "$build"
cmake -S "$root" -B "$build" -G Ninja -DMORSE_ENABLE_CUDA=OFF -DMORSE_SANITIZE=address,undefined \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
mapfile -t tests < <(ninja -C "$build" -t targets all |
  grep -oE '^tests/(compress|proto|server|worker)/[a-z0-9_]+_test' | sort -u)
[ ${#tests[@]} -gt 0 ] || { echo "sanitize: no unit test targets found" >&2; exit 1; }
echo "sanitize: building ${#tests[@]} unit tests with -fsanitize=address,undefined"
ninja -C "$build" -j "$jobs" "${tests[@]}" >"$build/build.log" 2>&1 || { tail -50 "$build/build.log"; exit 1; }
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")" && pwd)/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=()
for t in "${tests[@]}"; do
  if out="$("$build/$t" --gtest_brief=1 2>&1)"; then
    echo "ok   $t: $(grep -E 'PASSED' <<<"$out" | tail -1)"
  else
    echo "FAIL $t"
    echo "$out" | tail -40
    failed+=("$t")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "sanitize: FAILED: ${failed[*]}"; exit 1; }
echo "sanitize: ${#tests[@]} unit test binaries clean under ASan and UBSan"
