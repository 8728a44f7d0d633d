#!/usr/bin/env bash
# Builds the libFuzzer targets with clang, ASan and UBSan (any report fatal)
# in a build folder of their own and runs each for a bounded time:
# fuzz_payload (every codec's decoder), fuzz_config (text, JSON and binary
# job configs, overrides), fuzz_checkpoint (the checkpoint reader). ctest
# runs this as `fuzz_targets` (labels fuzz, sanitize); by hand:
#
#   tests/fuzz/run.sh [BUILD_DIR]          (default build/fuzz)
#   MORSE_FUZZ_SECONDS=600 tests/fuzz/run.sh   (longer runs; default 20 s each)
#
# Skipped (exit 77), saying so, without clang++ and its libFuzzer. The seed
# corpus: the shipped configs; crashes are written to BUILD_DIR/crashes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build/fuzz}"
seconds="${MORSE_FUZZ_SECONDS:-20}"
jobs="${MORSE_JOBS:-$(nproc)}"
command -v clang++ >/dev/null || { echo "fuzz: SKIPPED: no clang++ (apt-get install clang)"; exit 77; }
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
  clang++ -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null ||
  { echo "fuzz: SKIPPED: clang++ has no libFuzzer (apt-get install clang)"; exit 77; }
mkdir -p "$build"
CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DMORSE_ENABLE_CUDA=OFF -DMORSE_FUZZ=ON \
  -DMORSE_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
targets=(fuzz_payload fuzz_config fuzz_checkpoint)
echo "fuzz: building ${targets[*]} with clang -fsanitize=fuzzer,address,undefined"
ninja -C "$build" -j "$jobs" "${targets[@]}" >"$build/build.log" 2>&1 || { tail -50 "$build/build.log"; exit 1; }
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
mkdir -p "$build/crashes"
failed=()
for t in "${targets[@]}"; do
  corpus="$build/corpus/$t"
  mkdir -p "$corpus"
  [ "$t" = fuzz_config ] && cp "$root"/deploy/configs/*.textproto "$root"/deploy/k8s/overlays/*/job.textproto "$corpus/" 2>/dev/null || true
  if out="$("$build/tests/fuzz/$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
              -artifact_prefix="$build/crashes/$t-" "$corpus" 2>&1)"; then
    echo "ok   $t: $(grep -E '^Done [0-9]+ runs' <<<"$out" | tail -1)"
  else
    echo "FAIL $t"
    echo "$out" | tail -40
    failed+=("$t")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "fuzz: FAILED: ${failed[*]} (inputs in $build/crashes)"; exit 1; }
echo "fuzz: ${#targets[@]} targets ran ${seconds} s each under ASan and UBSan without a finding"
