"""A morse.torch rank killed mid-run is restarted alone and ends where an
undisturbed run would (issue 40). morse-run --rank-restarts 1 runs 2 ranks
and 2 shards of a job that checkpoints every 4 steps; each rank saves its
whole state to MORSE_CHECKPOINT_DIR after steps 4, 8, 12, ... The runs:
- rank 1 kills itself with SIGKILL in step 14, after backward() has pushed
  that step's gradients (overlap) and before step(): restarted, it starts
  from its checkpoint of step 12 and replays steps 12..14 (the shards
  completed step 14 with the push that left);
- rank 0 (which uploaded the initial model) kills itself in step 9 before
  backward(): it replays step 8;
- shard 1 is killed after step 5 (morse-run restarts it from step 4's
  checkpoint), then rank 1 in step 14 before backward();
- shard 1 and rank 1 are killed together in step 14 before backward(),
  as when the host of both is lost (`host`): both restart from step 12;
- a ZeroOneAdam rank with two parameter groups (each its own lr, changed
  every step) is killed in a local step and resumes from a checkpoint
  taken in the middle of a local interval (every 5 steps);
- a DiLoCo rank is killed in the middle of an interval;
- an Adam job whose script clips the first layer, then the whole model,
  after every backward() (`clip`: the steps' clip pieces) has rank 1
  killed in step 14 after its clips, and ends every step on the bits of
  the same job undisturbed;
- a OneBitAdam job whose script changes the weights after every step from
  step 2 on (scaled by 0.98, by 0.5 after step 10, and clamped) has rank 1
  killed in step 14 after
  backward(): its checkpoint of step 12 holds the clamp made after step 11
  (rank 1 reaches step 12 a second late, so that rank 0 has given the
  shards the changed weights by then),
  the replayed steps' changes are the shards' already, and from step 15 on
  the weights change on both ranks again.
morse-run restarts the rank with MORSE_REJOIN=1; the script goes on from
opt.step_index with the same batches, the shards answer the replayed steps
with the replies they kept (each replayed push checked against the one that
left), and the other rank, which waited, goes on with it. After every step,
in either life, each rank holds the bits the simulator gives it for the
undisturbed run (with 1-bit Adam both ranks the same ones)."""
import glob
import shutil
import json
import os
import re
import signal
import sys
import tempfile
import time

import torch

from harness import (check, check_ranks_match_simulator, morse_run, shard_pid,  # noqa: E402
                     shown_on_failure)

STEPS = 20


# ZeroOneAdam's groups (Trainer's decay / no-decay split, the biases at
# twice the lr), each with an lr of its own at every step, a function of the
# step so that a replay sets it again.
ZERO_ONE = dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=2,
                local_step_clipper=4)
GROUP_LR = (lambda t: 0.01 * (1.0 - 0.02 * t), lambda t: 0.02 / (1 + 0.1 * t))


