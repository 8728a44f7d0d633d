#!/usr/bin/env python3
"""Train a tiny GPT-2 in an Accelerate loop with a Morse optimizer.

    morse-run --servers 2 --workers 2 -- python3 worker/python/examples/accelerate_loop.py

(python3: one with torch 2.x, transformers and accelerate, e.g. the venv
tests/python/torch2-venv.sh makes.) The loop is Accelerate's own
(accumulate, backward, step); the model and data are hf_trainer.py's. The
Morse-specific lines are the optimizer and the prepare call:

    opt = morse.torch.OneBitAdam(model.parameters(), lr=...)
    model, opt, loader = morse.torch.hf.prepare(accelerator, model, opt, loader)

The loop's accelerator.clip_grad_norm_ clips the averaged gradient, as
under DDP (morse.torch.clip_grad_norm_).

--save-steps N checkpoints with accelerator.save_state every N steps (the
prepare above makes every rank's optimizer state part of it), --resume goes
on from the last one with accelerator.load_state, bit for bit as the run
that saved it.

--optimizer ddp runs the same loop with torch.optim.AdamW under DDP (the
baseline). Rank 0 prints the loss of every
step (averaged over ranks) and writes them to --losses.
"""
import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from transformers import GPT2LMHeadModel, get_linear_schedule_with_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import (Sequences, common_arguments, leave_process_group, model_config,  # noqa: E402
                        morse_optimizer, parameter_groups, parameters_checksum)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, "Accelerator")
    parser.add_argument("--output-dir", default="accelerate-out",
                        help="checkpoints, OUTPUT_DIR/checkpoint-STEP (default: accelerate-out)")
    parser.add_argument("--save-steps", type=int, default=0,
                        help="accelerator.save_state every N steps (default: 0, none)")
    parser.add_argument("--resume", action="store_true",
                        help="accelerator.load_state of the last checkpoint in --output-dir")
    parser.add_argument("--save-model", metavar="DIR",
                        help="accelerator.save_model of the trained model into DIR at the end")
    a = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=a.accumulation,
                              cpu=not torch.cuda.is_available(),
                              mixed_precision="bf16" if a.bf16 else "fp16" if a.fp16 else "no")
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel(model_config()).to(accelerator.device)
    loader = torch.utils.data.DataLoader(Sequences(seed=a.seed), batch_size=a.batch, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(a.seed))
    if a.optimizer == "ddp":
        params = parameter_groups(model, a.weight_decay) if a.weight_decay else model.parameters()
        opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    else:
        import morse.torch.hf
        opt = morse_optimizer(a, model)
    # Stepped once per optimizer step below (Accelerate's prepared scheduler
    # would step it once per process).
    sched = get_linear_schedule_with_warmup(opt, max(1, a.steps // 10), a.steps)
    if a.optimizer == "ddp":
        model, opt, loader = accelerator.prepare(model, opt, loader)
    else:
        model, opt, loader = morse.torch.hf.prepare(accelerator, model, opt, loader)

    # The scheduler in the checkpoints too (Accelerate saves the prepared
    # ones; this one is stepped here).
    accelerator.register_for_checkpointing(sched)
    losses, step, total = {}, 0, torch.zeros((), device=accelerator.device)
    batches = len(loader)
    skip = 0  # batches of the current epoch that the resumed run has seen
    if a.resume:
        saved = [int(d.split("-")[1]) for d in os.listdir(a.output_dir) if d.startswith("checkpoint-")]
        step = max(saved)
        accelerator.load_state(os.path.join(a.output_dir, f"checkpoint-{step}"))
        epochs, skip = divmod(step * a.accumulation, batches)
        for _ in range(epochs):  # each epoch's shuffle draws from the loader's generator
            for _ in loader:
                pass
        print(f"resumed at step {step} from {a.output_dir}/checkpoint-{step}", flush=True)
    model.train()
    while step < a.steps:
        epoch = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in epoch:
            with accelerator.accumulate(model):
                loss = model(**{"input_ids": batch["input_ids"], "labels": batch["labels"]}).loss
                total += loss.detach() / a.accumulation
                accelerator.backward(loss)
                if accelerator.sync_gradients and a.max_grad_norm:
                    # Under DDP and under Morse alike: the averaged gradient's
                    # norm (Morse clips the average in step()).
                    accelerator.clip_grad_norm_(model.parameters(), a.max_grad_norm)
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                sched.step()
                step += 1
                losses[step] = accelerator.gather(total).mean().item()
                total.zero_()
                if a.save_steps and step % a.save_steps == 0:
                    accelerator.save_state(os.path.join(a.output_dir, f"checkpoint-{step}"))
                if step == a.steps:
                    break

    if accelerator.is_main_process:
        print("losses: " + " ".join(f"{s}:{v:.4f}" for s, v in sorted(losses.items())), flush=True)
        first = min(losses)
        print(f"loss {losses[first]:.4f} at step {first}, {losses[a.steps]:.4f} at step {a.steps}",
              flush=True)
        if a.losses:
            with open(a.losses, "w") as f:
                json.dump({str(s): v for s, v in losses.items()}, f)
    print(f"rank {accelerator.process_index}: parameters checksum "
          f"{parameters_checksum(accelerator.unwrap_model(model))}", flush=True)
    if a.optimizer != "ddp":
        print(f"rank {accelerator.process_index}: Morse step {morse.torch.hf._morse_optimizer(opt).step_index}", flush=True)
    if a.save_model:
        accelerator.save_model(model, a.save_model)
    leave_process_group()  # before end_training, which would leave it at once
    accelerator.end_training()


if __name__ == "__main__":
    main()
