"""An example training script for the torch-script overlay: replace it with
your own (same ConfigMap key, train.py). Each rank trains the same MLP on its
own shard of a synthetic classification task with morse.torch.OneBitAdam;
the environment (MORSE_RANK, MORSE_WORLD_SIZE, MORSE_SERVERS, MORSE_CONFIG,
the MORSE_TLS_* files and MORSE_TOKEN_FILE, RANK, WORLD_SIZE) comes from the
Job."""
import os

import torch

import morse.torch

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = morse.torch.OneBitAdam(model, lr=3e-3, freeze_step=50)
teacher = torch.nn.Linear(32, 4)
data = torch.Generator().manual_seed(1 + rank)
for step in range(300):
    x = torch.randn(64, 32, generator=data)
    y = teacher(x).argmax(dim=1).detach()
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if step % 50 == 0 and rank == 0:
        print(f"step {step} loss {loss.item():.4f} pushed {optimizer.last_step['bytes_up']} B",
              flush=True)
print(f"rank {rank}/{world}: done, model checksum {optimizer.checksum()}", flush=True)
