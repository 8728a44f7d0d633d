"""Module buffers (BatchNorm running statistics) stay equal on every rank,
as DDP's broadcast_buffers: given the model itself, the optimizer sends rank
0's buffers with each step and every rank takes them when the step ends.
Each rank here sees differently distributed data, so without the broadcast
(broadcast_buffers=False) the ranks' statistics differ; with it every rank
holds rank 0's bits after every step, overlap on one rank and off on the
other, across OneBitAdam's freeze. Also: with overlap the parameters do not
change between backward() and step() (the replies are applied at step()),
as with torch.optim."""
import hashlib
import json
import os
import sys
import tempfile
import time

import torch

from harness import check, morse_run

STEPS = 5


def worker(mode):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2))
    args = dict(freeze_step=2, block_elems=16, partition_elems=32, overlap=rank == 0)
    if mode == "on":
        opt = morse.torch.OneBitAdam(model, **args)
    else:
        opt = morse.torch.OneBitAdam(model, broadcast_buffers=False, **args)
    g = torch.Generator().manual_seed(rank)
    digests = []
    for step in range(STEPS):
        x = torch.randn(6, 4, generator=g) * (1 + rank) + 3 * rank  # rank-dependent statistics
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        model(x).square().mean().backward()
        if step > 0 and rank == 0:  # rank 0 overlaps (the first step pushes at step())
            time.sleep(0.5)  # rank 1 pushed at its step(): the replies have come by now
            check(all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
                  f"rank {rank} step {step}: parameters changed between backward() and step()")
        opt.step()
        check(not all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
              "step() changed nothing")
        bn = model[1]
        digests.append(hashlib.sha256(b"".join(
            t.numpy().tobytes() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked))).hexdigest())
        check(int(bn.num_batches_tracked) == step + 1, f"num_batches_tracked {int(bn.num_batches_tracked)}")
    with open(f"{os.environ['BUFFERS_DIR']}/{mode}-{rank}.json", "w") as f:
        json.dump({"digests": digests, "checksum": opt.checksum()}, f)


def main():
    out = tempfile.mkdtemp()
    os.environ["BUFFERS_DIR"] = out
    got = {}
    for mode in ("on", "off"):
        code, text = morse_run(__file__, 2, 1, mode, timeout=180)
        print(text[-2000:])
        check(code == 0, f"the {mode} run failed")
        got[mode] = [json.load(open(f"{out}/{mode}-{r}.json")) for r in range(2)]
        check(got[mode][0]["checksum"] == got[mode][1]["checksum"], f"{mode}: the parameters differ")
    check(got["on"][0]["digests"] == got["on"][1]["digests"],
          "with broadcast_buffers the ranks' BatchNorm statistics differ")
    check(all(a != b for a, b in zip(got["off"][0]["digests"], got["off"][1]["digests"])),
          "without broadcast_buffers the ranks' statistics should differ (the test data must differ)")
    print(f"ok: BatchNorm statistics equal on both ranks after each of {STEPS} steps; different "
          "without the broadcast")
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    main()
