"""What changing the weights after a step costs a morse.torch step: a
4M-parameter MLP, 2 ranks, three phases of 16 steps in one run, the median
of each phase's steps 4..15 printed by rank 0, and each phase's ratio to
the first:

  plain    no change;
  swapped  other weights swapped in after every step and restored bit for
           bit (an evaluation's EMA weights): the next step compares each
           partition's hash of x with the shards' to tell;
  changed  every weight scaled by 0.999 after every step (a WGAN critic's
           clamp_ changes some; this changes all): the hashes, then rank
           0 uploads the model and each shard writes its checkpoint (when
           it has a checkpoint path) before the step goes on, while rank 1
           asks for the shards' hashes until they hold the change.

OPTIMIZER=adam (fp32) or onebit (freeze_step 2: the compression phase).

    OPTIMIZER=onebit build/bin/morse-run --servers 1 --workers 2 -- python3 tests/bench/weights_change_cost.py
"""
import os
import time

import torch

import morse.torch

name = os.environ.get("OPTIMIZER", "adam")
rank = int(os.environ["MORSE_RANK"])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
if name == "onebit":
    opt = morse.torch.OneBitAdam(model, freeze_step=2)
else:
    opt = morse.torch.Adam(model)
other = {k: v * 0.5 for k, v in model.state_dict().items()}
x = torch.randn(16, 1024)
medians = {}
for phase in ("plain", "swapped", "changed"):
    times = []
    for step in range(16):
        start = time.time()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        with torch.no_grad():
            if phase == "swapped":
                kept = {k: v.clone() for k, v in model.state_dict().items()}
                model.load_state_dict(other)
                model.load_state_dict(kept)
            elif phase == "changed":
                for p in model.parameters():
                    p.mul_(0.999)
        times.append(time.time() - start)
    t = sorted(times[4:])
    medians[phase] = t[len(t) // 2]
if rank == 0:
    parameters = sum(p.numel() for p in model.parameters())
    for phase, median in medians.items():
        print(f"RESULT {name} {phase}: median step {median * 1000:.1f} ms, "
              f"{median / medians['plain']:.2f}x plain ({parameters:,} parameters, 2 ranks)",
              flush=True)
