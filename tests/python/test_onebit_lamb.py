"""morse.torch.OneBitLamb (1-bit LAMB, docs/design.md 2.8) across 3 workers
and 2 shards, through the freeze. Each parameter tensor is a layer with
its own coefficient; the model's tensors cross partitions and shards. After
every step every rank's x, m, v must equal the single-process simulator's
fed the gradients the ranks computed. Even ranks overlap pushes with
backward(), odd ranks do not. DeepSpeed's parameter names are taken;
unsupported ones are refused with clear errors; state_dict() holds 1-bit
LAMB's own state. Then again with the script's
torch.nn.utils.clip_grad_norm_ after backward(), which must give the bits
of clip_grad_norm (the simulator runs with it): the averaged gradient in
the warmup (rank 0's commit carries the norm with the layers' values),
each rank's own after the freeze. Then with Hugging Face Trainer's
parameter groups (weights with weight decay, biases without and here at
twice the lr, each group on its own LambdaLR) and the clip: each group's
padding is a layer of its own, and the simulator steps with each step's
group values. And under torch's OneCycleLR, which cycles lr and betas[0]
every step, with the same two groups, each with its own beta2 or eps: the
simulator stepped with the lr, betas and eps each step's pushes carried
(the warmup's moments, the local momentum, the fresh variance and the
frozen correction take them: design.md 2.8)."""
import json
import os
import sys
import tempfile

import torch

from harness import (check, check_ranks_match_simulator, clip_each_step, clip_in_job,  # noqa: E402
                     check_one_cycle_hypers, morse_run, one_cycle, train_recorded)

STEPS = 14
RANKS = 3
CLIP = 0.05


def worker(out, mode):
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    rank = int(os.environ["MORSE_RANK"])
    for bad in (dict(amsgrad=True), dict(max_grad_norm=1.0), dict(freeze_step=0),
                dict(min_coeff=0.0), dict(factor_min=5.0), dict(coeff_beta=1.0),
                dict(factor_threshold=float("nan"))):
        try:
            morse.torch.OneBitLamb(model.parameters(), **bad, world_size=RANKS, servers=["unused:1"])
            check(False, f"{bad} was accepted")
        except ValueError as e:
            print(f"refused {bad}: {e}")
    params = model.parameters()
    if mode == "groups":  # Trainer's split: no weight decay for biases
        params = [{"params": [p for p in model.parameters() if p.dim() > 1]},
                  {"params": [p for p in model.parameters() if p.dim() == 1],
                   "weight_decay": 0.0, "lr": 0.02}]
    if mode == "one_cycle":  # each group its own beta2 or eps
        params = [{"params": [p for p in model.parameters() if p.dim() > 1], "betas": (0.9, 0.99)},
                  {"params": [p for p in model.parameters() if p.dim() == 1], "eps": 1e-6}]
    # A DeepSpeed OnebitLamb config's params move over as they are.
    opt = morse.torch.OneBitLamb(params, lr=0.01, freeze_step=6, weight_decay=0.01,
                                 max_coeff=0.3, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0,
                                 factor_min=0.5, factor_threshold=0.1, cuda_aware=False,
                                 comm_backend_name="nccl", block_elems=16, partition_elems=64,
                                 overlap=rank % 2 == 0)
    on_step = None
    if mode == "groups":
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, [lambda t: 1.0 - 0.05 * t, lambda t: 1.0 / (1 + t)])
        on_step = lambda step: schedule.step()  # noqa: E731
    if mode == "one_cycle":  # lr up and down, betas[0] the other way
        on_step, check_moved = one_cycle(opt, STEPS)
    clip = clip_each_step(model, CLIP) if mode in ("clip", "groups") else None
    train_recorded(opt, model, out, STEPS, features=10, classes=4, on_gradient=clip,
                   on_step=on_step, record_hypers=mode == "one_cycle")
    if mode == "one_cycle":
        check_moved()
    # state_dict() carries 1-bit LAMB's own state (test_resume.py resumes it).
    state = opt.state_dict()["state"]
    layers = len(list(model.parameters())) + (mode in ("groups", "one_cycle"))  # and the padding
    check(state["lamb_layers"].numel() == 2 * layers and state["lamb_commit"].numel() == 3 * layers
          and state["exp_avg_sq_fresh"].numel() == state["exp_avg"].numel(),
          f"OneBitLamb's state_dict: {[(k, v.numel()) for k, v in state.items() if hasattr(v, 'numel')]}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-2], sys.argv[-1])
        sys.exit(0)
    for mode in ("plain", "clip", "groups", "one_cycle"):
        out = tempfile.mkdtemp(prefix="morse-lamb-")
        code, log = morse_run(__file__, RANKS, 2, out, mode)
        print(log)
        check(code == 0, f"the job failed ({mode})")
        overrides = json.load(open(f"{out}/job.json"))["overrides"]
        # The groups: the weights (280 elements, padded to 18 blocks of 16),
        # then the biases.
        layers = ("layers: 200 layers: 80 layers: 8 layers: 20 layers: 4 groups: 288 groups: 24"
                  if mode in ("groups", "one_cycle") else "layers: 200 layers: 20 layers: 80 layers: 4")
        check(layers in overrides, f"the tensors are not the layers: {overrides}")
        if mode == "groups":
            hypers = json.load(open(f"{out}/hypers.json"))
            check(hypers[1][0] != hypers[1][1] and hypers[1][0][0] != hypers[0][0][0],
                  f"the groups' lr and weight_decay: {hypers}")
        if mode in ("clip", "groups"):  # the simulator clips as clip_grad_norm does
            clip_in_job(out, CLIP)
        if mode == "one_cycle":  # what the pushes carried: each group's lr, wd, betas, eps
            check_one_cycle_hypers(out, STEPS)
        check_ranks_match_simulator(out, RANKS, STEPS)
        print(f"PASS: {STEPS} steps across the freeze, {RANKS} ranks bit-identical to the "
              f"simulator ({mode})")
