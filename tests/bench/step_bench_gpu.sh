#!/usr/bin/env bash
# Issue 35's GPU checks in one go, for a GPU host lent for minutes (about
# 7 minutes on an H200): unpacks a bundle (deploy/bundle.sh), runs the GPU
# tests first (kernels_kernels_test, e2e_gpu_test, test_cuda_tensors.py: on
# 2026-11-27 it caught two bugs the others did not; test_diloco.py), then
# tests/bench/step_bench.py on the 134M GPT-like model: one rank on the GPU
# (torch-alone, OneBitAdam by phase, Adam, with step timelines), OneBitAdam
# and Adam at window 32 against the default (every partition), and two
# ranks sharing the GPU (no MPS: they time-slice) against DDP over gloo. Lines go to stdout and to
# $OUT (default /tmp/step-bench): tests.txt, one-rank.jsonl, window.jsonl,
# two-ranks.jsonl, and trace.tgz (the one-rank timelines;
# tests/bench/trace_summary.py reads them). Each part has its own time
# limit, so one that hangs does not take the others' time.
#
# Usage: tests/bench/step_bench_gpu.sh [BUNDLE.tar.gz|.tar.xz] [--quick]
#   (default out/morse-bundle.tar.gz; --quick: 4 timed steps instead of 6)
#   PARTS=tests,one,window,two (the default: all) picks the parts, so that
#   a lease's calls can split them (window: window 32 against the GPU's
#   default, every partition); PARTS=priority times 1-bit Adam with the
#   send stream at normal and high priority, alternated (priority.jsonl).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bundle="${1:-out/morse-bundle.tar.gz}"
steps=6
[ "${2:-}" = "--quick" ] && steps=4
out="${OUT:-/tmp/step-bench}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xf "$bundle" -C "$work" || exit 1
export PYTHONPATH="$work/morse/python" MORSE_RUN="$work/morse/bin/morse-run" PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "## $(($(date +%s) - t0)) s: $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'
echo "$(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
status=0
parts=",${PARTS:-tests,one,window,two},"
want() { [[ "$parts" == *",$1,"* ]]; }
if want tests; then
stamp "GPU tests"
{
  timeout 150 "$work/morse/tests/run-tests.sh" gpu --gtest_brief=1 2>&1 ||
    echo "FAILED: run-tests.sh gpu"
  # The kernels against a device copy: 1-bit LAMB's layer sums a warp a
  # segment, the pieces added on the GPU since 2026-12-06 (never timed on
  # one; issue 36's target 0.8 of a copy).
  stamp "kernels_bench"
  timeout 120 "$work/morse/tests/run-tests.sh" bench 2>&1 ||
    echo "FAILED: run-tests.sh bench"
  # With OneBitLamb's and ZeroOneAdam's parameter groups on the GPU since
  # 2026-12-04 (session 69; not yet run on one): 8 jobs.
  stamp "test_cuda_tensors.py"
  (cd "$work/morse/tests/python" && timeout 300 python3 test_cuda_tensors.py 2>&1) ||
    echo "FAILED: test_cuda_tensors.py"
  # Norms of other orders, clips of part of the model and edits after the
  # clip on CUDA tensors, 2 ranks against DDP's rule (never run on a GPU
  # before; written 2026-12-04, session 68; edit_any@cuda, the edits that
  # amend from the step after the first, session 74).
  stamp "test_adam_matches_torch.py cuda"
  (cd "$work/morse/tests/python" && timeout 300 python3 test_adam_matches_torch.py cuda 2>&1) ||
    echo "FAILED: test_adam_matches_torch.py cuda"
  # Nodes of 2 ranks sharing the GPU, led and sharded (never run on one
  # before 2026-12-04); since session 76 also edits of .grad after the
  # clip on them: in the compression phase (edit@cuda, own) and in the
  # steps that average (learnleader, learnfull, addone), never run on one.
  stamp "test_node_aggregation.py cuda"
  (cd "$work/morse/tests/python" && timeout 200 python3 test_node_aggregation.py cuda 2>&1) ||
    echo "FAILED: test_node_aggregation.py cuda"
  stamp "test_node_sharding.py cuda"
  (cd "$work/morse/tests/python" && timeout 360 python3 test_node_sharding.py cuda 2>&1) ||
    echo "FAILED: test_node_sharding.py cuda"
  # DiLoCo with two ranks' models on the GPU, and fp16 loss scaling with
  # GradScaler("cuda") (neither run on one before 2026-12-04).
  stamp "test_diloco.py int8@cuda"
  (cd "$work/morse/tests/python" && timeout 100 python3 test_diloco.py int8@cuda 2>&1) ||
    echo "FAILED: test_diloco.py int8@cuda"
  stamp "test_grad_scaler.py cuda"
  (cd "$work/morse/tests/python" && timeout 100 python3 test_grad_scaler.py cuda 2>&1) ||
    echo "FAILED: test_grad_scaler.py cuda"
  # add_param_group on CUDA tensors (written 2026-12-05, not yet run on one).
  stamp "test_add_param_group.py cuda"
  (cd "$work/morse/tests/python" && timeout 150 python3 test_add_param_group.py cuda 2>&1) ||
    echo "FAILED: test_add_param_group.py cuda"
  # fp16 under Trainer and Accelerate (their GradScaler on CUDA), from the
  # source tree (the examples are not in the bundle).
  stamp "test_hf.py fp16"
  (cd "$here/../python" && timeout 200 python3 test_hf.py fp16 2>&1) || echo "FAILED: test_hf.py fp16"
} 2>&1 | tee "$out/tests-full.txt" | grep -E "PASS|FAIL|tests from|all passed|failed|^GPU|^SKIP|Error|error|^##" | tee "$out/tests.txt"
grep -q "FAIL" "$out/tests.txt" && status=1
fi
bench=(python3 "$here/step_bench.py" --model gpt134m --device cuda --shards 2 --steps "$steps" --skip 2)
if want one; then
  stamp "one rank"
  timeout 200 "${bench[@]}" --ranks 1 --modes torch,onebit_adam,adam --trace-dir "$work/trace" 2>&1 | grep '^{' | tee "$out/one-rank.jsonl" || status=1
  tar -czf "$out/trace.tgz" -C "$work" trace
