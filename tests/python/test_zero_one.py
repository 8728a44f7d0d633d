"""morse.torch.ZeroOneAdam (0/1 Adam, docs/design.md 2.7) across 3 workers
and 2 shards, through every phase: variance steps, 1-bit steps between
them, then local steps (each rank moves on its own) and syncs (all ranks
equal again). After every step each rank's x, m, v must equal the
single-process simulator's state of that rank, fed the gradients the ranks
computed. Even ranks overlap pushes with backward(), odd ranks do not.
DeepSpeed's parameter names are taken; unsupported ones are refused. Then
again with Trainer's two parameter groups (weights with weight decay,
biases without and at twice the lr, both following a LambdaLR schedule of
their own: each group's local steps and interval lr sum are its own) and
the script's torch.nn.utils.clip_grad_norm_ after backward(), which must
give the bits of the optimizer's clip_grad_norm (the simulator runs with
it): the averaged gradient in variance steps, each rank's own in 1-bit and
local steps. And under torch's OneCycleLR, which cycles lr and betas[0]
every step, with two groups of their own beta2 and eps: the simulator
stepped with the lr, betas and eps each step's pushes carried (every phase
takes them: design.md 2.7)."""
import json
import os
import sys
import tempfile
import warnings

import torch

from harness import (check, check_ranks_match_simulator, clip_each_step, clip_in_job,  # noqa: E402
                     check_one_cycle_hypers, morse_run, one_cycle, train_recorded)

STEPS = 18
RANKS = 3
SCHEDULE = dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)


CLIP = 0.05


def worker(out, mode):
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    rank = int(os.environ["MORSE_RANK"])
    for bad in (dict(amsgrad=True), dict(max_grad_norm=1.0), dict(var_update_scaler=0),
                dict(local_step_clipper=2.5)):
        try:
            morse.torch.ZeroOneAdam(model.parameters(), **bad, world_size=RANKS, servers=["unused:1"])
            check(False, f"{bad} was accepted")
        except ValueError as e:
            print(f"refused {bad}: {e}")
    params = model.parameters()
    if mode == "groups":  # Trainer's split: no weight decay for biases
        params = [{"params": [p for p in model.parameters() if p.dim() > 1]},
                  {"params": [p for p in model.parameters() if p.dim() == 1],
                   "weight_decay": 0.0, "lr": 0.02}]
    if mode == "one_cycle":  # each group its own beta2 and eps
        params = [{"params": [p for p in model.parameters() if p.dim() > 1], "betas": (0.9, 0.99)},
                  {"params": [p for p in model.parameters() if p.dim() == 1], "eps": 1e-6}]
    # A DeepSpeed config's params move over as they are (cuda_aware and
    # comm_backend_name are accepted and ignored).
    opt = morse.torch.ZeroOneAdam(params, lr=0.01, weight_decay=0.01, **SCHEDULE,
                                  cuda_aware=False, comm_backend_name="nccl", block_elems=16,
                                  partition_elems=64, overlap=rank % 2 == 0)
    on_step = None
    if mode == "groups":
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, [lambda t: 1.0 - 0.03 * t, lambda t: 1.0 / (1 + t)])
        on_step = lambda step: schedule.step()  # noqa: E731
    if mode == "one_cycle":  # lr up and down, betas[0] the other way
        on_step, check_moved = one_cycle(opt, STEPS)
    clip = clip_each_step(model, CLIP) if mode == "groups" else None
    train_recorded(opt, model, out, STEPS, features=10, classes=4, on_gradient=clip,
                   on_step=on_step, record_hypers=mode == "one_cycle")
    if mode == "one_cycle":
        check_moved()
    # The last step (s = 18, interval 4) is local: the shards hold the sync
    # of s = 16 and each rank its own state since, which no state_dict
    # holds. state_dict() says so (rank 0 warns) instead of failing (a
    # Trainer saving there went on), and load_state_dict refuses what it
    # gave, saying what to do.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = opt.state_dict()
    check(state["state"].get("inside_interval") == [18, 16] and "server_error" not in state["state"],
          f"rank {rank}: the state inside the interval: {state['state'].get('inside_interval')}")
    said = [str(w.message) for w in caught if "local intervals" in str(w.message)]
    check(len(said) == (1 if rank == 0 else 0), f"rank {rank} warned {said}")
    try:
        opt.load_state_dict(state)
        check(False, "a state of the middle of a local interval was loaded")
    except ValueError as e:
        check("cannot be resumed" in str(e) and "a multiple of 4, local_step_clipper" in str(e)
              and "start a fresh optimizer" in str(e),
              f"unclear refusal: {e}")
        print(f"refused to load the state of the middle of an interval: {e}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-2], sys.argv[-1])
        sys.exit(0)
    for mode in ("plain", "groups", "one_cycle"):
        out = tempfile.mkdtemp(prefix="morse-zero-one-")
        code, log = morse_run(__file__, RANKS, 2, out, mode)
        print(log)
        check(code == 0, f"the job failed ({mode})")
        if mode == "groups":  # the simulator clips as clip_grad_norm does
            overrides = json.load(open(f"{out}/job.json"))["overrides"]
            check("groups: 288 groups: 24" in overrides, f"the groups: {overrides}")
            hypers = json.load(open(f"{out}/hypers.json"))
            check(hypers[1][0] != hypers[1][1] and hypers[1][0][0] != hypers[0][0][0],
                  f"the groups' lr and weight_decay: {hypers}")
            clip_in_job(out, CLIP)
        if mode == "one_cycle":  # what the pushes carried: each group's lr, wd, betas, eps
            check_one_cycle_hypers(out, STEPS)
        together = check_ranks_match_simulator(out, RANKS, STEPS, ranks_may_differ=True)
        apart = STEPS - together
        check(apart >= 4, f"only {apart} steps where the ranks stepped on their own")
        check(together >= 8, f"only {together} steps where the ranks agreed")
        print(f"PASS: {STEPS} steps, {RANKS} ranks each bit-identical to the simulator's "
              f"({mode}); {apart} local steps apart, {together} steps equal")
    print("PASS: under OneCycleLR each group's lr, betas and eps followed step by step")
