#!/usr/bin/python3
"""Train a small MLP on the UCI digits (Debian's python3-sklearn) with Morse.

    morse-run --servers 2 --workers 4 -- python3 worker/python/examples/digits_mlp.py

Each rank trains on its own rows (row % world_size == rank), 32 samples a
step. The one Morse-specific line is the optimizer: morse.torch.OneBitAdam
where a single-process script would use torch.optim.Adam. Rank 0 also trains
the same model with torch.optim.Adam on the union of every rank's batches
(exactly synchronous data-parallel Adam) and prints both test accuracies.
"""
import argparse
import json

import numpy as np
import torch
from sklearn.datasets import load_digits

import morse.torch


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batch(features, labels, rank, world, step, size, seed=0):
    rows = np.arange(rank, len(labels), world)
    pick = np.random.RandomState((1000003 * step + rank + 7919 * seed) % 2**32).choice(
        rows, size, replace=False)
    return features[pick], labels[pick]


def digits_split():
    """The UCI digits scaled to [0, 1], shuffled once: (train_x, train_y,
    test_x, test_y), the last 360 rows held out."""
    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    features = torch.tensor(digits.data[order] / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target[order])
    return features[:-360], labels[:-360], features[-360:], labels[-360:]


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--optimizer", choices=["onebit_adam", "adam", "loco"], default="onebit_adam")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--seed", type=int, default=0,
                        help="initial weights and batch order (default 0)")
    args = parser.parse_args()

    train_x, train_y, test_x, test_y = digits_split()

    torch.manual_seed(args.seed)
    model = make_model()
    baseline = make_model()
    baseline.load_state_dict(model.state_dict())
    # Default eps: always-zero pixels have v = 0, which the zero-variance
    # mask keeps at m = 0 once v is frozen (docs/numerics.md).
    common = dict(lr=args.lr, schedule="cosine", steps=args.steps)
    if args.optimizer == "onebit_adam":
        optimizer = morse.torch.OneBitAdam(model.parameters(), freeze_step=args.steps // 4, **common)
    elif args.optimizer == "loco":
        optimizer = morse.torch.Adam(model.parameters(), codec="int4", feedback="ema",
                                     feedback_beta=0.5, **common)
    else:
        optimizer = morse.torch.Adam(model.parameters(), **common)
    rank, world = optimizer.rank, int(__import__("os").environ.get("MORSE_WORLD_SIZE", "1"))
    reference = torch.optim.Adam(baseline.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        reference, lambda t: 0.5 * (1 + np.cos(np.pi * min(t, args.steps) / args.steps)))

    for step in range(args.steps):
        x, y = batch(train_x, train_y, rank, world, step, 32, args.seed)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0:  # the baseline sees every rank's batch of this step
            xs, ys = zip(*(batch(train_x, train_y, r, world, step, 32, args.seed)
                             for r in range(world)))
            reference.zero_grad()
            torch.nn.functional.cross_entropy(baseline(torch.cat(xs)), torch.cat(ys)).backward()
            reference.step()
            schedule.step()
        if rank == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}, pushed {optimizer.last_step['bytes_up']} B")
    if rank == 0:
        result = {"optimizer": args.optimizer, "test_accuracy": accuracy(model, test_x, test_y),
                  "torch_adam_test_accuracy": accuracy(baseline, test_x, test_y),
                  "push_bytes_last_step": optimizer.last_step["bytes_up"],
                  "fp32_bytes_per_step": 4 * sum(p.numel() for p in model.parameters())}
        print(f"test accuracy: morse {args.optimizer} {100 * result['test_accuracy']:.2f}%, "
              f"torch.optim.Adam {100 * result['torch_adam_test_accuracy']:.2f}%")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
