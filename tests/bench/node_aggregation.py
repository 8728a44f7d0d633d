#!/usr/bin/env python3
"""Node aggregation (leader and sharded) against one worker per rank, on
this machine.

    tests/bench/node_aggregation.py [--nodes 2] [--local 2] [--dim 1000000] [--steps 12] [--pairs 1]
        [--batch 32] [--no-overlap]

Runs the same OneBitAdam job (an MLP of about --dim parameters in --pairs
pairs of layers 128 -> h -> 128, past its
freeze, so the pushes are 1-bit) as --nodes morse-run invocations of --local
ranks each (as on --nodes hosts), flat (every rank a Morse worker), with
--node-aggregation (the leader steps for the node) and with
--node-aggregation=sharded (local rank k steps slice k), and prints per
node and step: the payload bytes the node's ranks push to the shards, that
over one worker's payload, the optimizer state each rank holds per
parameter of the model (m, v, the error buffer: 12 bytes where one rank
holds it all), and the median step time. Everything runs on one host over loopback, so the
times say what aggregation costs in CPU (the gather and broadcast inside the
node), not what it saves on a real link; the bytes are what a node's link
would carry. --no-overlap builds the optimizers with overlap=False (a
node then gathers at step(), not during backward())."""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def worker(out, dim, steps, pairs, overlap, batch):
    import torch
    import morse.torch
    rank = int(os.environ["RANK"])
    hidden = max(8, dim // (256 * pairs))
    torch.manual_seed(1)
    # More pairs give more parameters of similar size for a sharded node's
    # slices (whole parameters) to balance.
    model = torch.nn.Sequential(*[layer for _ in range(pairs) for layer in (
        torch.nn.Linear(128, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 128))])
    opt = morse.torch.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2, overlap=bool(overlap))
    times, up, exchange = [], [], []
    if opt._session is not None:
        # The Morse step of this rank's worker (a leader's, a slice owner's;
        # with node aggregation the pushes leave in it): encode, exchange
        # and apply, what node_experiment.py sets against the link's floor.
        morse_step = opt._worker_step

        def timed_step():
            start = time.perf_counter()
            morse_step()
            exchange.append((time.perf_counter() - start, opt.last_step.get("encode_seconds", 0.0),
                             opt.last_step.get("apply_seconds", 0.0)))
        opt._worker_step = timed_step
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(batch, 128, generator=g)
        start = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
        up.append(opt.last_step.get("bytes_up", 0))
        if step == 2:  # the untimed steps are over (node_experiment.py reads the links from here)
            open(f"{out}/measuring-{rank}", "w").close()
    params = sum(p.numel() for p in model.parameters())
    state = 0.0
    if opt._session is not None:  # m, v and the error buffer, float32: of its slice where sharded
        held = opt.state_dict()["state"]
        state = 4 * sum(held[k].numel() for k in ("exp_avg", "exp_avg_sq", "worker_error")) / params
    json.dump({"times": times[3:], "up": up[3:], "params": params, "state": state,
               "exchange": exchange[3:]},
              open(f"{out}/rank-{rank}.json", "w"))


def run(nodes, local, dim, steps, pairs, aggregate, overlap, batch):
    from harness import nodes as start_nodes
    out = tempfile.mkdtemp(prefix="morse-bench-aggregation-")
    extra = ("--servers", "2") + ((f"--node-aggregation={aggregate}",) if aggregate else ())
    os.environ["MORSE_BENCH_ARGS"] = f"{dim} {steps} {pairs} {int(overlap)} {batch}"
    results = start_nodes(__file__, nodes, local, out, "bench", extra=extra, timeout=600)
    for node, (code, text) in enumerate(results):
        if code != 0:
            print(text[-3000:])
            raise SystemExit(f"node {node} failed")
    ranks = [json.load(open(f"{out}/rank-{r}.json")) for r in range(nodes * local)]
    per_node = [sum(statistics.median(r["up"]) for r in ranks[n * local:(n + 1) * local])
                for n in range(nodes)]
    return ranks, per_node


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="morse-run invocations (default 2)")
    parser.add_argument("--local", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--dim", type=int, default=1000000, help="about this many parameters (default 1M)")
    parser.add_argument("--steps", type=int, default=12, help="steps; the first 3 are not timed (default 12)")
    parser.add_argument("--pairs", type=int, default=1,
                        help="pairs of layers (default 1: 4 parameters); a sharded node's L slices "
                             "need at least L parameters, and balance better with more")
    parser.add_argument("--batch", type=int, default=32,
                        help="examples per rank and step (default 32): more make backward() longer")
    parser.add_argument("--no-overlap", action="store_true",
                        help="overlap=False: the pushes (flat) and the node's gather wait for step()")
    a = parser.parse_args()
    os.environ.setdefault("MORSE_RUN", os.path.join(HERE, "..", "..", "build", "bin", "morse-run"))
    rows = []
    one = None
    for aggregate in (None, "leader", "sharded"):
        ranks, per_node = run(a.nodes, a.local, a.dim, a.steps, a.pairs, aggregate, not a.no_overlap,
                              a.batch)
        if one is None:
            one = max(statistics.median(r["up"]) for r in ranks)  # one worker's payload (flat)
        rows.append((f"--node-aggregation={aggregate}" if aggregate else "flat (a worker per rank)",
                     statistics.median(per_node), statistics.median(per_node) / one,
                     max(r["state"] for r in ranks), min(r["state"] for r in ranks),
                     statistics.median(t for r in ranks for t in r["times"]) * 1e3, ranks[0]["params"]))
    print(f"{a.nodes} nodes x {a.local} ranks, OneBitAdam compression phase, "
          f"{rows[0][6]:,} parameters in {4 * a.pairs} tensors, 2 shards (per slice where "
          f"sharded), loopback, overlap {'off' if a.no_overlap else 'on'}")
    print(f"{'layout':29} {'bytes up/node/step':>18} {'/ one worker':>12} {'state B/param (max, min rank)':>30} "
          f"{'step ms':>8}")
    for name, up, ratio, most, least, ms, _ in rows:
        print(f"{name:29} {up:18,.0f} {ratio:12.2f} {f'{most:.2f}, {least:.2f}':>30} {ms:8.1f}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        out = sys.argv[sys.argv.index("--worker") + 1]
        worker(out, *(int(v) for v in os.environ["MORSE_BENCH_ARGS"].split()))
        sys.exit(0)
    main()
