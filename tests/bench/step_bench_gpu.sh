#!/usr/bin/env bash
# Issue 35's GPU measurements in one go, for a GPU host lent for minutes:
# unpacks a bundle (deploy/bundle.sh) and runs tests/bench/step_bench.py on
# the 134M GPT-like model, one rank on the GPU and two sharing it (no MPS:
# they time-slice), then 1-bit Adam with a window of 512 partitions and with
# 4M-element partitions. JSON lines go to stdout and to $OUT (default
# /tmp/step-bench) as one-rank.jsonl, window.jsonl, two-ranks.jsonl and
# partitions.jsonl; the one-rank modes' step timelines to $OUT/trace
# (tests/bench/trace_summary.py reads them).
#
# Usage: tests/bench/step_bench_gpu.sh [BUNDLE.tar.gz|.tar.xz] [--quick]
#   (default out/morse-bundle.tar.gz; --quick: 4 timed steps instead of 8)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bundle="${1:-out/morse-bundle.tar.gz}"
steps=8
[ "${2:-}" = "--quick" ] && steps=4
out="${OUT:-/tmp/step-bench}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xf "$bundle" -C "$work" || exit 1
export PYTHONPATH="$work/morse/python" MORSE_RUN="$work/morse/bin/morse-run" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
nproc
bench=(python3 "$here/step_bench.py" --model gpt134m --device cuda --shards 2 --steps "$steps" --skip 2)
status=0
"${bench[@]}" --ranks 1 --modes torch,onebit_adam,adam,ddp_nccl --trace-dir "$out/trace" | tee "$out/one-rank.jsonl" || status=1
# The window of every partition (the trace showed the default 32 holding the
# last partitions back): against the line above.
"${bench[@]}" --ranks 1 --modes onebit_adam --window 512 | tee "$out/window.jsonl" || status=1
"${bench[@]}" --ranks 2 --modes torch,onebit_adam,adam,ddp,onebit_peer | tee "$out/two-ranks.jsonl" || status=1
"${bench[@]}" --ranks 1 --modes onebit_adam --partition-elems 4194304 | tee "$out/partitions.jsonl" || status=1
exit $status
