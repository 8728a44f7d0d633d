#!/usr/bin/env python3
"""Where a step's time goes, from Morse's trace files.

    tests/bench/trace_summary.py TRACE.json [TRACE.json ...] [--skip 2]

Reads the Chrome trace-event files that MORSE_TRACE (ranks; morse-run gives
the shards theirs) or --trace (morse-worker, morse-server) wrote, and prints
for each process and phase the median over steps (after --skip) of the
phase's time per step, summed over partitions and threads, with the median
step span of each rank ("step": from the step's first push to the end of
its optimizer step; the forward pass and the backward work before the
first partition is ready are outside it). Sums over threads can exceed the
step: partitions are encoded and applied in parallel. One JSON line per
process, then a table.
"""
import argparse
import collections
import json
import statistics
import sys


def summarize(path, skip):
    with open(path) as f:
        data = json.load(f)
    process = next((e["args"]["name"] for e in data["traceEvents"]
                    if e.get("ph") == "M" and e.get("name") == "process_name"), path)
    per_step = collections.defaultdict(lambda: collections.defaultdict(float))
    counts = collections.Counter()
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        step = e["args"].get("step", -1)
        per_step[e["name"]][step] += e["dur"] / 1000.0
        counts[e["name"]] += 1
    phases = {}
    for name, steps in per_step.items():
        values = [ms for step, ms in sorted(steps.items()) if step >= skip]
        if values:
            phases[name] = round(statistics.median(values), 3)
    return {"file": path, "process": process, "phases_ms": phases,
            "events": dict(counts), "dropped": data.get("otherData", {}).get("dropped", 0)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="trace files")
    p.add_argument("--skip", type=int, default=2, help="steps left out at the start (default 2)")
    a = p.parse_args()
    rows = [summarize(f, a.skip) for f in a.files]
    for r in rows:
        print(json.dumps(r))
    for r in rows:
        print(f"\n{r['process']} ({r['file']}), median ms per step:")
        for name, ms in sorted(r["phases_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:<22} {ms:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
