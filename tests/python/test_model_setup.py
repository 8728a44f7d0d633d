"""How scripts set up a model and its optimizer (issue 41). Weights loaded
into the model after the optimizer was built: before the first step they
become the job's, bit for bit as if they had been loaded before building
it; a rank that loads them when rank 0 does not (or the reverse) fails the
job at step 0 with a message saying to load them on every rank. Weights
changed after a step (a load_state_dict, a WGAN-style clamp_ after every
step), on every rank alike, become the job's: the shard's mirror equals
every rank's model after every step, also in steps that clip; a change on
one rank only stops the job, saying to change them on every rank. Weights
swapped out (an evaluation's) and restored bit for bit after a step train
on unchanged. Several parameter groups with the
same lr and weight_decay train bit for bit as one (when the first group is
whole blocks); a group set apart later trains with its own values from then
on, as the same values in groups built apart. Groups built with their own lr and
weight_decay train apart: one with lr 0 stays bit for bit as loaded while
the other trains with its own betas and eps (beta1 changed every step),
through OneBitAdam's warmup and compression, and the shard's mirror equals
every rank's model after every step. ZeroOneAdam
takes a change before a step that syncs and right after one before a
local interval (the interval's anchor: its sync shows it, and stops the job
where one rank alone changed). Where a GPU is, the first case and a change after a step run on
CUDA tensors too (skipped without one, saying so). `test_model_setup.py
surfaces` leaves out the jobs where one rank alone loads or changes its
weights (its torch2_ twin)."""
import json
import os
import sys
import tempfile
import time

import torch

import morse.run
from harness import check, morse_run  # noqa: E402


def build(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def worker(out, mode):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    pretrained = build(7).state_dict()
    model = build(3 + rank)  # each rank its own start: the job takes rank 0's
    if mode.endswith("_cuda"):
        model = model.cuda()
        mode = mode[:-len("_cuda")]
    if mode in ("before", "swap", "clip", "swap_clip") or mode.startswith("groups"):
        model.load_state_dict(pretrained)
    params = model.parameters()
    if mode.startswith("groups"):  # the layers in groups of their own, alike
        params = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    if mode == "groups_own":  # the first layer frozen by its group's settings
        params[0].update(lr=0.0, weight_decay=0.0)
        params[1].update(betas=(0.85, 0.99), eps=1e-6)  # and the other's own betas and eps
    if mode == "groups_built_apart":  # groups_apart's values, the groups apart when built
        params[1].update(lr=0.02)
    # groups_own: 32-element blocks pad the first group's 112 elements to 128.
    if mode.startswith("late_zero_one"):
        # Steps 0-1 update v, 2 and 3 sync, 4-6 are local, 7 syncs (design.md 2.7).
        opt = morse.torch.ZeroOneAdam(params, lr=0.01, var_freeze_step=2, var_update_scaler=1,
                                      local_step_scaler=1, local_step_clipper=4, block_elems=16,
                                      partition_elems=32)
    else:
        opt = morse.torch.OneBitAdam(params, lr=0.01, weight_decay=0.01, freeze_step=2,
                                     block_elems=32 if mode == "groups_own" else 16,
                                     partition_elems=32)
    # Every rank has its optimizer (a copy of the job's model) before any
    # loads weights: a rank built later would copy the weights rank 0 gave.
    open(f"{out}/built-{rank}", "w").close()
    while not all(os.path.exists(f"{out}/built-{r}") for r in range(2)):
        time.sleep(0.05)
    if mode == "after" or mode.startswith(f"rank{rank}_only"):
        model.load_state_dict(pretrained)
    # rank0_only: rank 0 gives the shards its weights before rank 1 pushes
    # (whose push the shards then refuse); rank0_only_slow: after (rank 0's
    # restore is refused).
    if (mode, rank) in (("rank0_only", 1), ("rank0_only_slow", 0)):
        time.sleep(2)
    error = ""
    checksums = []
    try:
        for step in range(8 if mode.startswith("late_zero_one") else 6):
            if mode == "groups_built_apart":
                opt.param_groups[1]["lr"] = 0.01 if step <= 2 else 0.02
            if mode == "groups_own":  # its beta1 changed every step (OneCycleLR's way)
                opt.param_groups[1]["betas"] = (0.85 - 0.01 * step, 0.99)
            opt.zero_grad()
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 6, generator=g).to(model[0].weight.device)
            model(x).pow(2).mean().backward()
            if mode.endswith("clip"):  # each step waits for rank 0's commit of the norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            checksums.append(opt.checksum())
            if mode.startswith("swap") and step == 2:
                # Other weights swapped in for an evaluation and restored,
                # as EMA helpers do (store, copy_to, restore).
                kept = {k: v.clone() for k, v in model.state_dict().items()}
                model.load_state_dict(build(11).state_dict())
                with torch.no_grad():
                    model(torch.ones(1, 6).to(model[0].weight.device))
                model.load_state_dict(kept)
            if (mode == "late_zero_one" and step in (1, 3)
                    or mode == "late_zero_one_rank0_only" and step == 3 and rank == 0):
                # Before step 2 (a sync): the job's; before step 4 (local):
                # the job's too, the anchor of the interval that step 7 syncs.
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
            if mode in ("late", "late_slow", "late_clip", f"late_rank{rank}_only") and step == 2:
                model.load_state_dict(pretrained)
                if mode == "late_slow" and rank == 1:
                    # Rank 0 gives the shards the new weights first: rank 1
                    # then finds them there and need not wait.
                    time.sleep(2)
            if mode == "late_clamp":  # a WGAN critic's weight clipping
                with torch.no_grad():
                    for p in model.parameters():
                        p.clamp_(-0.1, 0.1)
            if mode == "groups_apart" and step == 2:
                opt.param_groups[1]["lr"] = 0.02
    except (morse.torch.MorseError, ValueError) as e:
        error = str(e)
    bits = [p.detach().cpu().reshape(-1).view(torch.int32).tolist() for p in model.parameters()]
    json.dump({"error": error, "bits": bits, "checksums": checksums},
              open(f"{out}/rank-{rank}.json", "w"))


