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
takes them: design.md 2.7). And a resume from the middle of a local
interval (plain and groups): each rank's state_dict() saved at step 18
(2 steps after the sync of step 16) restores, in a fresh job with fresh
shards and every rank loading rank 0's model as Trainer does, a run that
goes on bit-identically, rank by rank, to the one that never stopped; a
rank's state on another rank, and one saved without its interval (by an
earlier version), are refused. And weights changed inside local
intervals (`edits`): swapped out and back on every rank (an EMA helper's
evaluation), and scaled by rank 1 alone, its own x_i: every rank the
simulator's bits, fed rank 1's changes; and changed on every rank right
after a sync, before a local interval (its anchor, the job's)."""
import glob
import json
import os
import sys
import tempfile
import warnings

import torch

from harness import (check, check_ranks_match_simulator, clip_each_step, clip_in_job,  # noqa: E402
                     check_one_cycle_hypers, morse_run, one_cycle, train_recorded)

STEPS = 18
MORE = 6  # steps after the save inside an interval: a sync at 20 and 24
RANKS = 3
SCHEDULE = dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)


CLIP = 0.05


def worker(out, mode):
    import morse.torch
    mode, _, resumed = mode.partition("@")
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
    if mode == "edits":
        on_step = edits_inside_intervals(opt, model, out, rank)
    clip = clip_each_step(model, CLIP) if mode == "groups" else None
    recorded = dict(features=10, classes=4, on_gradient=clip, on_step=on_step)
    if resumed:
        go_on_resumed(opt, model, schedule if mode == "groups" else None, out, rank, recorded)
        return
    train_recorded(opt, model, out, STEPS, record_hypers=mode == "one_cycle", **recorded)
    if mode == "one_cycle":
        check_moved()
    if mode in ("one_cycle", "edits"):
        return
    # The last step (s = 18, interval 4) is local: the shards hold the sync
    # of s = 16 and each rank its own state since, which its state_dict()
    # holds (rank 0's also the shards' part at the sync); the run goes on
    # to compare with the resumed one.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = opt.state_dict()
    check(not caught, f"rank {rank} warned {[str(w.message) for w in caught]}")
    inner = state["state"]
    check(inner.get("inside_interval") == [18, 16] and inner["interval_last_local_step"] == 17
          and ("server_error" in inner) == (rank == 0)
          and ("interval_shards_exp_avg" in inner) == (rank == 0),
          f"rank {rank}: the state inside the interval: {sorted(inner)}")
    torch.save({"model": model.state_dict(), "opt": state,
                "schedule": schedule.state_dict() if mode == "groups" else None},
               f"{out}/saved-{rank}.pt")
    train_recorded(opt, model, out, STEPS + MORE, first=STEPS, name="after", **recorded)


def edits_inside_intervals(opt, model, out, rank):
    """train_recorded's on_step: after each step inside a local interval
    every rank swaps other weights in and back (an EMA helper's evaluation:
    the same bits), and after every other one rank 1 alone scales its
    parameters by 0.9 (its own x_i: x-<step>-1.npy for the simulator);
    right after some steps that exchanged (a sync, most before a local
    step) every rank scales them by 0.95 (the job's: x-<step>.npy)."""
    import numpy as np

    def on_step(step):
        if rank == 0 and os.path.exists(f"{out}/x-{step}.npy"):
            # Whether the step after the job's change was local (the change
            # an interval's anchor) or exchanged.
            local = opt._session.exchanged_step != opt.step_index
            open(f"{out}/{'local' if local else 'exchanged'}-after-{step}", "w").close()
        if opt._session.exchanged_step == opt.step_index:
            # Right after a step that exchanged, past the freeze: every
            # rank scales its parameters alike, the next interval's
            # anchor, the job's (x-<step>.npy).
            if step >= SCHEDULE["var_freeze_step"]:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.95)
                if rank == 0:
                    np.save(f"{out}/x-{step + 1}.npy", opt._flat.cpu().numpy())
            return
        with torch.no_grad():
            kept = [p.detach().clone() for p in model.parameters()]
            for p in model.parameters():
                p.zero_()
            for p, k in zip(model.parameters(), kept):
                p.copy_(k)
            if rank == 1 and step % 2 == 0:
                for p in model.parameters():
                    p.mul_(0.9)
                np.save(f"{out}/x-{step + 1}-{rank}.npy", opt._flat.cpu().numpy())
    return on_step


