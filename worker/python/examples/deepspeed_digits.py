#!/usr/bin/python3
"""Train the digits MLP from a DeepSpeed config, as a script that used
DeepSpeed's OneBitAdam would (DeepSpeed removed it in September 2026).

    morse-run --servers 2 --workers 4 -- python3 worker/python/examples/deepspeed_digits.py \\
        --deepspeed_config worker/python/examples/ds_config.json

morse.torch.from_deepspeed builds the optimizer, its clipping and its
learning-rate schedule from the config (docs/python.md, "Coming from
DeepSpeed"); the loop is DeepSpeed's with the engine's calls written out:
loss.backward() for model_engine.backward(loss), optimizer.step() and
scheduler.step() for model_engine.step(). Each rank trains on its own rows
of the UCI digits (digits_mlp.py's data), train_micro_batch_size_per_gpu a
step; rank 0 prints the test accuracy.
"""
import argparse
import json
import os

import torch

import morse.torch
from digits_mlp import accuracy, batch, digits_split, make_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help="the DeepSpeed config (JSON)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default: 400)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    args = parser.parse_args()
    with open(args.deepspeed_config) as f:
        ds = json.load(f)

    train_x, train_y, test_x, test_y = digits_split()

    torch.manual_seed(args.seed)
    model = make_model()
    # was: model_engine, optimizer, _, scheduler = deepspeed.initialize(
    #          model=model, model_parameters=model.parameters(), config=ds)
    optimizer, scheduler = morse.torch.from_deepspeed(model.parameters(), ds)
    rank, world = optimizer.rank, int(os.environ.get("MORSE_WORLD_SIZE", "1"))
    size = int(ds.get("train_micro_batch_size_per_gpu", 32))
    every = int(ds.get("steps_per_print", 100))
    for step in range(args.steps):
        x, y = batch(train_x, train_y, rank, world, step, size, args.seed)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()          # model_engine.backward(loss)
        optimizer.step()         # model_engine.step(): the optimizer,
        if scheduler is not None:
            scheduler.step()     # then the config's scheduler
        optimizer.zero_grad()
        if rank == 0 and (step + 1) % every == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}, lr {optimizer.param_groups[0]['lr']:.3g}, "
                  f"pushed {optimizer.last_step['bytes_up']} B", flush=True)
    if rank == 0:
        result = {"optimizer": type(optimizer).__name__, "test_accuracy": accuracy(model, test_x, test_y)}
        print(f"test accuracy: morse {result['optimizer']} from {os.path.basename(args.deepspeed_config)} "
              f"{100 * result['test_accuracy']:.2f}%")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
