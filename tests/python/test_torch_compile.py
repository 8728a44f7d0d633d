"""torch.compile with every Morse optimizer (issue 41): a model compiled with
torch.compile (inductor, on the CPU) trains under morse-run with 2 ranks,
one overlapping its pushes with backward() and one not, and

- after every step every rank holds what the simulator fed the same
  gradients holds: the compiled backward pass fires the gradient hooks
  Morse's overlap rests on, and the gradients it leaves are the ones pushed;
- the run is bit-identical to the same run uncompiled (eager): the
  compiled model's gradients, and so every step, have the same bits.

torch.compile exists from torch 2.0: under Debian's torch 1.13 this test
is skipped, saying so (its torch2_ twin runs it)."""
import json
import os
import sys
import tempfile

import numpy
import torch

from harness import check, check_ranks_match_simulator, morse_run, train_recorded  # noqa: E402

STEPS = 10
RANKS = 2


def build(name, params, rank):
    import morse.torch
    common = dict(block_elems=16, partition_elems=64, overlap=rank % 2 == 0)
    if name == "Adam":
        return morse.torch.Adam(params, lr=0.01, **common)
    if name == "OneBitAdam":
        return morse.torch.OneBitAdam(params, lr=0.01, freeze_step=3, **common)
    if name == "ZeroOneAdam":
        return morse.torch.ZeroOneAdam(params, lr=0.01, var_freeze_step=3, var_update_scaler=1,
                                       local_step_scaler=2, local_step_clipper=4, **common)
    if name == "OneBitLamb":
        return morse.torch.OneBitLamb(params, lr=0.01, freeze_step=3, **common)
    raise ValueError(name)


def worker(out, name, mode):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    rank = int(os.environ["MORSE_RANK"])
    opt = build(name, model.parameters(), rank)
    # OptimizedModule's parameters() are the original module's.
    run = model if mode == "eager" else torch.compile(model, backend=mode)
    train_recorded(opt, run, out, STEPS, features=10, classes=4)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(*sys.argv[-3:])
        sys.exit(0)
    if not hasattr(torch, "compile"):
        print(f"SKIPPED: torch {torch.__version__} has no torch.compile (torch 2.0 and later; "
              "the torch2_torch_compile_* tests run this)")
        sys.exit(77)
    # ctest runs each optimizer as a part of its own (torch2_torch_compile_Adam, ...).
    names = ("Adam", "OneBitAdam", "ZeroOneAdam", "OneBitLamb")
    unknown = [n for n in sys.argv[1:] if n not in names]
    if unknown:
        sys.exit(f"test_torch_compile.py: no part {', '.join(unknown)}; the parts are "
                 f"{', '.join(names)} (none: all)")
    for name in sys.argv[1:] or names:
        runs, grads = {}, {}
        for mode in ("eager", "aot_eager", "inductor"):
            out = tempfile.mkdtemp(prefix=f"morse-compile-{name}-{mode}-")
            code, log = morse_run(__file__, RANKS, 1, out, name, mode, timeout=400)
            if code != 0:
                print(log)
            check(code == 0, f"{name} {mode}: the job failed")
            runs[mode] = [json.load(open(f"{out}/checksums-{r}.json")) for r in range(RANKS)]
            grads[mode] = {(r, s): torch.from_numpy(numpy.load(f"{out}/grad-{r}-{s}.npy"))
                           for r in range(RANKS) for s in range(STEPS)}
            check_ranks_match_simulator(out, RANKS, STEPS, ranks_may_differ=name == "ZeroOneAdam")
        check(runs["aot_eager"] == runs["eager"], f"{name}: torch.compile(backend='aot_eager') and eager differ")
        worst = max(((grads["inductor"][k] - grads["eager"][k]).abs().max() /
                     grads["eager"][k].abs().max()).item() for k in grads["eager"])
        same = runs["inductor"] == runs["eager"]
        print(f"{name}: inductor's gradients {'equal' if worst == 0 else 'differ from'} eager's "
              f"(largest difference {worst:.2e} of the largest element); runs "
              f"{'bit-identical' if same else 'differ in the last bits'}")
        check(worst < 1e-5, f"{name}: inductor's gradients are far from eager's ({worst:.2e})")
        print(f"PASS: {name}: torch.compile (aot_eager) bit-identical to eager, (inductor) to the "
              f"simulator fed its gradients, {STEPS} steps, 2 ranks (overlap on one)")
