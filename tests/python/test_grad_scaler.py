"""fp16 loss scaling with torch.amp.GradScaler on Morse optimizers, as
under DDP: 2 ranks under morse-run, a step whose gradients overflow on one
rank skipped on every rank, the others unscaled and taken, every rank's
loss scale moving as DDP's.

1. `adam`: scaler.scale(loss).backward(), scaler.step(opt),
   scaler.update(), rank 1's loss made infinite in steps 2 and 7 and rank
   0's in step 9 (init_scale 1024, growth_interval 3, so the scale grows
   and backs off). Every step's parameters within 1e-5 of DDP + AdamW
   under a GradScaler of its own (one process fed the averaged scaled
   gradient, as DDP's all-reduce gives it), every rank's scale equal to
   that GradScaler's after every step, the same steps skipped.
2. `adam_clip`: the AMP recipe with clipping: scaler.unscale_(opt),
   clip_grad_norm_(params, 0.5), scaler.step(opt), scaler.update(); the
   norms DDP's (non-finite where the step overflowed).
3. `onebit`: OneBitAdam (freeze_step 4) with the clip recipe, overflows
   in its warmup (step 2) and its compression phase (steps 7 and 9): both
   ranks skip the same steps and end bit-identical, the shards' mirrors
   the workers' model after every step.
4. `adam_clip` again with the 2 ranks one node (morse-run
   --node-aggregation, led and sharded): the same checks (the node's
   average is DDP's).
5. `adam_clip@cuda` and `onebit@cuda` (the part `cuda`; skipped, saying
   so, without a GPU): 2 and 3 with the models, the reference and
   GradScaler("cuda") on the GPU, where fp16 loss scaling is used.
6. `restart`: `adam` under morse-run --rank-restarts 2, rank 1 killed in
   step 5: the job cannot take it back (the ranks' overflow verdict goes
   through torch.distributed's group, which a restarted rank cannot join
   again), so it stops within seconds, saying so and what to do instead
   (rank 0 that its group lost a rank, the restarted ranks that they are
   back from a restart), instead of the gloo error or a wait; rank 0 had
   warned at its first step that a lost rank would stop the job. The
   same in an elastic job (--min-workers 1), which cannot leave rank 1
   out. (An elastic job under a GradScaler that loses no rank trains as
   any other: `adam` with --min-workers 1 in part `cpu`.)

Parts (command-line arguments; none: all): `cpu` (1-4), `cuda` (5),
`restart` (6).

Under torch 1.13, whose GradScaler (torch.cuda.amp.GradScaler) hands a
custom optimizer its step through step(grad_scaler=...) and runs on CUDA
alone, the same runs (the python_grad_scaler test): on the CPU with that
GradScaler's two CUDA kernels written out in torch (harness.cpu_grad_scaler),
on a GPU with the real one."""
import math
import os
import re
import signal
import sys
import tempfile
import time

import torch

from harness import check, cpu_grad_scaler, has_cuda, modes_of, morse_run

STEPS = 12
KILLED = 5  # `restart`: rank 1's step that it dies in
OVERFLOWS = {(1, 2), (1, 7), (0, 9)}  # (rank, step): that rank's loss is infinite


def batch(rank, step, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)


def loss_of(model, rank, step):
    x, y = batch(rank, step, next(model.parameters()).device)
    loss = (model(x) - y).square().mean()
    return loss * math.inf if (rank, step) in OVERFLOWS else loss


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(device)


def new_scaler(device):
    if device == "cpu":
        return cpu_grad_scaler(init_scale=1024.0, growth_interval=3)
    if getattr(getattr(torch, "amp", None), "GradScaler", None) is not None:
        return torch.amp.GradScaler(device, init_scale=1024.0, growth_interval=3)
    return torch.cuda.amp.GradScaler(init_scale=1024.0, growth_interval=3)  # torch 1.13's


