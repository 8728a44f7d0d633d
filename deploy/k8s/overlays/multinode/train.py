"""An example script for the multinode overlay: replace it with your own
(same ConfigMap key, train.py). morse-run starts it once per GPU of the pod
(LOCAL_RANK picks the GPU); every rank trains the same MLP on its own shard
of a synthetic classification task with morse.torch.OneBitAdam, on the GPU
where there is one. The environment (RANK, WORLD_SIZE, LOCAL_RANK,
MORSE_SERVERS, MORSE_CONFIG, the MORSE_TLS_* files, MORSE_TOKEN_FILE) comes
from morse-run."""
import os

import torch

import morse.torch

rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
optimizer = morse.torch.OneBitAdam(model, lr=3e-3, freeze_step=50)
teacher = torch.nn.Linear(32, 4).to(device)
data = torch.Generator(device=device).manual_seed(1 + rank)
for step in range(300):
    x = torch.randn(64, 32, generator=data, device=device)
    y = teacher(x).argmax(dim=1).detach()
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if step % 50 == 0 and rank == 0:
        print(f"step {step} loss {loss.item():.4f} pushed {optimizer.last_step['bytes_up']} B", flush=True)
print(f"rank {rank}/{world} on {device}: done, model checksum {optimizer.checksum()}", flush=True)
