#!/usr/bin/env python3
"""Train a tiny GPT-2 with Hugging Face Trainer and a Morse optimizer.

    morse-run --servers 2 --workers 2 -- python3 worker/python/examples/hf_trainer.py

(python3: one with torch 2.x, transformers and accelerate, e.g. the venv
tests/python/torch2-venv.sh makes.) The model is built from a config (no
downloads) and learns sequences that follow x[t+1] = (5*x[t] + b) mod 64,
b one of 4 values drawn per sequence. The Morse-specific lines are the optimizer and
the callback (see morse/torch/hf.py):

    opt = morse.torch.OneBitAdam(model.parameters(), lr=...)
    Trainer(..., optimizers=(opt, None), callbacks=[MorseCallback()])

or, for DiLoCo (each rank's own AdamW, an outer step on the shards every
--sync-every steps; Trainer's scheduler and clipping take the inner steps):

    opt = morse.torch.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=...),
                             sync_every=...)

With --bf16 (or --fp16) the forward runs under Trainer's autocast
(MorseCallback applies it, as Accelerate does for the models it wraps);
with --fp16 Trainer's GradScaler scales the loss, and a step whose
gradients overflow on any rank is skipped on every rank, as under DDP.

With --weight-decay the optimizer gets Trainer's two parameter groups
(decay, and biases and norms without), each group its own weight_decay.
With --built-by-trainer Trainer builds the optimizer itself, with those
groups, from a class and its arguments:

    Trainer(..., optimizer_cls_and_kwargs=(morse.torch.AdamW, dict(lr=...)),
            callbacks=[MorseCallback()])

Trainer's max_grad_norm clips the averaged gradient, as under DDP
(morse.torch.clip_grad_norm_).

--optimizer ddp trains the same run with Trainer's own AdamW under DDP (the
baseline; run it under morse-run or torchrun). Rank 0 prints the loss of
every step (the average over ranks, as Trainer logs it) and writes them to
--losses; every rank prints a checksum of its parameters at the end.
"""
import argparse
import hashlib
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB = 64