def run(mode, config=None, servers=2, extra=(), out=None):
    out = out or tempfile.mkdtemp(prefix=f"morse-load-{mode}-")
    code, log = morse_run(__file__, 2, servers, mode, out, config=config, timeout=240, extra=extra)
    print(log[-3000:])
    ranks = [json.load(open(f"{out}/rank-{r}.json")) for r in range(2)]
    return code, ranks


def run_logged(mode, config=None):
    """run() on one shard whose mirror logs its checksum after every step (a
    morse-server wrapper adds --state_log); also returns those checksums."""
    out = tempfile.mkdtemp(prefix=f"morse-load-{mode}-")
    wrapper = os.path.join(out, "morse-server")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nexec "{morse.run._find_server()}" "$@" '
                f'--state_log="{out}/state.jsonl"\n')
    os.chmod(wrapper, 0o755)
    code, ranks = run(mode, config, servers=1, extra=["--server-bin", wrapper], out=out)
    path = f"{out}/state.jsonl"
    mirror = ([json.loads(line)["mirror_checksum"] for line in open(path)]
              if os.path.exists(path) else [])
    return code, ranks, mirror


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1], sys.argv[-2])
        sys.exit(0)
    # `surfaces` (the torch2_ twin, tests/python/CMakeLists.txt): without
    # the jobs where one rank alone loads or changes its weights, which
    # check Morse's comparison of the ranks' digests, not torch's code.
    surfaces = sys.argv[1:] == ["surfaces"]
    code, before = run("before")
    check(code == 0 and not before[0]["error"] and not before[1]["error"],
          f"loading before building failed: {before}")
    code, after = run("after")
    check(code == 0, "the job with weights loaded after building failed")
    for r in range(2):
        check(not after[r]["error"], f"rank {r}: {after[r]['error']}")
        check(after[r]["bits"] == before[r]["bits"],
              f"rank {r}: weights loaded after building the optimizer train differently from "
              "the same weights loaded before")
    check(after[0]["bits"] == after[1]["bits"], "the ranks differ")
    print("ok: weights loaded after building the optimizer, before the first step, train bit for "
          "bit as if loaded before building it (OneBitAdam, 2 ranks, 2 shards, warmup and "
          "compression)")

    if torch.cuda.is_available():
        _, before_cuda = run("before_cuda")
        code, after_cuda = run("after_cuda")
        check(code == 0 and all(not got["error"] for got in before_cuda + after_cuda),
              f"CUDA: {before_cuda[0]['error']} {after_cuda[0]['error']}")
        check([got["bits"] for got in after_cuda] == [got["bits"] for got in before_cuda],
              "CUDA: weights loaded after building the optimizer train differently")
        code, late_cuda, mirror = run_logged("late_cuda")
        check(code == 0 and all(not got["error"] for got in late_cuda)
              and late_cuda[0]["checksums"] == mirror == late_cuda[1]["checksums"],
              f"CUDA: weights changed after a step: {late_cuda[0]['error']} "
              f"{late_cuda[0]['checksums']} vs the shard's {mirror}")
        print("ok: the same on CUDA tensors, and weights changed after a step there")
    else:
        print("SKIPPED part: no GPU, the CUDA tensors' case did not run")

    config = os.path.join(tempfile.mkdtemp(prefix="morse-load-config-"), "job.textproto")
    with open(config, "w") as f:
        f.write("timeouts { connect_seconds: 5 }\n")
    for mode in () if surfaces else ("rank0_only", "rank0_only_slow", "rank1_only"):
        code, ranks = run(mode, config)
        errors = [got["error"] for got in ranks]
        check(all(errors), f"{mode}: every rank must fail: {errors}")
        check(any("load" in e and "every rank" in e for e in errors),
              f"{mode}: no error says to load the weights on every rank: {errors}")
        print(f"ok: {mode}: the job stopped at step 0, saying to load the weights on every rank")

    code, swap = run("swap")
    check(code == 0 and not swap[0]["error"] and not swap[1]["error"],
          f"weights swapped out and restored after a step: {swap[0]['error']} {swap[1]['error']}")
    check([got["bits"] for got in swap] == [got["bits"] for got in before],
          "weights swapped out and restored after a step train differently")
    _, clip = run("clip")
    code, swap_clip = run("swap_clip")
    check(code == 0 and all(not got["error"] for got in clip + swap_clip),
          f"with clip_grad_norm_: {clip[0]['error']} {swap_clip[0]['error']}")
    check([got["bits"] for got in swap_clip] == [got["bits"] for got in clip],
          "with clip_grad_norm_, weights swapped out and restored train differently")
    print("ok: weights swapped out and restored bit for bit after a step train on unchanged, "
          "also in steps that clip (whose shards wait for rank 0's commit)")

    for mode in ("late", "late_slow", "late_clip", "late_clamp"):
        code, late, mirror = run_logged(mode)
        check(code == 0 and not late[0]["error"] and not late[1]["error"],
              f"{mode}: weights changed after a step: {late[0]['error']} {late[1]['error']}")
        check(late[0]["bits"] == late[1]["bits"], f"{mode}: the ranks differ")
        check(len(mirror) == 6 and late[0]["checksums"] == mirror == late[1]["checksums"],
              f"{mode}: the shard's mirror is not the workers' model: {mirror} vs "
              f"{late[0]['checksums']}")
    print("ok: weights changed after a step on every rank (a load_state_dict after step 2, with "
          "and without clip_grad_norm_, rank 1 late or not, and a clamp_ after every step) "
          "become the job's: the "
          "shard's mirror equals every rank's model after all 6 steps")
    code, zero_one, mirror = run_logged("late_zero_one")
    check(code == 0 and zero_one[0]["bits"] == zero_one[1]["bits"],
          f"ZeroOneAdam: weights changed before a sync and before a local interval: "
          f"{zero_one[0]['error']} {zero_one[1]['error']}")
    for r in range(2):
        exchanged = [zero_one[r]["checksums"][s] for s in (0, 1, 2, 3, 7)]
        check(not zero_one[r]["error"] and exchanged == mirror,
              f"rank {r}: after the steps that exchanged {exchanged}, the shard's {mirror}")
    print("ok: ZeroOneAdam: weights changed before a sync step, and right after a sync before "
          "a local interval (its anchor), become the job's: the shard's mirror equals every "
          "rank's model after each step that exchanged, the interval's sync of step 7 included")
    if not surfaces:
        code, ranks, _ = run_logged("late_zero_one_rank0_only", config)
        errors = [got["error"] for got in ranks]
        check(all(errors) and any("after step 3" in e and "same way on every rank" in e
                                  for e in errors),
              f"ZeroOneAdam, rank 0 alone changed its weights before an interval: {errors}")
        print("ok: ZeroOneAdam: rank 0 alone changed its weights before a local interval: the "
              "job stopped at the interval's sync (step 7), saying to change them on every rank")
    for mode in () if surfaces else ("late_rank0_only", "late_rank1_only"):
        code, ranks, _ = run_logged(mode, config)
        errors = [got["error"] for got in ranks]
        check(all(errors), f"{mode}: every rank must fail: {errors}")
        check(any("same way on every rank" in e for e in errors),
              f"{mode}: no error says to change the weights on every rank: {errors}")
        print(f"ok: {mode}: the job stopped at step 3, saying to change the weights the same way "
              "on every rank")

    code, groups = run("groups")
    check(code == 0, "the job with two parameter groups failed")
    for r in range(2):
        check(not groups[r]["error"], f"rank {r}: {groups[r]['error']}")
        # The first group's 112 elements are 7 whole blocks: its segment
        # needs no padding, and the blocks are one group's.
        check(groups[r]["bits"] == before[r]["bits"],
              f"rank {r}: two parameter groups with the same settings train differently from one")
    # Alike when built, group 1's lr set apart after step 2 (a scheduler's
    # lambda per group): as torch, each group trains with its own from step
    # 3 on, bit for bit as the same values in groups built apart.
    code, apart, mirror = run_logged("groups_apart")
    check(code == 0 and not apart[0]["error"] and not apart[1]["error"],
          f"a group set apart after the optimizer was built: {apart[0]['error']} "
          f"{apart[1]['error']}")
    check(apart[0]["bits"] == apart[1]["bits"], "groups_apart: the ranks differ")
    check(len(mirror) == 6 and apart[0]["checksums"] == mirror == apart[1]["checksums"],
          f"groups_apart: the shard's mirror is not the workers' model: {mirror} vs "
          f"{apart[0]['checksums']}")
    code, built_apart = run("groups_built_apart")
    check(code == 0 and not built_apart[0]["error"],
          f"groups built apart: {built_apart[0]['error']}")
    check([got["bits"] for got in apart] == [got["bits"] for got in built_apart],
          "a group set apart after building trains differently from groups built apart with the "
          "same values at every step")
    check(apart[0]["bits"] != groups[0]["bits"], "the lr set apart changed nothing")
    print("ok: two parameter groups alike train bit for bit as one; one set apart after step 2 "
          "trains with its own lr from step 3 (the mirror equal to every rank), bit for bit as "
          "groups built apart with the same values")

    # Groups built apart, on one shard whose mirror logs its checksum after
    # every step.
    code, own, mirror = run_logged("groups_own")
    check(code == 0 and not own[0]["error"] and not own[1]["error"],
          f"groups with their own lr and weight_decay failed: {own[0]['error']} {own[1]['error']}")
    pretrained = [p.reshape(-1).view(torch.int32).tolist() for p in build(7).state_dict().values()]
    check(own[0]["bits"][:2] == pretrained[:2],
          "the group with lr 0 and weight_decay 0 moved")
    check(own[0]["bits"][2:] != pretrained[2:], "the other group did not train")
    check(own[0]["bits"] == own[1]["bits"], "the ranks differ")
    check(len(mirror) == 6 and own[0]["checksums"] == mirror == own[1]["checksums"],
          f"the shard's mirror is not the workers' model: {mirror} vs {own[0]['checksums']}")
    print("ok: groups built with their own lr and weight_decay train apart (OneBitAdam, a group "
          "with lr 0 unchanged, the other with its own betas and eps, beta1 changed every step), "
          "the shard's mirror equal to the workers after all 6 steps")
    print("PASS")