def go_on_resumed(opt, model, schedule, out, rank, recorded):
    """A fresh job from the states saved at step 18 (inside an interval):
    every rank loads rank 0's model (as Trainer does) and its own
    optimizer state, then trains the steps after it."""
    saved = torch.load(f"{out}/saved-{rank}.pt")
    model.load_state_dict(torch.load(f"{out}/saved-0.pt")["model"])
    other = torch.load(f"{out}/saved-{(rank + 1) % RANKS}.pt")["opt"]
    try:
        opt.load_state_dict(other)
        check(False, "another rank's state inside an interval was accepted")
    except ValueError as e:
        check("parameters inside a local interval" in str(e), f"unclear refusal: {e}")
    old = {"state": {k: v for k, v in saved["opt"]["state"].items()
                     if not k.startswith("interval_")},
           "param_groups": saved["opt"]["param_groups"]}
    try:  # as an earlier version saved it: without the interval
        opt.load_state_dict(old)
        check(False, "a state of the middle of a local interval without it was loaded")
    except ValueError as e:
        check("cannot be resumed" in str(e) and "a multiple of 4, local_step_clipper" in str(e)
              and "start a fresh optimizer" in str(e), f"unclear refusal: {e}")
    opt.load_state_dict(saved["opt"])
    if schedule is not None:
        schedule.load_state_dict(saved["schedule"])
    check(opt.step_index == STEPS, f"resumed at step {opt.step_index}")
    train_recorded(opt, model, out, STEPS + MORE, first=STEPS, name="resumed", **recorded)


def check_resumed(out, mode):
    """The run resumed from step 18 (inside an interval) in a fresh job
    equals, rank by rank, the one that went on."""
    code, log = morse_run(__file__, RANKS, 2, out, f"{mode}@resumed")
    print(log)
    check(code == 0, f"the resumed job failed ({mode})")
    after = [json.load(open(f"{out}/after-{rank}.json")) for rank in range(RANKS)]
    for rank in range(RANKS):
        resumed = json.load(open(f"{out}/resumed-{rank}.json"))
        check(resumed == after[rank], f"rank {rank} ({mode}): resumed {resumed}, went on {after[rank]}")
    check(len({a[0] for a in after}) == RANKS, f"the ranks' first steps after the save agree: "
          f"{[a[0] for a in after]} (the interval's state would not be tested)")
    print(f"PASS: resumed at step {STEPS}, inside a local interval, each of {RANKS} ranks "
          f"bit-identical to the run that went on for {MORE} steps ({mode})")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-2], sys.argv[-1])
        sys.exit(0)
    for mode in ("plain", "groups", "one_cycle", "edits"):
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
        if mode in ("plain", "groups"):
            check_resumed(out, mode)
        if mode == "edits":
            changed = len(glob.glob(f"{out}/x-*-1.npy"))
            check(changed >= 3, f"rank 1 changed its own parameters inside intervals {changed} times")
            anchors = len(glob.glob(f"{out}/local-after-*"))
            check(anchors >= 2, f"the job's weights changed before a local interval {anchors} times")
        together = check_ranks_match_simulator(out, RANKS, STEPS, ranks_may_differ=True)
        apart = STEPS - together
        check(apart >= 4, f"only {apart} steps where the ranks stepped on their own")
        check(together >= 8, f"only {together} steps where the ranks agreed")
        print(f"PASS: {STEPS} steps, {RANKS} ranks each bit-identical to the simulator's "
              f"({mode}); {apart} local steps apart, {together} steps equal")
        if mode == "edits":
            print("PASS: weights swapped and restored on every rank inside local intervals, "
                  "changed by rank 1 alone there (its own x_i), and on every rank right after "
                  f"a sync ({anchors} times before a local interval: its anchor), each rank the "
                  "simulator's bits")

    print("PASS: under OneCycleLR each group's lr, betas and eps followed step by step")
