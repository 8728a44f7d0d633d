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
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import (VOCAB, Sequences, common_arguments, leave_process_group, morse_optimizer,  # noqa: E402
                        parameter_groups, parameters_checksum)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, "Accelerator")
    a = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=a.accumulation,
                              cpu=not torch.cuda.is_available(),
                              mixed_precision="bf16" if a.bf16 else "no")
    torch.manual_seed(a.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).to(accelerator.device)
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

    losses, step, total = {}, 0, torch.zeros((), device=accelerator.device)
    model.train()
    while step < a.steps:
        for batch in loader:
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
                if step == a.steps:
                    break

    if accelerator.is_main_process:
        print("losses: " + " ".join(f"{s}:{v:.4f}" for s, v in sorted(losses.items())), flush=True)
        print(f"loss {losses[1]:.4f} at step 1, {losses[a.steps]:.4f} at step {a.steps}", flush=True)
        if a.losses:
            with open(a.losses, "w") as f:
                json.dump({str(s): v for s, v in losses.items()}, f)
    print(f"rank {accelerator.process_index}: parameters checksum "
          f"{parameters_checksum(accelerator.unwrap_model(model))}", flush=True)
    if a.optimizer != "ddp":
        print(f"rank {accelerator.process_index}: Morse step {morse.torch.hf._morse_optimizer(opt).step_index}", flush=True)
    leave_process_group()  # before end_training, which would leave it at once
    accelerator.end_training()


if __name__ == "__main__":
    main()
