#!/usr/bin/env bash
# Runs a Morse bundle's tests from wherever the bundle was unpacked (made by
# deploy/bundle.sh; this file is morse/tests/run-tests.sh there). The test
# binaries find the daemons in ../bin and their libraries in ../lib.
#
# Usage: run-tests.sh [cpu|gpu|python|memcheck|bench|all] [gtest flags...]
#   cpu       the unit tests and the end-to-end tests that need no source tree
#   gpu       the CUDA kernel tests and the mixed CPU/GPU jobs (skip, saying
#             why, without a GPU)
#   python    the morse.torch tests with $PYTHON (default python3), which
#             needs numpy and torch; the CUDA one skips without a GPU
#   memcheck  the kernel tests under compute-sanitizer --tool memcheck
#   bench     kernels_bench --mib 256 (each kernel against a device copy)
#   all       cpu, gpu, memcheck and bench
# Exits non-zero if any test binary fails.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
what="${1:-cpu}"
shift || true
failed=()

run() {
  echo "=== $*"
  if ! "$@"; then failed+=("$1"); fi
}

cpu() {
  for t in "$here"/compress_*_test "$here"/proto_*_test "$here"/server_*_test "$here"/worker_*_test \
           "$here"/e2e_training_test "$here"/e2e_bad_input_test "$here"/e2e_session_test \
           "$here"/e2e_checkpoint_test "$here"/e2e_health_test "$here"/e2e_metrics_test; do
    [ -x "$t" ] && run "$t" --gtest_brief=1 "$@"
  done
}
gpu() {
  run "$here/kernels_kernels_test" "$@"
  [ -x "$here/e2e_gpu_test" ] && run "$here/e2e_gpu_test" "$@"
}
python() {
  local py="${PYTHON:-python3}" code
  for t in "$here"/python/test_*.py; do
    echo "=== $py $t"
    (cd "$here/python" && PYTHONPATH="$here/../python" MORSE_RUN="$here/../bin/morse-run" "$py" "$t")
    code=$?
    if [ $code -eq 77 ]; then echo "(skipped)"; elif [ $code -ne 0 ]; then failed+=("$t"); fi
  done
}
memcheck() {
  local sanitizer
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  run "$sanitizer" --tool memcheck --error-exitcode 1 "$here/kernels_kernels_test" "$@"
}
bench() {
  run "$here/kernels_bench" --mib 256 "$@"
}

case "$what" in
  cpu) cpu "$@" ;;
  gpu) gpu "$@" ;;
  memcheck) memcheck "$@" ;;
  bench) bench "$@" ;;
  python) python ;;
  all) cpu; gpu; python; memcheck; bench ;;
  -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "run-tests.sh: unknown set '$what' (cpu, gpu, python, memcheck, bench or all)" >&2; exit 2 ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  echo "run-tests.sh: FAILED: ${failed[*]}"
  exit 1
fi
echo "run-tests.sh: all passed ($what)"
