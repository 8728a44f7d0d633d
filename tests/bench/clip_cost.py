"""What clipping (and editing .grad) costs a morse.torch step with overlap: a 4M-parameter MLP,
2 ranks, 16 steps, the median of steps 4..15 printed by rank 0, for

  none    no clipping;
  script  torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3) after
          backward() (it waits for the exchange where the step averages;
          in a compression phase the pushes wait for it);
  option  the optimizer's clip_grad_norm=1e-3 (no call in the script);
  edit    .grad halved after backward() (the pushes then wait for step());
  add     the script's clip, then .grad added to after it: in onebit's
          compression phase each rank's own gradient, pushed in torch's
          order (on a node every rank then compares its .grad by a hash);
          where the step averages (adam), the step's gradient amended
          (design.md 2.6, "Edits after the clip": an fp32 copy of the model
          with the commit and the next step's pushes).
  scaler  fp16 loss scaling's recipe, torch.amp.GradScaler (torch 2.x):
          scaler.scale(loss).backward(), scaler.unscale_(opt), the script's
          clip, scaler.step(opt), scaler.update() (the pushes wait for
          step(), or the clip, and the ranks take one verdict on overflow
          over torch.distributed's group); nothing overflows.

max_norm 1e-3 clips every step. OPTIMIZER=adam (fp32, every step averages)
or onebit (freeze_step 2: steps 4..15 are the compression phase). Under
morse-run --node-aggregation the 2 ranks are one node: in the compression
phase the script's clip is the node's own on the node's average, which
every rank then holds as .grad.

    OPTIMIZER=adam build/bin/morse-run --servers 1 --workers 2 -- python3 tests/bench/clip_cost.py script
    OPTIMIZER=onebit build/bin/morse-run --servers 1 --workers 2 --node-aggregation -- \
        python3 tests/bench/clip_cost.py add
"""
import os
import sys
import time

import torch

import morse.torch

mode = sys.argv[-1]
if mode not in ("none", "script", "option", "edit", "add", "scaler"):
    sys.exit(f"usage: clip_cost.py none|script|option|edit|add|scaler, not {mode!r}")
name = os.environ.get("OPTIMIZER", "adam")
rank = int(os.environ["MORSE_RANK"])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
clip = 1e-3 if mode == "option" else None
if name == "onebit":
    opt = morse.torch.OneBitAdam(model, freeze_step=2, clip_grad_norm=clip)
else:
    opt = morse.torch.Adam(model, clip_grad_norm=clip)
x = torch.randn(16, 1024)
# The time a step spends putting the clipped average in .grad (after the
# script's clip where the step averages, as DDP's .grad holds it).
shown = []
show = opt._show_clipped_average


def timed_show():
    start = time.time()
    showed = show()
    shown[-1] += time.time() - start
    return showed


opt._show_clipped_average = timed_show
scaler = torch.amp.GradScaler("cpu") if mode == "scaler" else None
times = []
for step in range(16):
    start = time.time()
    shown.append(0.0)
    opt.zero_grad()
    loss = model(x).square().mean()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    if mode in ("script", "add", "scaler"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    if mode == "add" and step >= 2:
        with torch.no_grad():
            model[0].bias.grad.add_(1e-6)
    elif mode == "edit":
        with torch.no_grad():
            for p in model.parameters():
                p.grad.mul_(0.5)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    times.append(time.time() - start)
if rank == 0:
    t, w = sorted(times[4:]), sorted(shown[4:])
    print(f"RESULT {name} {mode}: median step {t[len(t) // 2] * 1000:.1f} ms, of which "
          f"{w[len(w) // 2] * 1000:.1f} ms putting the clipped average in .grad", flush=True)
