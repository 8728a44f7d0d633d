#!/usr/bin/env bash
# The main job. Installs what Morse needs (Debian packages), builds it,
# writes the UCI digits data set, and trains an MLP on it twice on a local
# cluster of 2 morse-server shards and 4 morse-worker processes over
# loopback TCP: fp32 Adam, then 1-bit Adam. Prints a side-by-side table and a
# final JSON line.
#
# Usage: deploy/quickstart.sh [CONFIG...]
#   With config files, runs those jobs instead of the two defaults
#   (deploy/configs/digits_adam.textproto, digits_onebit_adam.textproto).
#   Results go to out/quickstart/<job>/. Ctrl-C stops every process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$root"
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(deploy/configs/digits_adam.textproto deploy/configs/digits_onebit_adam.textproto)
for c in "${configs[@]}"; do [ -f "$c" ] || { echo "quickstart: no config file '$c'" >&2; exit 2; }; done

"$root/deploy/install-deps.sh"
echo "== building (the first build takes several minutes)"
"$root/deploy/build.sh" >"$root/out-build.log" 2>&1 || { tail -n 30 "$root/out-build.log" >&2; exit 1; }
rm -f "$root/out-build.log"
[ -f data/digits/test.csv ] || /usr/bin/python3 deploy/data/digits.py data/digits

results=()
for config in "${configs[@]}"; do
  name="$(basename "$config" .textproto)"
  name="${name%.json}"
  out="out/quickstart/$name"
  rm -rf "$out"
  echo "== $name ($config)"
  start=$(date +%s.%N)
  deploy/local_cluster.sh "$config" "$out"
  end=$(date +%s.%N)
  results+=("$name|$config|$out|$start|$end")
done

/usr/bin/python3 - "${results[@]}" <<'PY'
import json, sys
rows = []
for arg in sys.argv[1:]:
    name, config, out, start, end = arg.split("|")
    s = json.load(open(f"{out}/summary0.json"))
    per_step = s["compressed_up_bytes_per_step"] or s["warmup_up_bytes_per_step"]
    rows.append(dict(job=name, test_accuracy=s.get("test_accuracy"), final_loss=s["final_loss"],
                     push_bytes_per_step=per_step,
                     warmup_push_bytes_per_step=s["warmup_up_bytes_per_step"],
                     total_bytes=s["payload_up_bytes"] + s["payload_down_bytes"],
                     wire_bytes=s["wire_sent_bytes"] + s["wire_received_bytes"],
                     wall_seconds=float(end) - float(start), steps=s["steps"]))
base = max(r["push_bytes_per_step"] for r in rows)
print()
print(f"{'job':<22}{'test acc':>9}{'final loss':>12}{'push B/step':>13}{'ratio':>7}"
      f"{'total MB':>10}{'wire MB':>9}{'wall s':>8}")
for r in rows:
    r["compression_ratio"] = round(base / r["push_bytes_per_step"], 2)
    acc = "-" if r["test_accuracy"] is None else f"{100 * r['test_accuracy']:.2f}%"
    print(f"{r['job']:<22}{acc:>9}{r['final_loss']:>12.4f}{r['push_bytes_per_step']:>13,}"
          f"{r['compression_ratio']:>6.1f}x{r['total_bytes'] / 1e6:>10.2f}{r['wire_bytes'] / 1e6:>9.2f}"
          f"{r['wall_seconds']:>8.1f}")
print("(push B/step: what each worker sends per step; for 1-bit Adam, in the compression phase.")
print(" total/wire MB: payload and TCP bytes one worker moved up and down over the whole run.)")
print(json.dumps({"jobs": rows}))
PY
