#!/usr/bin/env bash
# Runs one Morse job on this machine: the job's S morse-server shards and N
# morse-worker processes, as separate processes on loopback.
#
# Usage: deploy/local_cluster.sh CONFIG OUT_DIR
#
# Servers listen on free ports (port 0) and their logs go to OUT_DIR/server*.log;
# worker 0's progress streams to stdout, every worker's log, metrics
# (OUT_DIR/worker*.jsonl) and final JSON summary (OUT_DIR/summary*.json) land
# in OUT_DIR. Ctrl-C, or any worker failing, stops every process it started;
# the exit code is then non-zero. Set MORSE_BUILD_DIR for a build elsewhere,
# MORSE_COMPUTE_THREADS for every daemon's --compute_threads.
set -euo pipefail
if [ $# -ne 2 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -eq 2 ] && exit 0 || exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${MORSE_BUILD_DIR:-$root/build}"
config="$1"
out="$2"
mkdir -p "$out"
threads=(--compute_threads "${MORSE_COMPUTE_THREADS:-0}")

shape="$("$bin/server/morse-server" --config "$config" --shard 0 --insecure --check_config)" || exit 2
shards="$(sed -n 's/.*shard 0\/\([0-9]*\) of job.*/\1/p' <<<"$shape")"
workers="$(sed -n 's/.*, \([0-9]*\) workers,.*/\1/p' <<<"$shape")"

pids=()
cleanup() {
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'echo "local_cluster: interrupted, stopping every process" >&2; cleanup; exit 130' INT TERM
trap cleanup EXIT

addresses=()
for ((s = 0; s < shards; s++)); do
  log="$out/server$s.log"
  "$bin/server/morse-server" --config "$config" --shard "$s" --listen 127.0.0.1:0 --insecure "${threads[@]}" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    grep -q "listening on" "$log" 2>/dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$log" >&2; exit 3; }
    sleep 0.05
  done
  addresses+=("$(sed -n 's/.*listening on \(.*\)$/\1/p' "$log")")
done
servers="$(IFS=,; echo "${addresses[*]}")"
echo "local_cluster: $shards shard(s) at $servers; starting $workers worker(s)"

worker_pids=()
for ((r = 0; r < workers; r++)); do
  args=(--config "$config" --rank "$r" --servers "$servers" --insecure --metrics "$out/worker$r.jsonl"
        "${threads[@]}")
  if [ "$r" -eq 0 ]; then
    "$bin/worker/morse-worker" "${args[@]}" 2>&1 | tee "$out/worker$r.log" | sed 's/^/  /' &
  else
    "$bin/worker/morse-worker" "${args[@]}" >"$out/worker$r.log" 2>&1 &
  fi
  worker_pids+=($!)
  pids+=($!)
done

status=0
for ((r = 0; r < workers; r++)); do
  if ! wait "${worker_pids[$r]}"; then
    echo "local_cluster: worker $r failed; last lines of its log:" >&2
    tail -n 5 "$out/worker$r.log" >&2
    status=1
    break
  fi
done
if [ $status -eq 0 ]; then
  for ((r = 0; r < workers; r++)); do tail -n 1 "$out/worker$r.log" >"$out/summary$r.json"; done
fi
exit $status
