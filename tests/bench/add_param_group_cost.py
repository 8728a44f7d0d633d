"""What add_param_group costs (docs/python.md, "Adding a parameter group"):
one call against the job's own steps, timed in the same run.

  build/bin/morse-run --servers 2 --workers 2 -- python3 tests/bench/add_param_group_cost.py [D] [from_start] [lamb] [split]

A model of D float32 parameters (default 4M) in two tensors, the first
3/4 trained from the start with Adam, the last 1/4 added as a group after
5 steps; 10 more steps follow. Each rank prints its median step before and
after, the call, and the call over the median step: the call pulls the
model's state from the shards on rank 0, lays the job out anew and
restores it, so it should cost a few steps' worth of traffic, not more.
With from_start the group is there from the first step (the same model
laid out once): its median step is what the steps after the call should
take. With lamb the optimizer is OneBitLamb (freeze_step 100, so every
step here is its warmup), whose call also grows each layer's coefficient
state. With split the first 3/4 are two tensors of 3/8 each, so that a
node of two ranks under `--node-aggregation=sharded` has a slice for each
rank from the start (the call cuts the slices anew over three tensors and
moves the state of those that change slice):

  build/bin/morse-run --servers 2 --workers 2 --node-aggregation=sharded -- python3 tests/bench/add_param_group_cost.py 4194304 split"""
import os
import statistics
import sys
import time

import torch

import morse.torch


def main():
    dim = int(sys.argv[1]) if len(sys.argv) > 1 else 4 << 20
    rank = int(os.environ["MORSE_RANK"])
    torch.manual_seed(0)
    first = torch.nn.Parameter(torch.randn(dim - dim // 4) * 0.01)
    added = torch.nn.Parameter(torch.randn(dim // 4) * 0.01)
    trained = [first]
    if "split" in sys.argv[2:]:
        half = first.numel() // 2
        trained = [torch.nn.Parameter(first.detach()[:half].clone()),
                   torch.nn.Parameter(first.detach()[half:].clone())]
    from_start = "from_start" in sys.argv[2:]
    groups = [{"params": trained}]
    if from_start:
        groups.append({"params": [added], "lr": 2e-3})
    lamb = "lamb" in sys.argv[2:]
    opt = (morse.torch.OneBitLamb(groups, lr=1e-3, freeze_step=100) if lamb
           else morse.torch.Adam(groups, lr=1e-3))

    def steps(n, params):
        took = []
        for step in range(n):
            start = time.perf_counter()
            opt.zero_grad()
            loss = sum((p * (1 + rank + step)).square().mean() for p in params)
            loss.backward()
            opt.step()
            took.append(time.perf_counter() - start)
        return statistics.median(took)

    if from_start:
        took = steps(10, trained + [added])
        print(f"rank {rank}: {type(opt).__name__} D={dim}, both groups from the start: "
              f"median step {took * 1e3:.1f} ms")
        return
    before = steps(5, trained)
    start = time.perf_counter()
    opt.add_param_group({"params": [added], "lr": 2e-3})
    call = time.perf_counter() - start
    after = steps(10, trained + [added])
    print(f"rank {rank}: {type(opt).__name__} D={dim}: median step {before * 1e3:.1f} ms before, "
          f"{after * 1e3:.1f} ms after; add_param_group {call * 1e3:.1f} ms = "
          f"{call / after:.2f} steps")


if __name__ == "__main__":
    main()
