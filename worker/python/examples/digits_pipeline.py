#!/usr/bin/python3
"""Train an MLP on the UCI digits split into pipeline stages, with compressed
activations and gradients between them (morse.torch.pipeline).

    morse-run --stages 2 --workers 2 -- python3 worker/python/examples/digits_pipeline.py \\
        --forward int8 --backward fp32

Every process builds the whole model from the same seed and keeps its
stage's layers (a Linear+ReLU block per stage, the classifier on the last).
Replica r of stage 0 draws its batches from rows r, r + R, ...; the targets
ride with the activations to the last stage, which computes the loss. Each
stage's replicas average their gradients through their own Morse shards
(--optimizer adam or onebit_adam), or, with --optimizer local, a plain
torch.optim.Adam per stage (one replica: what the tests compare with a
single process). Each stage prints one JSON line at the end: its bytes per
step on each side, its time per step, and on the last stage the held-out
loss and accuracy with the boundaries compressed and in fp32.
"""
import argparse
import json
import os
import time

import numpy as np
import torch

import morse.torch
from morse.torch import pipeline


def make_model(stages, hidden, seed):
    """The whole model: `stages` blocks, one per stage."""
    torch.manual_seed(seed)
    blocks, width = [], 64
    for s in range(stages):
        layers = [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        if s == stages - 1:
            layers.append(torch.nn.Linear(hidden, 10))
        blocks.append(torch.nn.Sequential(*layers))
        width = hidden
    return blocks


def load_digits():
    from sklearn.datasets import load_digits as sk_digits
    digits = sk_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    features = torch.tensor(digits.data[order] / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target[order])
    return features[:-360], labels[:-360], features[-360:], labels[-360:]


def batch_rows(n, replica, replicas, step, size):
    rows = np.arange(replica, n, replicas)
    return torch.tensor(np.random.RandomState(1000003 * step + replica).choice(rows, size, replace=False))


def correct(output, target):
    return (output.argmax(1) == target).sum()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=32, help="rows per step per replica (default 32)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--hidden", type=int, default=128, help="width of every hidden layer (default 128)")
    parser.add_argument("--forward", default="fp32",
                        help="activations' boundary spec, e.g. fp32, int8, int4, topk:0.1+ef, int8+aq")
    parser.add_argument("--backward", default="fp32", help="gradients' boundary spec, e.g. fp32, int8, topk:0.3")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe", help="default gpipe")
    parser.add_argument("--optimizer", choices=["adam", "onebit_adam", "local"], default="adam",
                        help="each stage's optimizer: Morse adam (default), Morse onebit_adam, or a "
                             "local torch.optim.Adam (one replica per stage)")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--seed", type=int, default=0, help="the model's initialization")
    parser.add_argument("--save", help="write this stage's final state (module, optimizer, "
                                       "boundaries, losses) to SAVE.stage-<s>")
    parser.add_argument("--resume", help="start from the states --save wrote (RESUME.stage-<s>)")
    parser.add_argument("--save-at", type=int, default=None, help="with --save: stop after this many steps")
    parser.add_argument("--die-at", type=int, default=None,
                        help="(tests) this process exits abruptly before this step if --die-stage is its stage")
    parser.add_argument("--die-stage", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a neighbour")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    index, stages = pipeline.stage_index(), pipeline.stage_count()
    replica, replicas = int(os.environ.get("MORSE_RANK", "0")), int(os.environ.get("MORSE_WORLD_SIZE", "1"))
    module = make_model(stages, args.hidden, args.seed)[index]
    stage = pipeline.Stage(module, forward=args.forward, backward=args.backward, timeout=args.timeout)
    kind = pipeline.GPipe if args.schedule == "gpipe" else pipeline.OneFOneB
    schedule = kind(stage, args.microbatches, loss_fn=torch.nn.functional.cross_entropy)
    if args.optimizer == "local":
        optimizer = torch.optim.Adam(module.parameters(), lr=args.lr)
    # A step runs backward once per micro-batch: the optimizer accumulates them.
    elif args.optimizer == "onebit_adam":
        optimizer = morse.torch.OneBitAdam(module.parameters(), lr=args.lr, freeze_step=args.steps // 4,
                                           accumulation_steps=args.microbatches)
    else:
        optimizer = morse.torch.Adam(module.parameters(), lr=args.lr, accumulation_steps=args.microbatches)
    train_x, train_y, test_x, test_y = load_digits()

    first, losses = 0, []
    if args.resume:
        saved = torch.load(f"{args.resume}.stage-{index}")
        module.load_state_dict(saved["module"])
        optimizer.load_state_dict(saved["optimizer"])
        stage.load_state_dict(saved["pipeline"])
        first, losses = saved["step"], saved["losses"]
    last = args.steps if args.save_at is None else args.save_at
    bytes_forward = bytes_backward = 0
    start = time.time()
    for step in range(first, last):
        if args.die_at is not None and step == args.die_at and index == args.die_stage:
            os._exit(9)
        rows = batch_rows(len(train_y), replica, replicas, step, args.batch)
        optimizer.zero_grad()
        loss = schedule.step(train_x[rows], target=train_y[rows], samples=rows)
        optimizer.step()
        losses.append(loss)
        bytes_forward += stage.last_bytes["forward"]
        bytes_backward += stage.last_bytes["backward"]
        if replica == 0 and index == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    seconds = time.time() - start
    steps_run = max(1, last - first)
    result = {"stage": index, "stages": stages, "replica": replica, "forward": args.forward,
              "backward": args.backward, "schedule": args.schedule, "steps": last,
              "bytes_forward_per_step": bytes_forward / steps_run,
              "bytes_backward_per_step": bytes_backward / steps_run,
              "seconds_per_step": seconds / steps_run, "final_loss": losses[-1] if losses else None,
              "samples_seen": stage.samples_seen()}
    if args.save:
        torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "pipeline": stage.state_dict(), "step": last, "losses": losses},
                   f"{args.save}.stage-{index}")
    if args.save_at is None or args.save_at >= args.steps:
        module.eval()
        for compress in (True, False):
            r = schedule.evaluate(test_x, target=test_y, compress=compress, metric_fn=correct)
            tag = "compressed" if compress else "fp32"
            result[f"test_loss_{tag}"], result[f"test_accuracy_{tag}"] = r["loss"], r["metric"]
    result["parameters_checksum"] = float(sum(p.double().sum() for p in module.parameters()))
    schedule.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
