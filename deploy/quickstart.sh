#!/usr/bin/env bash
# The main job: installs what Morse needs, builds it, and shows 1-bit Adam at
# work. Today that is the single-process simulator of DESIGN section 2 (the
# same numerics the daemons will run: 1-bit Adam against fp32 Adam, with the
# bytes each pushes per step) and the codec benchmark against this machine's
# memory bandwidth. The gRPC server and worker daemons are the next step
# (docs/status.md); until they exist no network cluster is started.
#
# Usage: deploy/quickstart.sh [--dim=D] [--workers=N] [--shards=S] [--steps=T]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  -h|--help)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    "$root/build/tests/bench/onebit_sim_bench" --help 2>/dev/null || true
    exit 0 ;;
esac

"$root/deploy/install-deps.sh"
echo "== building (first build takes a few minutes)"
"$root/deploy/build.sh" >/dev/null
bin="${MORSE_BUILD_DIR:-$root/build}/tests/bench"

echo "== 1-bit Adam vs fp32 Adam on the simulator"
"$bin/onebit_sim_bench" "$@"

echo
echo "== codec throughput on one core, against this machine's memory bandwidth"
"$bin/compress_bench" --benchmark_filter='Triad|sign1_encode_ef/avx|sign1_decode/avx|encode_ef/int4|average4/sign1' \
  --benchmark_min_time=0.2 2>/dev/null | sed 's/\/min_time:[0-9.]*\/manual_time//'

echo
echo "Not yet here: morse-server and morse-worker over gRPC, the 2-server/4-worker"
echo "local cluster on the digits data set (see docs/status.md)."