class Sequences(torch.utils.data.Dataset):
    """`count` sequences of `length` tokens: x[t+1] = (5*x[t] + b) mod VOCAB,
    b one of 4 values per sequence (a bigram model reaches ln 4 = 1.39; the
    context tells b apart)."""

    def __init__(self, count=512, length=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        a = 5
        b = torch.tensor([1, 7, 13, 29])[torch.randint(0, 4, (count,), generator=g)]
        x = [torch.randint(0, VOCAB, (count,), generator=g)]
        for _ in range(length - 1):
            x.append((a * x[-1] + b) % VOCAB)
        self.tokens = torch.stack(x, 1)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def leave_process_group():
    """Ends the stacks' gloo process group before the interpreter does.

    torch's ProcessGroupGloo destructor joins its worker threads while
    holding the GIL, and a worker thread still freeing its last collective
    needs the GIL: left to interpreter exit (DDP's reducer keeps the group
    alive), this deadlocks now and then. So the group goes while Python
    runs, after a pause that lets the threads finish their last work; no
    collective may follow."""
    import gc
    import time
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    time.sleep(0.2)  # the GIL is free: the worker threads drop their work
    gc.collect()
    torch.distributed.destroy_process_group()


def model_config():
    """The tiny GPT-2 both examples train (no dropout: the runs compare bit for bit)."""
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def parameters_checksum(model):
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def common_arguments(parser, stack):
    """The flags hf_trainer.py and accelerate_loop.py share; `stack` (Trainer,
    Accelerator) is whose DDP and gradient accumulation they mean."""
    parser.add_argument("--optimizer", default="onebit_adam",
                        choices=["onebit_adam", "onebit_lamb", "zero_one_adam", "adam", "diloco",
                                 "ddp"],
                        help="morse.torch.OneBitAdam, morse.torch.OneBitLamb (each tensor a layer), "
                             "morse.torch.ZeroOneAdam (DeepSpeed's defaults but the freeze), "
                             "morse.torch.Adam (fp32 Adam through the shards), morse.torch.DiLoCo "
                             "over each rank's own AdamW (--sync-every), or AdamW under "
                             f"{stack}'s DDP (default: onebit_adam)")
    parser.add_argument("--sync-every", type=int, default=5,
                        help="--optimizer diloco: inner steps between syncs (default: 5)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    parser.add_argument("--freeze-step", type=int, default=15,
                        help="OneBitAdam's and OneBitLamb's warmup steps, ZeroOneAdam's "
                             "var_freeze_step (default: 15)")
    parser.add_argument("--local-step-scaler", type=int, default=32678,
                        help="ZeroOneAdam's local_step_scaler: steps before each doubling of the "
                             "local interval (default: 32678, DeepSpeed's)")
    parser.add_argument("--local-step-clipper", type=int, default=16,
                        help="ZeroOneAdam's local_step_clipper: the longest local interval "
                             "(default: 16, DeepSpeed's)")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default: 1e-2)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch (default: 8)")
    parser.add_argument("--accumulation", type=int, default=1,
                        help=f"{stack}'s gradient_accumulation_steps (default: 1)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clip the averaged gradient's norm to this, 0 for none (default: 1.0)")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="decoupled weight decay of every parameter but biases and norms, "
                             "in a group apart as Trainer builds it (default: 0.0)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true",
                           help=f"bf16 mixed precision ({stack}'s autocast; the parameters, "
                                "gradients and optimizer stay float32)")
    precision.add_argument("--fp16", action="store_true",
                           help=f"fp16 mixed precision ({stack}'s autocast and its GradScaler, "
                                "which skips a step whose gradients overflow on any rank; CUDA "
                                "and torch 2.3 or later)")
    parser.add_argument("--losses", help="rank 0 writes {step: loss} here as JSON")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")


def parameter_groups(model, weight_decay):
    """Trainer's optimizer groups for `weight_decay`: every parameter but
    biases and norms decays, the others do not (Trainer's own split:
    get_decay_parameter_names reads nothing of the Trainer)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def zero_one_arguments(a):
    """ZeroOneAdam's arguments from the flags."""
    return dict(lr=a.lr, var_freeze_step=a.freeze_step, local_step_scaler=a.local_step_scaler,
                local_step_clipper=a.local_step_clipper)


def morse_optimizer(a, model):
    """The Morse optimizer that --optimizer names (not ddp), with Trainer's
    decay / no-decay groups when --weight-decay is set."""
    import morse.torch
    params = parameter_groups(model, a.weight_decay) if a.weight_decay else model.parameters()
    if a.optimizer == "onebit_adam":
        return morse.torch.OneBitAdam(params, lr=a.lr, freeze_step=a.freeze_step)
    if a.optimizer == "onebit_lamb":
        return morse.torch.OneBitLamb(params, lr=a.lr, freeze_step=a.freeze_step)
    if a.optimizer == "zero_one_adam":
        return morse.torch.ZeroOneAdam(params, **zero_one_arguments(a))
    if a.optimizer == "diloco":
        # Each rank's own AdamW (the groups' weight_decay, else none), and
        # every --sync-every steps an outer step on the shards (the paper's
        # Nesterov SGD; fp32 pseudo-gradients).
        inner = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
        return morse.torch.DiLoCo(model, inner, sync_every=a.sync_every)
    return morse.torch.Adam(params, lr=a.lr)