def worker(out, mode, kill_rank, kill_in, after_backward, kill_shard_after=-1):
    import numpy as np
    import morse.torch
    from harness import flat_layout
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    rank = int(os.environ["MORSE_RANK"])
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    if mode == "zero_one":
        groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
                  {"params": [p for p in model.parameters() if p.dim() == 1],
                   "weight_decay": 0.0}]
        opt = morse.torch.ZeroOneAdam(groups, lr=0.01, weight_decay=0.01, **ZERO_ONE,
                                      block_elems=16, partition_elems=64)
    elif mode == "clip":
        opt = morse.torch.Adam(model.parameters(), lr=0.01, block_elems=16, partition_elems=64)
    else:
        opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=5, block_elems=16,
                                     partition_elems=64)
    first = opt.step_index
    print(f"life {life} starts at step {first}", flush=True)
    if rank == 0 and life == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy", flat_layout(opt, model, [p.detach() for p in model.parameters()]).numpy())
    for step in range(first, STEPS):
        if mode == "zero_one":
            for group, lr in zip(opt.param_groups, GROUP_LR):
                group["lr"] = lr(step)
        # The batch of a step is a function of the step: a replay sees it again.
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        dies = rank == kill_rank and life == 0 and step == kill_in
        if mode == "clamp" and rank == kill_rank and life == 0 and step == 12:
            # Rank 0 gives the shards the weights changed after step 11
            # before this rank reaches step 12 (as it may under load): this
            # rank then finds the shards holding its changed weights, and
            # its checkpoint of step 12 must still hold the change.
            time.sleep(1.0)
        if dies and mode == "host":
            # The host of rank 1 and shard 1 lost: the shard dies first.
            os.kill(shard_pid(os.environ["MORSE_CONFIG"], 1), signal.SIGKILL)
            print(f"killed shard 1 in step {step}", flush=True)
        if dies and not after_backward:
            print(f"killing myself in step {step}, before backward()", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        flat = flat_layout(opt, model, [p.grad for p in model.parameters()])
        np.save(f"{out}/grad-{rank}-{step}-{life}.npy", flat.numpy())
        if rank == 0 and mode == "zero_one":
            json.dump(opt._group_hyper(), open(f"{out}/hyper-{step}-{life}.json", "w"))
        if mode == "clip":  # a part of the model, then the whole (clip pieces every step)
            torch.nn.utils.clip_grad_norm_(list(model[0].parameters()), 0.05)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        if dies:
            # Once the other rank has finished this step, every push of this
            # one has reached the shards (they may still be on their way when
            # backward() returns).
            other = f"{out}/checksum-{1 - rank}-{step}-0"
            for _ in range(3000):
                if os.path.exists(other):
                    break
                time.sleep(0.01)
            print(f"killing myself in step {step}, its gradients pushed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        if rank != kill_rank and life == 0 and step == kill_shard_after:
            # A shard lost before the rank: restarted from its checkpoint,
            # it counts only the ranks that join it again.
            os.kill(shard_pid(os.environ["MORSE_CONFIG"], 1), signal.SIGKILL)
            print(f"killed shard 1 after step {step}", flush=True)
        with open(f"{out}/checksum-{rank}-{step}-{life}.tmp", "w") as f:
            f.write(opt.checksum())
        os.rename(f"{out}/checksum-{rank}-{step}-{life}.tmp", f"{out}/checksum-{rank}-{step}-{life}")
        # After the step's checksum (the simulator's, before the change).
        if mode == "clamp" and step >= 2:
            # Weights changed after a step, as a WGAN critic's are.
            with torch.no_grad():
                for p in model.parameters():  # a real change every step
                    p.mul_(0.5 if step == 10 else 0.98)
                    p.clamp_(-0.12, 0.12)
            np.save(f"{out}/x-{rank}-{step + 1}-{life}.npy",
                    flat_layout(opt, model, [p.detach() for p in model.parameters()]).numpy())


def diloco_worker(out, kill_rank, kill_in):
    """DiLoCo: H = 2 inner AdamW steps per sync, int8 pseudo-gradients with
    error feedback; checkpoints every 4 syncs (8 inner steps). Writes the
    outer checksum after each sync."""
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    rank = int(os.environ["MORSE_RANK"])
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = morse.torch.DiLoCo(model, inner, sync_every=2, codec="int8", block_elems=16,
                             partition_elems=64)
    first = opt.inner_steps
    print(f"life {life} starts at inner step {first}", flush=True)
    for step in range(first, 2 * STEPS):
        if rank == kill_rank and life == 0 and step == kill_in:
            print(f"killing myself in inner step {step}, before backward()", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if opt.inner_steps % 2 == 0:
            name = f"{out}/checksum-{rank}-{opt.step_index}-{life}"
            with open(name + ".tmp", "w") as f:
                f.write(opt.checksum())
            os.rename(name + ".tmp", name)


def checksums_of(out, ranks, steps=range(STEPS)):
    """Each rank's checksum after every step of `steps` (DiLoCo's: the
    outer one after each sync), its lives agreeing."""
    result = []
    for r in range(ranks):
        sums = []
        for step in steps:
            values = {open(p).read() for p in glob.glob(f"{out}/checksum-{r}-{step}-*")}
            check(len(values) == 1, f"rank {r} step {step}: {values or 'no checksum'}")
            sums.append(values.pop())
        result.append(sums)
    return result


def restart_job(name, *args):
    """A job of this script on 2 ranks and 2 shards (`args` after --worker
    OUT), checkpoints every 4 steps and --rank-restarts 1, in a folder of
    its own: (its output, the folder); fails unless the job succeeds."""
    out = tempfile.mkdtemp(prefix=f"morse-rank-restart-{name}-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 4 }\ntimeouts { recovery_seconds: 60 }\n")
    code, log = morse_run(__file__, 2, 2, out, *args, config=config,
                          extra=["--rank-restarts", "1"])
    with shown_on_failure(log):
        check(code == 0, f"the {name} job failed")
    return log, out


def run_diloco():
    """DiLoCo's rank 1 killed in the middle of an interval (inner step 19,
    after sync 9, whose checkpoint is sync 8's) and restarted: every sync's
    outer parameters and momentum on both ranks equal an undisturbed run's."""
    outs = []
    for kill in (True, False):
        log, out = restart_job("diloco", "diloco", "1" if kill else "-1", "19")
        if kill:
            with shown_on_failure(log):
                check("[rank 1] killing myself in inner step 19" in log, "rank 1 was not killed")
                check("[rank 1] life 1 starts at inner step 16" in log,
                      "the restarted DiLoCo rank did not start at its checkpoint of sync 8")
                check("replaying steps 8..8" in log, "the restarted rank did not replay sync 8")
        outs.append(checksums_of(out, 2, range(1, STEPS + 1)))
        shutil.rmtree(out)
    check(outs[0][0] == outs[0][1], "the DiLoCo ranks differ")
    check(outs[0] == outs[1], f"the restarted DiLoCo run differs from the undisturbed one: "
                              f"{outs[0][0]} vs {outs[1][0]}")
    print(f"PASS: DiLoCo rank 1 killed in inner step 19 and restarted from sync 8; {STEPS} syncs "
          "bit-identical to the undisturbed run on both ranks")


def run_clip():
    """`clip` (the module's docstring): Adam, the script clipping the first
    layer, then the whole model, every step; rank 1 killed in step 14 after
    its clips, restarted from step 12: every step's checksum on both ranks,
    in either life, the undisturbed run's."""
    runs = []
    for kill in (True, False):
        log, out = restart_job("clip", "clip", "-1", "1" if kill else "-1", "14", "1")
        if kill:
            with shown_on_failure(log):
                check("[rank 1] life 1 starts at step 12" in log and "replaying steps 12..14" in log,
                      "rank 1 was not restarted from step 12 and replayed to 14")
        runs.append(checksums_of(out, 2))
        shutil.rmtree(out)
    check(runs[0][0] == runs[0][1], "the clipped job's ranks differ")
    check(runs[0] == runs[1], "the restarted clipped run differs from the undisturbed one")
    print(f"PASS (clip): clip_grad_norm_ of the first layer, then the whole model, every step; "
          f"rank 1 killed in step 14 after its clips and restarted from step 12: {STEPS} steps "
          "on both ranks bit-identical to the undisturbed run")


def run(kill_rank, kill_in, after_backward, checkpoint, replayed, kill_shard_after=-1,
        mode="onebit", every=4):
    out = tempfile.mkdtemp(prefix="morse-rank-restart-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write(f"checkpoint {{ every_steps: {every} }}\ntimeouts {{ recovery_seconds: 60 }}\n")
    code, log = morse_run(__file__, 2, 2, out, mode, str(kill_shard_after), str(kill_rank),
                          str(kill_in), str(int(after_backward)), config=config,
                          extra=["--rank-restarts", "1"])
    os.remove(config)
    with shown_on_failure(log):
        check_restarted_run(out, log, code, kill_rank, kill_in, checkpoint, replayed,
                            kill_shard_after, mode)


def check_restarted_run(out, log, code, kill_rank, kill_in, checkpoint, replayed,
                        kill_shard_after, mode):
    """run()'s checks of its job (`log`, exit `code`, files in `out`)."""
    import numpy as np
    check(code == 0, "the job failed")
    check(f"[rank {kill_rank}] killing myself in step {kill_in}" in log,
          f"rank {kill_rank} was not killed")
    if kill_shard_after >= 0:
        check(f"killed shard 1 after step {kill_shard_after}" in log and "restarting it on" in log,
              "shard 1 was not killed and restarted")
    if mode == "host":
        check(f"killed shard 1 in step {kill_in}" in log and "restarting it on" in log,
              "shard 1 was not killed with the rank and restarted")
    check(f"rank {kill_rank} exited with -9; restarting it (1 of --rank-restarts 1)" in log,
          f"morse-run did not restart rank {kill_rank}")
    check(f"[rank {kill_rank}] life 1 starts at step {checkpoint}" in log,
          "the restarted rank did not start at its checkpoint")
    # A host lost in step 14 (mode "host"): rank 0 may still be in step 13
    # when the shard dies, its last reply of step 13 lost with the shard
    # (rank 1 had its own and went on). Then rank 0 replays step 12 to the
    # restarted shard and pushes step 13 again, and rank 1, restarted,
    # finds that shard at step 12 and resumes there: nothing to replay.
    # Either way the bits are checked below.
    rank0_behind = (mode == "host"
                    and re.search(rf"replaying steps {checkpoint}\.\.{checkpoint}\b", log)
                    and f"worker {kill_rank}: resuming at step {checkpoint};" in log)
    check(f"replaying steps {checkpoint}..{replayed}" in log or rank0_behind,
          f"the restarted rank did not replay steps {checkpoint}..{replayed}")
    # Each step's gradient and checksum as the lives that ran it saw them:
    # a replayed step must give the same bits in both.
    for r in range(2):
        checksums = []
        for step in range(STEPS):
            lives = sorted(glob.glob(f"{out}/checksum-{r}-{step}-*"))
            check(lives, f"rank {r} has no checksum of step {step}")
            values = {open(p).read() for p in lives}
            check(len(values) == 1, f"rank {r} step {step}: its lives differ: {values}")
            grads = sorted(glob.glob(f"{out}/grad-{r}-{step}-*.npy"))
            first = np.load(grads[0])
            for g in grads[1:]:
                check(np.array_equal(first, np.load(g)), f"rank {r} step {step}: gradients differ")
            np.save(f"{out}/grad-{r}-{step}.npy", first)
            checksums.append(values.pop())
        json.dump(checksums, open(f"{out}/checksums-{r}.json", "w"))
    for step in range(STEPS):  # the weights as changed before a step, alike in every rank's lives
        changes = sorted(glob.glob(f"{out}/x-*-{step}-*.npy"))
        if changes:
            first = np.load(changes[0])
            for c in changes[1:]:
                check(np.array_equal(first, np.load(c)), f"step {step}: changed weights differ")
            np.save(f"{out}/x-{step}.npy", first)
    if mode == "clamp":
        check(len(glob.glob(f"{out}/x-?.npy") + glob.glob(f"{out}/x-??.npy")) == STEPS - 3,
              "the weights were not changed after every step from step 2 on")
    if mode == "zero_one":  # each step's groups' (lr, weight_decay), as rank 0 stepped them
        json.dump([json.load(open(min(glob.glob(f"{out}/hyper-{step}-*.json"))))
                   for step in range(STEPS)], open(f"{out}/hypers.json", "w"))
    for f in (glob.glob(f"{out}/grad-*-*-*.npy") + glob.glob(f"{out}/checksum-*") +
              glob.glob(f"{out}/hyper-*") + glob.glob(f"{out}/x-*-*-*.npy")):
        os.remove(f)
    together = check_ranks_match_simulator(out, 2, STEPS, ranks_may_differ=mode == "zero_one")
    if mode == "zero_one":
        check(together < STEPS, "the ranks never stepped apart: no local step was tested")
    print(f"PASS ({mode}): rank {kill_rank} killed in step {kill_in} and restarted from its "
          f"checkpoint of step {checkpoint}; {STEPS} steps, "
          f"{'each rank' if mode == 'zero_one' else 'both ranks'} bit-identical "
          f"{'' if mode == 'zero_one' else 'to each other and '}to the simulator"
          f"{' (the weights changed after every step)' if mode == 'clamp' else ''}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        if sys.argv[-3] == "diloco":  # --worker OUT diloco KILL_RANK KILL_IN
            diloco_worker(sys.argv[-4], int(sys.argv[-2]), int(sys.argv[-1]))
        else:
            # --worker OUT MODE KILL_SHARD_AFTER KILL_RANK KILL_IN AFTER_BACKWARD
            worker(sys.argv[-6], sys.argv[-5], int(sys.argv[-3]), int(sys.argv[-2]),
                   sys.argv[-1] == "1", int(sys.argv[-4]))
        sys.exit(0)
    # What --rank-restarts refuses, before starting anything.
    import subprocess
    for flags, why in ((["--rank-restarts", "1"], "needs checkpoint { every_steps: N }"),
                       (["--rank-restarts", "1", "--check-config"], "needs checkpoint"),
                       (["--rank-restarts", "1", "--stages", "2"], "not supported"),
                       (["--rank-restarts", "-1"], "at least 0")):
        result = subprocess.run([os.environ["MORSE_RUN"], "--servers", "1", "--workers", "2"] +
                                flags + ["--", sys.executable, "-c", "pass"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=60)
        check(result.returncode != 0 and why in result.stdout,
              f"morse-run {' '.join(flags)}: exit {result.returncode}, {result.stdout!r}")
    run(kill_rank=1, kill_in=14, after_backward=True, checkpoint=12, replayed=14)
    run(kill_rank=0, kill_in=9, after_backward=False, checkpoint=8, replayed=8)
    # Shard 1 killed after step 5 and restarted (from step 4), then rank 1
    # in step 14: a rank restarted after a shard's restart joins the running
    # job without waiting for every rank to have joined that shard again.
    run(kill_rank=1, kill_in=14, after_backward=False, checkpoint=12, replayed=13,
        kill_shard_after=5)
    # A host lost with a shard and a rank on it: rank 1 kills shard 1, then
    # itself, in step 14 before backward(). Both restart from their
    # checkpoints of step 12: rank 0 replays steps 12..13 to the shard and
    # waits in step 14 for rank 1, which replays 12..13 and goes on (or,
    # where rank 0 was still in step 13, replays 12..12, and rank 1 resumes
    # at step 12).
    run(kill_rank=1, kill_in=14, after_backward=False, checkpoint=12, replayed=13, mode="host")
    # ZeroOneAdam with two groups of their own lr and weight_decay, which
    # change every step. From step 9 on the interval is 4 (design.md 2.7,
    # s = step + 1): steps 11, 15 and 19 sync, the others are local. With
    # checkpoints every 5 steps, the one of step 15 (taken after step 14)
    # lies in the middle of an interval, the shards holding step 11's sync:
    # rank 1, killed in step 17 after step 15's sync and local step 16,
    # resumes from it (its interval's anchor, update and each group's lr
    # sum), replays step 15's sync, steps locally again and reaches step
    # 19's sync, where rank 0 waits for it.
    run(kill_rank=1, kill_in=17, after_backward=True, checkpoint=15, replayed=15,
        mode="zero_one", every=5)
    run(kill_rank=1, kill_in=14, after_backward=True, checkpoint=12, replayed=14, mode="clamp")
    run_clip()
    run_diloco()
