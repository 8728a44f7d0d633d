#!/usr/bin/env bash
# The parameter server on loopback with the synthetic workload (default
# D = 25M, N = 2 workers, S = 2 shards): bytes a worker's sockets actually
# sent per step (TCP_INFO counters) over the DESIGN 7 payload size, and the
# step time split into compute (gradient), encode, wire (waiting for replies)
# and decode+update, per phase. Medians over the steps of each phase.
#
# Usage: tests/bench/loopback_bench.sh [DIM] [STEPS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dim="${1:-25000000}"
steps="${2:-20}"
out="$(mktemp -d /tmp/morse-loopback-XXXXXX)"
trap 'rm -rf "$out"' EXIT
cat >"$out/job.textproto" <<CFG
name: "loopback-bench"
workers: 2
shards: 2
synthetic { dim: $dim noise: 0.1 }
optimizer: "onebit_adam"
lr { lr: 0.001 }
steps: $steps
freeze_step: $((steps / 4))
seed: 3
log_every: $steps
CFG
"$root/deploy/local_cluster.sh" "$out/job.textproto" "$out" >/dev/null
/usr/bin/python3 - "$out" "$dim" <<'PY'
import json, statistics, sys
out, dim = sys.argv[1], int(sys.argv[2])
block = 2048
floors = {"warmup": 4 * dim, "compression": dim // 8 + 4 * -(-dim // block)}
rows = [json.loads(l) for l in open(f"{out}/worker0.jsonl")]
print(f"loopback, synthetic D={dim:,}, 2 workers, 2 shards, worker 0, medians per phase")
print(f"{'phase':<12}{'steps':>6}{'payload/floor':>14}{'wire/payload':>13}{'wire/floor':>11}"
      f"{'step ms':>9}{'compute':>9}{'encode':>8}{'wire':>8}{'decode':>8}")
result = {}
for phase, floor in floors.items():
    ph = [r for r in rows[1:] if r["phase"] == phase]  # step 0 includes connection set-up
    if not ph:
        continue
    med = lambda k: statistics.median(r[k] for r in ph)
    line = dict(steps=len(ph), payload_over_floor=med("bytes_up") / floor,
                wire_over_payload=med("wire_up") / med("bytes_up"),
                wire_over_floor=med("wire_up") / floor, step_ms=1e3 * med("step_seconds"),
                compute_ms=1e3 * med("compute_seconds"), encode_ms=1e3 * med("encode_seconds"),
                wire_ms=1e3 * (med("comm_seconds")), decode_ms=1e3 * med("apply_seconds"))
    result[phase] = line
    print(f"{phase:<12}{line['steps']:>6}{line['payload_over_floor']:>14.4f}{line['wire_over_payload']:>13.4f}"
          f"{line['wire_over_floor']:>11.4f}{line['step_ms']:>9.1f}{line['compute_ms']:>9.1f}"
          f"{line['encode_ms']:>8.1f}{line['wire_ms']:>8.1f}{line['decode_ms']:>8.1f}")
print("(wire = waiting for replies, which includes decode+update of replies that land while")
print(" later partitions are still in flight; decode = time spent applying replies, summed over threads)")
print(json.dumps(result))
PY