def built_by_trainer(a):
    """Trainer's optimizer_cls_and_kwargs for --optimizer: Trainer builds the
    optimizer itself, over its decay / no-decay groups (weight_decay from
    TrainingArguments), with these arguments."""
    import morse.torch
    if a.optimizer == "onebit_adam":
        return morse.torch.OneBitAdam, dict(lr=a.lr, freeze_step=a.freeze_step)
    if a.optimizer == "onebit_lamb":
        return morse.torch.OneBitLamb, dict(lr=a.lr, freeze_step=a.freeze_step)
    if a.optimizer == "zero_one_adam":
        return morse.torch.ZeroOneAdam, zero_one_arguments(a)
    if a.optimizer == "adam":
        return morse.torch.AdamW, dict(lr=a.lr)
    raise SystemExit(f"--built-by-trainer: --optimizer {a.optimizer} is not an optimizer Trainer "
                     "builds from a class (DiLoCo wraps the model and an inner optimizer)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, "Trainer")
    parser.add_argument("--built-by-trainer", action="store_true",
                        help="let Trainer build the Morse optimizer (optimizer_cls_and_kwargs: its "
                             "decay / no-decay groups, --weight-decay as TrainingArguments' "
                             "weight_decay) instead of passing it built (optimizers=)")
    parser.add_argument("--output-dir", default="hf-trainer-out", help="checkpoints (default: hf-trainer-out)")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (default: 0, none)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="Trainer's activation_checkpointing (the layers' activations "
                             "recomputed in backward())")
    parser.add_argument("--lora", type=int, metavar="R",
                        help="fine-tune LoRA adapters of rank R on the attention (peft's "
                             "get_peft_model; the model's own weights frozen, out of the optimizer)")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="Trainer's torch_compile with this backend (inductor, aot_eager; "
                             "default: not compiled)")
    a = parser.parse_args()

    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulation, learning_rate=a.lr, lr_scheduler_type="linear",
        warmup_steps=max(1, a.steps // 10), max_grad_norm=a.max_grad_norm, logging_steps=1,
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        report_to=[], use_cpu=not torch.cuda.is_available(), seed=a.seed, data_seed=a.seed,
        disable_tqdm=True, dataloader_drop_last=True, weight_decay=a.weight_decay,
        bf16=a.bf16, fp16=a.fp16,
        torch_compile=bool(a.compile), torch_compile_backend=a.compile,
        # (Named only when set: transformers before 5.2x has no such argument.)
        **({"activation_checkpointing": True} if a.activation_checkpointing else {}))
    torch.manual_seed(a.seed)
    config = model_config()
    model = GPT2LMHeadModel(config).to(args.device)
    if a.lora:
        from peft import LoraConfig, get_peft_model
        # GPT-2's projections are Conv1D (fan_in_fan_out).
        model = get_peft_model(model, LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                                                 target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
    losses = Losses()
    callbacks = [losses]
    optimizers, built = (None, None), {}
    if a.optimizer != "ddp":
        from morse.torch.hf import MorseCallback
        if a.built_by_trainer:
            built = dict(optimizer_cls_and_kwargs=built_by_trainer(a))
        else:
            optimizers = (morse_optimizer(a, model), None)
        callbacks.append(MorseCallback())
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(seed=a.seed),
                      optimizers=optimizers, callbacks=callbacks, **built)
    trainer.train(resume_from_checkpoint=True if a.resume else None)

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        steps = sorted(losses.losses)
        print("losses: " + " ".join(f"{s}:{losses.losses[s]:.4f}" for s in steps), flush=True)
        if steps:
            print(f"loss {losses.losses[steps[0]]:.4f} at step {steps[0]}, "
                  f"{losses.losses[steps[-1]]:.4f} at step {steps[-1]}", flush=True)
        if a.losses:
            with open(a.losses, "w") as f:
                json.dump({str(s): v for s, v in losses.losses.items()}, f)
    compiled = getattr(model, "_compiled_call_impl", None) is not None  # model.compile() in place
    checkpointed = getattr(model, "is_activation_checkpointing", False)
    print(f"rank {rank}: parameters checksum {parameters_checksum(model)}"
          f"{' (compiled in place)' if compiled else ''}"
          f"{' (activation checkpointing)' if checkpointed else ''}", flush=True)
    del trainer, model
    leave_process_group()


if __name__ == "__main__":
    main()
