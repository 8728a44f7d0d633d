"""Step time of morse.torch OneBitAdam with overlap, replies applied at step()
(apply_at_step=True) or as they arrive (False): a 4M-parameter MLP, 14
steps, the median of steps 4..13 printed by rank 0.

    build/bin/morse-run --servers 1 --workers 2 -- python3 tests/bench/apply_at_step.py defer
    build/bin/morse-run --servers 1 --workers 2 -- python3 tests/bench/apply_at_step.py arrive
"""
import os, sys, time, torch
import morse.torch
defer = sys.argv[-1] == "defer"
rank = int(os.environ["MORSE_RANK"])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
opt = morse.torch.OneBitAdam(model, freeze_step=2, apply_at_step=defer)
x = torch.randn(16, 1024)
times = []
for step in range(14):
    start = time.time()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    times.append(time.time() - start)
if rank == 0:
    t = sorted(times[4:])
    print(f"RESULT {'apply_at_step' if defer else 'apply_on_arrival'}: median step {t[len(t)//2]*1000:.1f} ms", flush=True)