def worker(mode):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    killed = mode == "restart"  # rank 1 dies in step KILLED in its first life
    if killed:
        mode = "adam"
    mode, _, device = mode.partition("@")
    device = device or "cpu"
    clip = mode in ("adam_clip", "onebit")
    model = make_model(device)
    if mode == "onebit":
        opt = morse.torch.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4)
    else:
        opt = morse.torch.Adam(model.parameters(), lr=1e-2)
    scaler = new_scaler(device)
    # DDP + AdamW under a GradScaler of its own: one process fed the
    # ranks' averaged scaled gradient.
    reference = make_model(device)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    ref_scaler = new_scaler(device)
    torch_clip = morse.torch._TORCH_CLIP_GRAD_NORM
    worst, skipped = 0.0, []
    for step in range(opt.step_index, STEPS):
        if killed and rank == 1 and life == 0 and step == KILLED:
            os.kill(os.getpid(), signal.SIGKILL)
        before = opt.step_index
        opt.zero_grad()
        scaler.scale(loss_of(model, rank, step)).backward()
        if clip:
            scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        scaler.step(opt)
        scaler.update()
        if opt.step_index == before:
            skipped.append(step)
        if mode == "onebit":
            check(opt._session.holds_shards_model(),
                  f"rank {rank} step {step}: the shards' mirrors hold another model")
            continue
        grads = []
        for r in (0, 1):
            reference.zero_grad()
            ref_scaler.scale(loss_of(reference, r, step)).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for p, g0, g1 in zip(reference.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        if clip:
            ref_scaler.unscale_(ref_opt)
            want = float(torch_clip(reference.parameters(), 0.5))
            same = (math.isnan(norm) == math.isnan(want) and math.isinf(norm) == math.isinf(want)
                    and (not math.isfinite(want) or abs(norm - want) <= 1e-5 * want))
            check(same,
                  f"rank {rank} step {step}: clip_grad_norm_ returned {norm}, DDP's {want}")
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        check(scaler.get_scale() == ref_scaler.get_scale(),
              f"rank {rank} step {step}: loss scale {scaler.get_scale()}, DDP's "
              f"{ref_scaler.get_scale()}")
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        worst = max(worst, diff)
        check(diff <= 1e-5, f"rank {rank} step {step}: max |morse - DDP| = {diff}")
    check(opt.step_index == STEPS - len(skipped), f"rank {rank}: {opt.step_index} steps taken")
    check(all(p.device.type == device for p in model.parameters()), f"rank {rank}: parameters left {device}")
    compared = "not compared" if mode == "onebit" else f"{worst:.2e}"
    print(f"rank {rank}: {STEPS} steps, skipped {skipped}, loss scale {scaler.get_scale()}, "
          f"largest difference from DDP + AdamW {compared}, checksum {opt.checksum()}")


def restart(how):
    """`restart` (6): rank 1 killed under --rank-restarts 2 (`how`
    "restarts"), or in an elastic job (--min-workers 1, "elastic"), stops
    the job, saying why, within seconds."""
    out = tempfile.mkdtemp(prefix=f"morse-grad-scaler-{how}-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 2 replay_steps: 16 }\n")
    began = time.monotonic()
    code, log = morse_run(__file__, 2, 1, "restart", config=config, timeout=240,
                          extra=["--rank-restarts", "2"] if how == "restarts" else
                          ["--min-workers", "1"])
    took = time.monotonic() - began
    print(log[-6000:])
    check(code != 0, f"{how}: the job went on after it lost a rank under a GradScaler")
    check(("rank 1 exited with -9; restarting it" if how == "restarts" else
           "rank 1 exited with -9; the job goes on without it") in log,
          f"{how}: rank 1 was not killed (and restarted, or left out)")
    lost = ("UNAVAILABLE: fp16 loss scaling: the ranks could not agree whether this step "
            "overflowed: a rank left torch.distributed's group")
    back = ("FAILED_PRECONDITION: fp16 loss scaling cannot take back a rank restarted by "
            "--rank-restarts: this rank is back from a restart")
    check(lost in log, f"{how}: the rank whose group lost rank 1 did not say so")
    check(how != "restarts" or back in log, "a restarted rank did not say why it stops")
    check(re.search(r"morse-run: rank \d's error: morse\._native\.MorseError: "
                    r"(UNAVAILABLE|FAILED_PRECONDITION): fp16 loss scaling", log),
          f"{how}: morse-run's last word is not the reason")
    check("restart the whole job from its checkpoints" in log,
          f"{how}: what to do instead is not said")
    warning = ("and morse-run --rank-restarts cannot take a restarted rank back into it: "
               if how == "restarts" else "and an elastic job (min_workers) cannot go on without "
               "a rank that left it (the group's next collective fails): ") + \
        "a lost rank will stop the job"
    warned = log.count(warning)
    check(warned == 1, f"{how}: rank 0 did not warn once at its first step that a lost rank "
          f"will stop the job ({warned} warnings)")
    print(f"PASS: GradScaler {'under --rank-restarts 2' if how == 'restarts' else 'in an elastic job'}"
          f", rank 1 killed in step {KILLED}: the job stops after {took:.1f} s, rank 0 saying its "
          "group lost a rank" + (" and the restarted ranks that fp16 loss scaling cannot take "
                                 "them back" if how == "restarts" else "")
          + ", with what to do instead; rank 0 had warned at its first step")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    want = sorted(step for _, step in OVERFLOWS)
    # (mode, morse-run's extra arguments): the 2 ranks as two workers, and
    # as one node of 2 (the leader steps; sharded, each rank its slice).
    # `restart`'s two runs are restart(how)'s, not the loop's below.
    parts = {"restart": [("restarts", ()), ("elastic", ())],
             "cpu": [("adam", ()), ("adam_clip", ()), ("onebit", ()),
                     ("adam_clip", ("--node-aggregation",)),
                     ("adam_clip", ("--node-aggregation=sharded",)),
                     ("adam", ("--min-workers", "1"))],
             "cuda": [("adam_clip@cuda", ()), ("onebit@cuda", ())]}
    runs = modes_of(parts)
    for how in ("restarts", "elastic"):
        if (how, ()) in runs:
            runs.remove((how, ()))
            restart(how)
    if any("@cuda" in mode for mode, _ in runs) and not has_cuda("the models on the GPU"):
        runs = [(mode, extra) for mode, extra in runs if "@cuda" not in mode]
    for mode, extra in runs:
        extra = list(extra)
        code, out = morse_run(__file__, 2, 2 if not extra else 1, mode, extra=extra)
        print(out)
        what = " ".join([mode] + extra)
        check(code == 0, f"the job failed ({what})")
        lines = [line for line in out.splitlines() if f"{STEPS} steps, skipped" in line]
        check(len(lines) == 2, f"{what}: both ranks report")
        check(all(f"skipped {want}" in line for line in lines), f"{what}: steps {want} skipped on every rank")
        # (A sharded node's rank checksums its own slice's state.)
        ends = {line.split(f"{STEPS} steps, ", 1)[1] for line in lines}
        if "sharded" in what:
            ends = {end.split(", checksum")[0] for end in ends}
        check(len(ends) == 1, f"{what}: the ranks end apart (skips, loss scale, checksum): {ends}")
    ran = ", ".join(" ".join([mode, *extra]) for mode, extra in runs)
    scaler = type(new_scaler("cpu")).__name__
    if runs:
        print(f"PASS: {scaler} (torch {torch.__version__}) on 2 ranks ({ran}): a step whose "
              f"gradients overflowed on one rank ({sorted(OVERFLOWS)}) skipped on every rank, the "
              "loss scale DDP's on every rank after every step, Adam's parameters within 1e-5 of "
              "DDP + AdamW (with and without unscale_ and clip_grad_norm_), and OneBitAdam through "
              "warmup and compression bit-identical on both ranks with the shards' mirrors")
