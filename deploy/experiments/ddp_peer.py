#!/usr/bin/python3
"""A peer for the experiments: PyTorch DDP all-reduce of D fp32 gradients over
gloo, plain, with the fp16 compression hook, or with the PowerSGD hook.

    ddp_peer.py --rank R --world N --master HOST:PORT --dim D --steps K --hook none|fp16|powersgd

Prints one JSON line per step ({"step", "time", "step_seconds"}) on rank 0.
"""
import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import peer


class Flat(torch.nn.Module):
    """D parameters as a (D/1024) x 1024 matrix, so PowerSGD can compress it."""

    def __init__(self, dim, cols=1024):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(max(1, dim // cols), cols))

    def forward(self, noise):
        return (self.w * noise).sum()


def main():
    a = peer.start(__doc__.split("\n\n")[0], lambda p: p.add_argument(
        "--hook", choices=["none", "fp16", "powersgd"], default="none"))
    model = Flat(a.dim)
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    if a.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    noise = torch.randn(model.w.shape, generator=torch.Generator().manual_seed(a.rank))
    for step in range(a.steps):
        start = time.time()
        ddp(noise).backward()  # DDP all-reduces the gradient during backward
        model.w.grad = None
        elapsed = time.time() - start
        if a.rank == 0:
            print(json.dumps({"step": step, "time": time.time(), "step_seconds": elapsed}), flush=True)
    # torch 1.13 aborts ("terminate called without an active exception") while
    # tearing down a process group that ran the PowerSGD hook; the numbers are
    # out, so leave without the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