fi
# The window: a GPU worker keeps every partition in flight by default
# (since 2026-12-04: at 32 the last partitions waited for a slot and the
# fp32 exchange was paced by 32 partitions of 4 MB in flight). The old
# window of 32 against the default, alternated.
if want window; then
  for window in 32 default; do
    stamp "one rank, window $window"
    flag=()
    [ "$window" = default ] || flag=(--window "$window")
    timeout 150 "${bench[@]}" --ranks 1 --modes onebit_adam,adam "${flag[@]}" 2>&1 | grep '^{' |
      sed "s/^{/{\"window\": \"$window\", /" | tee -a "$out/window.jsonl" || status=1
  done
fi
# The send stream's priority (MORSE_SEND_STREAM_PRIORITY; high by default
# since 2026-12-04, when it took 5-11% off the 1-bit step: the encodes no
# longer queue behind backward()'s kernels). Normal and high alternated,
# twice each, 1-bit Adam with one rank (PARTS=priority; not in the default).
if want priority; then
  for round in 1 2; do
    for priority in normal high; do
      stamp "one rank, send stream $priority (round $round)"
      MORSE_SEND_STREAM_PRIORITY=$priority timeout 120 "${bench[@]}" --ranks 1 --modes torch,onebit_adam 2>&1 |
        grep '^{' | sed "s/^{/{\"send_priority\": \"$priority\", /" | tee -a "$out/priority.jsonl" || status=1
    done
  done
fi
if want two; then
  stamp "two ranks"
  timeout 200 "${bench[@]}" --ranks 2 --modes torch,onebit_adam,adam,ddp 2>&1 | grep '^{' | tee "$out/two-ranks.jsonl" || status=1
fi
stamp done
exit $status
