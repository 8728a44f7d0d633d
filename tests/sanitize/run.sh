#!/usr/bin/env bash
# Builds tests with sanitizers in a build folder of their own, and runs them;
# any report fails the run.
#
#   tests/sanitize/run.sh [BUILD_DIR]           ASan + UBSan: the unit tests of
#                                               compress/, proto/, server/ and
#                                               worker/ (default build/sanitize)
#   tests/sanitize/run.sh --thread [BUILD_DIR]  ThreadSanitizer: the tests that
#                                               run threads without gRPC (the
#                                               compute pool, the shard, its
#                                               runtime) and the in-process
#                                               fault sweep and membership
#                                               tests (default build/tsan)
#
# ctest runs them as `sanitize_unit_tests` and `tsan_tests` (label sanitize).
# Under TSan, locks are compress/sync.h's std::mutex-based ones (Debian's
# Abseil is not instrumented); gRPC's threads are not, so the tests that
# serve gRPC stay out of the TSan run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$root/tests/sanitize"
mode=address
if [ "${1:-}" = "--thread" ]; then
  mode=thread
  shift
fi
jobs="${MORSE_JOBS:-$(nproc)}"
if [ "$mode" = thread ]; then
  build="${1:-$root/build/tsan}"
  sanitizers=thread
  pattern='^tests/(compress/compress_(compute_pool|lamb|simulator)|server/server_shard_(core|runtime)|inproc/inproc_(fault_sweep|trainer|membership))_test'
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
else
  build="${1:-$root/build/sanitize}"
  sanitizers=address,undefined
  pattern='^tests/(compress|proto|server|worker)/[a-z0-9_]+_test'
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1"
  export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
fi
mkdir -p "$build"
# -O1 -g1: line tables are all a report's stack needs, and the instrumented
# build compiles in about 40% less time than -O2 -g (CI runs both builds).
cmake -S "$root" -B "$build" -G Ninja -DMORSE_ENABLE_CUDA=OFF -DMORSE_SANITIZE="$sanitizers" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
mapfile -t tests < <(ninja -C "$build" -t targets all | grep -oE "$pattern" | sort -u)
[ ${#tests[@]} -gt 0 ] || { echo "sanitize: no test targets found" >&2; exit 1; }
echo "sanitize: building ${#tests[@]} tests with -fsanitize=$sanitizers"
ninja -C "$build" -j "$jobs" "${tests[@]}" >"$build/build.log" 2>&1 || { tail -50 "$build/build.log"; exit 1; }
# Under TSan the test binaries run side by side, the long in-process sweeps
# split into gtest shards: those wait on their faults' timeouts far more
# than they compute (the fault sweep ran 270 s for 41 s of CPU), and one
# after another they held a ctest slot for minutes. Under ASan they run one
# at a time (a minute in all; some serve gRPC against deadlines).
shards_of() {
  [ "$mode" = thread ] || { echo 1; return; }
  case "$1" in
    */inproc_fault_sweep_test) echo 6 ;;
    */inproc_membership_test) echo 3 ;;
    *) echo 1 ;;
  esac
}
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
# run_part K TEST SHARDS INDEX: one gtest shard of TEST, its output in
# $logs/K and its exit status in $logs/K.code.
run_part() {
  local code=0
  GTEST_TOTAL_SHARDS="$3" GTEST_SHARD_INDEX="$4" "$build/$2" --gtest_brief=1 >"$logs/$1" 2>&1 ||
    code=$?
  echo "$code" >"$logs/$1.code"
}
names=()
for t in "${tests[@]}"; do
  n="$(shards_of "$t")"
  for ((i = 0; i < n; ++i)); do
    k=${#names[@]}
    if [ "$n" -eq 1 ]; then names+=("$t"); else names+=("$t (shard $((i + 1))/$n)"); fi
    if [ "$mode" = thread ]; then
      run_part "$k" "$t" "$n" "$i" &
    else
      run_part "$k" "$t" "$n" "$i"
    fi
  done
done
wait
failed=()
for k in "${!names[@]}"; do
  out="$logs/$k"
  code="$(cat "$out.code")"
  if [ "$code" -eq 0 ]; then
    echo "ok   ${names[$k]}: $(grep -E 'PASSED' "$out" | tail -1)"
  else
    echo "FAIL ${names[$k]} (exit $code)"
    grep -A60 -E 'Sanitizer|runtime error' "$out" | head -80 || true
    tail -40 "$out"
    failed+=("${names[$k]}")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "sanitize: FAILED: ${failed[*]}"; exit 1; }
echo "sanitize: ${#tests[@]} test binaries clean under -fsanitize=$sanitizers"
