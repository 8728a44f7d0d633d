#!/usr/bin/env bash
# Two bundles' GPU step benchmark on one host, alternated round by round, to
# tell a change in the code from a change in the host. On 2026-12-04 the
# one-rank 1-bit step of the 134M model read 102 ms on one H200 where it had
# read 71 ms on another on 2026-11-27, with DDP over gloo 1.59x slower there
# too; only both bundles on one machine can say which it was.
#
# Usage: tests/bench/step_bench_ab.sh A.tar.xz B.tar.xz [ROUNDS]
#   ROUNDS (default 2) rounds of A then B, each tests/bench/step_bench.py
#   --model gpt134m --device cuda --shards 2 --skip 2 with
#   MODES (default torch,onebit_adam), RANKS (default 1), STEPS (default
#   4), MODEL (default gpt134m) and DEVICE (default cuda; MODEL=tiny
#   DEVICE=cpu tries the script anywhere). Build each bundle with
#   deploy/bundle.sh at its revision (xz: about 20 MB each, so both fit in
#   one device call's 64 MiB).
# Writes $OUT/ab.jsonl (default /tmp/step-bench-ab): each JSON line of
# step_bench.py with "bundle" (A or B) and "round" added, then prints the
# median step of each bundle, mode and phase over the rounds and B / A.
set -uo pipefail
usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  --help | -h) usage; exit 0 ;;
esac
if [ $# -lt 2 ]; then
  usage >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rounds="${3:-2}"
out="${OUT:-/tmp/step-bench-ab}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for tag in A B; do
  bundle="$1"
  shift
  mkdir -p "$work/$tag"
  tar -xf "$bundle" -C "$work/$tag" || { echo "step_bench_ab.sh: cannot unpack $bundle" >&2; exit 1; }
done
export PYTHONUNBUFFERED=1
: >"$out/ab.jsonl"
for round in $(seq 1 "$rounds"); do
  for tag in A B; do
    echo "## round $round, bundle $tag"
    PYTHONPATH="$work/$tag/morse/python" MORSE_RUN="$work/$tag/morse/bin/morse-run" \
      timeout 300 python3 "$here/step_bench.py" --model "${MODEL:-gpt134m}" --device "${DEVICE:-cuda}" --shards 2 \
      --skip 2 --steps "${STEPS:-4}" --ranks "${RANKS:-1}" --modes "${MODES:-torch,onebit_adam}" 2>&1 |
      grep '^{' |
      python3 -c 'import json, sys
for line in sys.stdin:
    d = json.loads(line)
    d.update(bundle=sys.argv[1], round=int(sys.argv[2]))
    print(json.dumps(d), flush=True)' "$tag" "$round" | tee -a "$out/ab.jsonl"
  done
done
python3 - "$out/ab.jsonl" <<'EOF'
import collections, json, statistics, sys
steps = collections.defaultdict(list)
for line in open(sys.argv[1]):
    d = json.loads(line)
    steps[(d["mode"], d["phase"], d["bundle"])].append(d["step_ms"])
print(f"{'mode':<14} {'phase':<12} {'A (ms)':>9} {'B (ms)':>9} {'B / A':>6}")
for mode, phase in sorted({(m, p) for m, p, _ in steps}):
    a, b = steps.get((mode, phase, "A")), steps.get((mode, phase, "B"))
    if a and b:
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{mode:<14} {phase:<12} {ma:>9.1f} {mb:>9.1f} {mb / ma:>6.2f}")
EOF
