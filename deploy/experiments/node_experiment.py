#!/usr/bin/python3
"""One push per node on emulated nodes (morse-run --node-aggregation; issue 37).

    sudo deploy/experiments/node_experiment.py [--nodes 2] [--local 2] [--dim 4000000]
                                               [--rate 1] [--steps 12] [--pairs 1] [--batch 32]
                                               [--no-overlap] [--layouts flat,leader,sharded] [--out DIR]

A VirtualCluster (experiment.py: network namespaces on a bridge, each host's
link shaped to --rate Gbit/s both ways, addresses from 198.18.0.0/15, all
removed on exit) of 1 + --nodes hosts: host 0 runs 2 morse-server shards,
hosts 1..M are the nodes, each running one `morse-run --nnodes M
--node-rank i --nproc-per-node L --rdzv ... --servers ...` of L ranks of
tests/bench/node_aggregation.py's OneBitAdam MLP (about --dim parameters,
measured past its freeze). Each layout runs once: flat (every rank a Morse
worker), --node-aggregation (the leader steps for the node) and
--node-aggregation=sharded (local rank k steps slice k, each slice a job
with its own 2 shards on host 0). Prints, per layout: the bytes node 1's
link sent per step (from its interface counters),
that over one worker's payload (the flat run's), the median step, node
1's Morse step (a leader's, or its slowest slice owner's: encode, the
exchange and apply; flat, a rank's wait at step() for what backward()
pushed), and the DESIGN 7 floor of
the exchange for the shards' worker count (the first 3 steps, the fp32
warmup among them, are left out of all of it). Writes DIR/results.json if
--out is given. Needs root."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from experiment import VirtualCluster, floor_seconds, stop, wait_all  # noqa: E402


def run_layout(vc, args, aggregate, work, flat_payload=None):
    """One layout: aggregate None (flat), "leader" or "sharded"."""
    nodes, local = args.nodes, args.local
    workers = nodes if aggregate else nodes * local
    jobs = local if aggregate == "sharded" else 1  # each slice its own 2 shards
    config = os.path.join(work, f"job-{workers}.textproto")
    with open(config, "w") as f:
        f.write(f"workers: {workers}\nshards: 2\nexternal {{}}\n"
                "timeouts { connect_seconds: 60 step_seconds: 300 rpc_seconds: 600 }\n")
    out = tempfile.mkdtemp(prefix="node-experiment-", dir=work)
    logs = [open(os.path.join(out, f"server{s}.log"), "w") for s in range(2 * jobs)]
    servers = [vc.popen(0, [f"{args.build}/server/morse-server", "--config", config, "--shard", str(s % 2),
                            "--insecure", "--listen", f"{vc.address(0)}:{7000 + s}"], logs[s])
               for s in range(2 * jobs)]
    procs = []
    try:
        time.sleep(0.5)
        addresses = ",".join(f"{vc.address(0)}:{7000 + s}" for s in range(2 * jobs))
        for n in reversed(range(nodes)):
            log = open(os.path.join(out, f"node{n}.log"), "w")
            argv = [f"PYTHONPATH={args.build}/python",
                    # node_aggregation.py's worker: dim, steps, pairs, overlap, batch.
                    f"MORSE_BENCH_ARGS={args.dim} {args.steps} {args.pairs} {int(not args.no_overlap)} "
                    f"{args.batch}",
                    f"{args.build}/bin/morse-run", "--nnodes", str(nodes), "--node-rank", str(n),
                    "--nproc-per-node", str(local), "--servers", addresses, "--config", config,
                    "--insecure"]
            if nodes > 1:
                argv += ["--rdzv", f"{vc.address(1)}:29400"]
            if aggregate:
                argv.append(f"--node-aggregation={aggregate}")
            argv += ["--", sys.executable, os.path.join(ROOT, "tests", "bench", "node_aggregation.py"),
                     "--worker", out, "bench"]
            procs.append(vc.popen(1 + n, argv, log))
            time.sleep(0.3)
        # From the end of the untimed steps (the fp32 warmup's and the
        # start's traffic are not a 1-bit step's).
        link, first = (2, local) if nodes > 1 else (1, 0)
        deadline = time.time() + 900
        while not os.path.exists(f"{out}/measuring-{first}") and time.time() < deadline:
            if any(proc.poll() not in (None, 0) for proc in procs):
                break
            time.sleep(0.01)
        before = vc.tx_rx(link)
        codes = wait_all(procs, 900)
        after = vc.tx_rx(link)
    finally:
        stop(procs + servers)
    if any(c != 0 for c in codes):
        tail = open(os.path.join(out, "node0.log")).read()[-1500:]
        raise SystemExit(f"{aggregate or 'flat'} run failed ({codes}):\n{tail}")
    ranks = [json.load(open(f"{out}/rank-{r}.json")) for r in range(nodes * local)]
    # One worker's payload per step: of the whole model (a sharded rank's
    # is its slice's; the flat run's is the reference).
    payload = flat_payload or max(statistics.median(r["up"]) for r in ranks)
    # Node 1's link (node 0's when alone): its upload over the timed steps:
    # the pushes and their framing.
    sent = (after[0] - before[0]) / (args.steps - 3)
    step = statistics.median(t for r in ranks for t in r["times"])
    floor = floor_seconds(payload, workers, 2, args.rate)
    # The exchange of node 1 (node 0 alone) per step: its Morse step (a
    # leader's, or the slowest of its slice owners', which run side by
    # side), encode, the link and apply; flat, the rank's wait at step().
    node = 1 if nodes > 1 else 0
    timed = [r["exchange"] for r in ranks[node * local:(node + 1) * local] if r["exchange"]]
    slowest = [max(s) for s in zip(*timed)]  # (seconds, encode, apply) of the slowest owner
    exchange = statistics.median(s[0] for s in slowest)
    encode = statistics.median(s[1] for s in slowest)
    apply = statistics.median(s[2] for s in slowest)
    return {"layout": f"node aggregation={aggregate}" if aggregate else "flat", "workers": workers,
            "link_bytes_per_step": sent, "one_worker_payload": payload, "ratio": sent / payload,
            "step_median_s": step, "floor_s": floor, "exchange_median_s": exchange,
            "encode_median_s": encode, "apply_median_s": apply,
            "params": ranks[0]["params"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--local", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--dim", type=int, default=4000000, help="about this many parameters (default 4M)")
    p.add_argument("--rate", type=float, default=1.0, help="each link's rate, Gbit/s (default 1)")
    p.add_argument("--steps", type=int, default=12, help="steps; the first 3 are not timed (default 12)")
    p.add_argument("--pairs", type=int, default=1,
                   help="pairs of layers in the MLP (default 1; the sharded layout's L slices are "
                        "whole parameters: give 2 for L = 4)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank and step (default 32)")
    p.add_argument("--no-overlap", action="store_true",
                   help="optimizers with overlap=False (a node gathers at step(), not during backward())")
    p.add_argument("--layouts", default="flat,leader,sharded",
                   help="which layouts to run, comma-separated (default flat,leader,sharded; the "
                        "bytes ratio is over the flat run's payload where it runs)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"), help="the build folder (default build/)")
    p.add_argument("--out", help="write results.json here")
    args = p.parse_args()
    layouts = args.layouts.split(",")
    if not layouts or any(k not in ("flat", "leader", "sharded") for k in layouts):
        raise SystemExit(f"--layouts {args.layouts!r}: a comma-separated list of flat, leader, sharded")
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="node-experiment-") as work:
        with VirtualCluster(1 + args.nodes, args.rate) as vc:
            for layout in layouts:
                aggregate = None if layout == "flat" else layout
                flat = rows[0]["one_worker_payload"] if rows and rows[0]["layout"] == "flat" else None
                rows.append(run_layout(vc, args, aggregate, work, flat))
    print(f"{args.nodes} nodes x {args.local} ranks, {rows[0]['params']:,} parameters, OneBitAdam "
          f"compression phase, 2 shards on their own host, {args.rate:g} Gbit/s links")
    print(f"{'layout':26} {'workers':>7} {'node link B/step':>16} {'/ one worker':>12} {'step s':>8} "
          f"{'exchange s':>10} {'encode s':>8} {'apply s':>8} {'floor s':>8} {'exchange/floor':>14}")
    for r in rows:
        print(f"{r['layout']:26} {r['workers']:7} {r['link_bytes_per_step']:16,.0f} {r['ratio']:12.3f} "
              f"{r['step_median_s']:8.3f} {r['exchange_median_s']:10.3f} {r['encode_median_s']:8.3f} "
              f"{r['apply_median_s']:8.3f} {r['floor_s']:8.4f} "
              f"{r['exchange_median_s'] / r['floor_s']:14.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json.dump(rows, open(os.path.join(args.out, "results.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
