"""Morse under Hugging Face Trainer and Accelerate (issue 41, parts 3 and 4):
worker/python/examples/hf_trainer.py and accelerate_loop.py (a tiny GPT-2
built from a config) under morse-run with 2 ranks and 2 shards, against the
same scripts with the stacks' own AdamW under DDP (gloo), started the same
way:

- fp32 (morse.torch.Adam, clipping at 1.0, 2 accumulated micro-batches):
  every step's loss (averaged over the ranks) equals DDP's to float
  rounding, under Trainer and under Accelerate; the model that
  accelerator.save_model writes reloads with the trained parameters;
- 1-bit (OneBitAdam): within the convergence margin of DDP's loss;
- with Trainer's weight decay (a decay and a no-decay group): fp32 Adam
  equals DDP's losses to float rounding, also built by Trainer itself
  (optimizer_cls_and_kwargs=(morse.torch.AdamW, ...)), a OneBitAdam run
  so built resumes bit-identically, and OneBitLamb converges like DDP;
- LoRA adapters (peft) under Trainer: fp32 Adam equals DDP's losses, and a
  OneBitAdam run resumes bit-identically;
- a Trainer run resumed from its own checkpoint (rank 0's optimizer.pt
  loaded on every rank, MorseCallback finding each rank's own state) is
  bit-identical to the uninterrupted run: the same losses and parameters
  (also with morse-run --node-aggregation, and for ZeroOneAdam saved
  inside a local interval, each rank on its own parameters);
  with a rank's state missing, that rank says which file it looked for;
  and a Trainer run (and an Accelerate loop) of DDP + AdamW resumed from
  its checkpoint with morse.torch.Adam goes on as DDP does (losses within
  1e-5), with OneBitAdam in 1-bit steps;
  the same for the Accelerate loop's save_state / load_state;
- the fp32 runs clip with Trainer's max_grad_norm and the loop's
  accelerator.clip_grad_norm_, which clip the averaged gradient as under
  DDP (morse.torch.clip_grad_norm_); Trainer's clipping (and
  accelerator.clip_grad_norm_) by another max_norm than the optimizer's
  own clip_grad_norm is refused with what to do;
- `accelerate launch` (torchrun's variables, the shard started apart and
  given by MORSE_SERVERS) runs the Accelerate loop bit-identically to the
  same job under morse-run;
- Trainer's torch_compile (aot_eager) compiles the model in place and
  trains bit-identically to eager, and its activation_checkpointing
  bit-identically to the run without;
- DiLoCo (morse.torch.DiLoCo over each rank's own AdamW, synced every 4
  steps) under Trainer and Accelerate: learns, each rank's
  model its own between syncs (no DDP wrap) and one at a sync, and a run
  resumed between syncs is bit-identical to the whole run;
- bf16 mixed precision (Trainer's bf16=True, Accelerator's
  mixed_precision="bf16") autocasts the forward as Accelerate does under
  DDP: the first step's loss DDP's bit for bit (and not float32's), every
  step within 1e-3 of DDP's; fp8 is refused saying to use bf16;
- fp16 (the part `fp16`, on a GPU: skipped, saying so, without one): the
  stacks' autocast and GradScaler over morse.torch.Adam, one rank, the
  losses the stack's own AdamW's.

Needs transformers, accelerate and peft: under Debian's python3 (torch 1.13, no
transformers) this test is skipped, saying so; its torch2_ twin runs it in
the venv of tests/python/torch2-venv.sh, which pins them.

ctest runs it in parts, each a test of its own (torch2_hf_setup, _trainer,
_accelerate, _diloco, _groups, _resume, _fp16): `test_hf.py [PART ...]`, all of them
without arguments."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

from harness import check, free_port, server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "..", "..", "worker", "python", "examples")
RANKS, SHARDS = 2, 2


def run(script, *args, expect_ok=True, launcher=(), shards=SHARDS, env=None, command=None,
        ranks_agree=True, ranks=RANKS):
    """morse-run --servers 2 --workers 2 (`shards`, `ranks`) [launcher flags] -- python script
    args (or `command` + [script, --losses, ...] args); returns (losses by
    step, the parameters' checksum on every rank, output). Every rank ends
    with the same parameters, or with `ranks_agree` False each with its own
    (DiLoCo between syncs), and then the checksums come as a sorted tuple."""
    out = tempfile.mkdtemp(prefix="morse-hf-")
    losses = os.path.join(out, "losses.json")
    if command is None:
        command = [os.environ["MORSE_RUN"], "--servers", str(shards), "--workers", str(ranks),
                   *launcher, "--", sys.executable]
    command = [*command, os.path.join(EXAMPLES, script), "--losses", losses, *args]
    # In the run's own folder: Trainer makes its output_dir even when it saves nothing.
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=500, cwd=out, env=env)
    if expect_ok and result.returncode != 0:
        print(result.stdout[-6000:])
    check((result.returncode == 0) == expect_ok,
          f"{script} {' '.join(args)}: exit {result.returncode}, expected {'0' if expect_ok else 'an error'}")
    if not expect_ok:
        return None, None, result.stdout
    sums = set(re.findall(r"parameters checksum ([0-9a-f]+)", result.stdout))
    check(len(re.findall(r"parameters checksum", result.stdout)) == ranks
          and len(sums) == (1 if ranks_agree else ranks),
          f"{script}: {'every rank holds the same' if ranks_agree else 'each rank holds its own'} "
          f"parameters ({sums})")
    with open(losses) as f:
        curve = {int(k): v for k, v in json.load(f).items()}
    shutil.rmtree(out, ignore_errors=True)
    return curve, sums.pop() if ranks_agree else tuple(sorted(sums)), result.stdout


def close_to_ddp(name, ddp, morse, rel):
    check(sorted(ddp) == sorted(morse), f"{name}: the same steps logged")
    worst = max(abs(ddp[s] - morse[s]) / abs(ddp[s]) for s in ddp)
    print(f"{name}: {len(ddp)} steps, largest relative difference of the loss from DDP's {worst:.2e}")
    check(worst < rel, f"{name}: a loss differs from DDP's by {worst:.2e} (bound {rel:g})")


def converges_like_ddp(name, ddp, morse):
    last = sorted(ddp)[-5:]
    d, m = (sum(c[s] for s in last) / 5 for c in (ddp, morse))
    first = ddp[min(ddp)]
    print(f"{name}: loss {first:.3f} -> DDP {d:.3f}, Morse {m:.3f} (mean of the last 5 steps)")
    check(m < 0.5 * first and m <= 1.25 * d + 0.05, f"{name}: Morse's loss {m:.3f} is not within the "
          f"convergence margin of DDP's {d:.3f}")


def wrong_use():
    """Trainer and Accelerate clipping by one max_norm and the optimizer by
    another clip_grad_norm: refused at Trainer(...) and at the clip, naming
    the fix. Without the optimizer's clip_grad_norm, accelerator.clip_grad_norm_
    returns the (here one rank's) averaged gradient's norm and leaves .grad
    as it was (the step clips)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    import morse.torch
    from morse.torch.hf import MorseCallback
    os.environ["MORSE_INSECURE"] = "1"  # the shard below listens on loopback in plaintext
    config = tempfile.NamedTemporaryFile("w", suffix=".textproto", delete=False)
    config.write("workers: 1\nshards: 1\nexternal {}\n")
    config.close()
    gpt = GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    with server(config.name) as address:
        model = GPT2LMHeadModel(gpt)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=config.name, clip_grad_norm=0.5)
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True,
                                 max_grad_norm=1.0)
        try:
            Trainer(model=model, args=args, optimizers=(opt, None), callbacks=[MorseCallback()])
            check(False, "Trainer with max_grad_norm=1.0 and clip_grad_norm=0.5 was accepted")
        except ValueError as e:
            check("clip by one or the other" in str(e), f"the message says what to do: {e}")
            print(f"ok: ValueError: {e}")
        from accelerate import Accelerator
        import morse.torch.hf
        accelerator = Accelerator(cpu=True)
        model, opt = morse.torch.hf.prepare(accelerator, model, opt)
        model(torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long)).loss.backward()
        try:
            accelerator.clip_grad_norm_(model.parameters(), 1e-6)
            check(False, "accelerator.clip_grad_norm_ by another max_norm than clip_grad_norm was "
                  "accepted")
        except ValueError as e:
            check("clip by one or the other" in str(e), f"the message says what to do: {e}")
            print(f"ok: ValueError: {e}")
    with server(config.name) as address:
        model = GPT2LMHeadModel(gpt)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=config.name)
        # Trainer's device move copies the CPU parameters ("cpu" -> "cpu:0"):
        # MorseCallback points them back into the optimizer's buffer.
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True,
                                 max_grad_norm=1.0)
        Trainer(model=model, args=args, optimizers=(opt, None), callbacks=[MorseCallback()])
        for p, (lo, _) in zip(opt._params, opt._ranges):
            check(p.data_ptr() == opt._flat[lo:].data_ptr(), "the parameters live in the flat buffer")
        from accelerate import Accelerator
        import morse.torch.hf
        accelerator = Accelerator(cpu=True)
        model, opt = morse.torch.hf.prepare(accelerator, model, opt)
        model(torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 4, dtype=torch.long)).loss.backward()
        before = [p.grad.clone() for p in model.parameters()]
        own = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
        norm = accelerator.clip_grad_norm_(model.parameters(), 1e-6)
        check(abs(float(norm) - float(own)) <= 1e-5 * float(own),
              f"accelerator.clip_grad_norm_ returned {float(norm)}, the gradient's norm is {float(own)}")
        # .grad after the clip is the clipped average, as DDP's (one rank:
        # its own gradient, clipped).
        factor = min(1.0, 1e-6 / (float(own) + 1e-6))
        check(all(torch.allclose(p.grad, a * factor, rtol=1e-5, atol=0.0)
                  for a, p in zip(before, model.parameters())),
              "after accelerator.clip_grad_norm_ .grad holds the clipped gradient, as DDP's")
        opt.step()
    # MorseCallback with no Morse optimizer (neither optimizers= nor
    # optimizer_cls_and_kwargs=: Trainer builds its own AdamW): refused
    # when training begins, saying how to give one.
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, max_steps=1)
    data = [{"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}] * 8
    trainer = Trainer(model=GPT2LMHeadModel(gpt), args=args, train_dataset=data,
                      callbacks=[MorseCallback()])
    try:
        trainer.train()
        check(False, "MorseCallback trained with Trainer's own AdamW")
    except ValueError as e:
        check("optimizer_cls_and_kwargs=(morse.torch.AdamW" in str(e), f"the message says how: {e}")
        print(f"ok: ValueError: {e}")
    morse.torch._MorseOptimizer._finds_own_state_when_built = False
    accelerate_fp16(gpt, config.name)
    # fp8 is refused with what to do; fp16 trains (the part `fp16`, on a
    # GPU; DiLoCo's, alone and under --node-aggregation: test_diloco
    # `int8+amp` and `int8amp`). Trainer and Accelerate refuse fp16
    # themselves on a CPU, so the check is asked directly.
    from morse.torch.hf import _check_precision
    _check_precision("bf16")
    _check_precision("fp16")
    try:
        _check_precision("fp8")
        check(False, "mixed_precision='fp8' was accepted")
    except ValueError as e:
        check("use bf16" in str(e), f"the message says what to do: {e}")
        print(f"ok: ValueError: {e}")
    print("PASS: Trainer's and Accelerate's clipping against the optimizer's clip_grad_norm "
          "refused; parameters re-attached; accelerator.clip_grad_norm_ returns the norm and the "
          "step clips")


def accelerate_fp16(gpt, config):
    """Accelerate's fp16 path on the CPU: Accelerator(mixed_precision="fp16")
    makes its GradScaler on CUDA alone, so a CPU one stands in for it here
    (as it would be made there). Two steps: the first's gradients
    overflow (the step is skipped and the scale halved), the second's are
    finite: accelerator.clip_grad_norm_ unscales them first, as
    Accelerate's own does, and returns the unscaled gradient's norm, and
    the step is taken; step_was_skipped (which Trainer and the prepared
    schedulers read) says which step was skipped."""
    import torch
    from accelerate import Accelerator
    import morse.torch
    import morse.torch.hf
    with server(config) as address:
        model = GPT2LMHeadModel_of(gpt)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=config)
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)  # (this process made a float32 Accelerator before)
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        model, opt = morse.torch.hf.prepare(accelerator, model, opt)
        ids = torch.zeros(2, 4, dtype=torch.long)
        for step, blow_up in enumerate((True, False)):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            accelerator.backward(loss * math.inf if blow_up else loss)
            scale = accelerator.scaler.get_scale()
            want = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) / scale
                                                       for p in model.parameters()]))
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            # What Trainer and the prepared schedulers read to leave the lr
            # as it was (GradScaler calls a Morse optimizer's step() anyway).
            check(opt.step_was_skipped == blow_up and accelerator.optimizer_step_was_skipped == blow_up,
                  f"step {step}: step_was_skipped is {opt.step_was_skipped}")
            if blow_up:
                check(not math.isfinite(float(norm)), f"the overflowing step's norm is {float(norm)}")
                check(opt.optimizer.step_index == 0, "the overflowing step was taken")
                check(accelerator.scaler.get_scale() == scale / 2, "the scale did not back off")
            else:
                check(abs(float(norm) - float(want)) <= 1e-5 * float(want),
                      f"accelerator.clip_grad_norm_ returned {float(norm)}, the unscaled "
                      f"gradient's norm is {float(want)}")
                check(opt.optimizer.step_index == 1, "the finite step was not taken")
    print("ok: Accelerate's fp16 (a CPU GradScaler standing in for its CUDA one): the overflowing "
          "step skipped and reported so, accelerator.clip_grad_norm_ unscales first, the next "
          "step taken")


def GPT2LMHeadModel_of(gpt):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel(gpt)


def check_resume(name, script, args, out, launcher=()):
    """`script` with `args` (12 steps, a checkpoint every 6) into
    OUT/NAME-whole, then a fresh job resumed from a copy of its
    checkpoint-6 in OUT/NAME-resumed: the resumed run logs steps 7..12 with
    the whole run's losses and ends on its parameters. Returns the whole
    run's checkpoint-6 folder."""
    whole, whole_sum, _ = run(script, *args, "--output-dir", f"{out}/{name}-whole", launcher=launcher)
    checkpoint = f"{out}/{name}-whole/checkpoint-6"
    shutil.copytree(checkpoint, f"{out}/{name}-resumed/checkpoint-6")
    resumed, resumed_sum, _ = run(script, *args, "--resume", "--output-dir",
                                  f"{out}/{name}-resumed", launcher=launcher)
    check(sorted(resumed) == list(range(7, 13)),
          f"{name}: the resumed run logged steps 7..12 ({sorted(resumed)})")
    check(all(resumed[s] == whole[s] for s in resumed),
          f"{name}: the resumed run's losses differ from the whole run's")
    check(resumed_sum == whole_sum, f"{name}: the resumed run's parameters ({resumed_sum}) differ "
          f"from the whole run's ({whole_sum})")
    return checkpoint


def diloco(script, ddp):
    """morse.torch.DiLoCo over each rank's own AdamW (the stack's scheduler
    and clipping on the inner steps, no DDP wrap), a sync every 4 steps:
    learns (the mean loss of its last 5 of 40 steps below half the first;
    DDP's, `ddp`, printed beside it: the paper's outer step trails on runs
    this short, docs/convergence.md); the ranks end with
    one model at a sync (40 steps) and each with its own between syncs (14,
    two steps after the last), which a DDP wrap would have averaged; a run
    resumed from its checkpoint of step 6, between syncs (each rank's inner
    state and parameters its own, loaded from beside rank 0's), is
    bit-identical to the whole run; under Trainer also with the two ranks
    one node (--node-aggregation)."""
    args = ["--optimizer", "diloco", "--sync-every", "4"]
    loco, _, _ = run(script, *args, "--steps", "40")
    last = sorted(loco)[-5:]
    mean, first = sum(loco[s] for s in last) / 5, loco[min(loco)]
    print(f"{script} DiLoCo: loss {first:.3f} -> {mean:.3f} (mean of the last 5 steps; "
          f"DDP {sum(ddp[s] for s in last) / 5:.3f})")
    check(mean < 0.5 * first, f"{script} DiLoCo: its loss {mean:.3f} is not below half the first")
    _, apart, _ = run(script, *args, "--steps", "14", ranks_agree=False)
    out = tempfile.mkdtemp(prefix="morse-hf-diloco-")
    resume = [*args, "--steps", "12", "--save-steps", "6"]
    check_resume(f"{script[:-3]}-diloco", script, resume, out)
    if script == "hf_trainer.py":
        # The two ranks one DiLoCo worker (--node-aggregation: the node
        # averages each inner step's gradient, its leader syncs).
        check_resume("diloco-agg", script, resume, out, launcher=("--node-aggregation",))
    shutil.rmtree(out, ignore_errors=True)
    print(f"PASS: {script}: DiLoCo learns, the ranks' models apart between syncs "
          f"({', '.join(apart)} two steps after one), resumed between syncs bit-identically")


def check_saved_model(folder, checksum):
    """accelerator.save_model's file (written by rank 0 at the end) reloads
    into a fresh model with every parameter the trained one has (Accelerate
    took the parameters, views of the optimizer's flat buffer, for aliases
    and kept one of them)."""
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel
    sys.path.insert(0, EXAMPLES)
    from hf_trainer import model_config, parameters_checksum
    model = GPT2LMHeadModel(model_config())
    saved = load_file(os.path.join(folder, "model.safetensors"))
    missing, unexpected = model.load_state_dict(saved, strict=False)
    check(set(missing) <= {"lm_head.weight"} and not unexpected,  # lm_head is tied to wte
          f"accelerator.save_model wrote {len(saved)} tensors; missing {missing}")
    with torch.no_grad():
        reloaded = parameters_checksum(model)
    check(reloaded == checksum, f"the saved model ({reloaded}) is not the trained one ({checksum})")
    print(f"ok: accelerator.save_model wrote all {len(saved)} tensors; reloaded, the trained parameters")


def accelerate_launch():
    """`accelerate launch` as the job's launcher (torchrun's variables), the
    shard started apart and named by MORSE_SERVERS, as docs/python.md shows:
    the same OneBitAdam job as under morse-run, bit for bit (every step's
    loss and the parameters)."""
    args = ["--optimizer", "onebit_adam", "--steps", "12", "--freeze-step", "4"]
    # One thread a rank under both launchers (torchrun's default; morse-run's
    # share of this host's cores): the same kernels, the same bits.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    folder = tempfile.mkdtemp(prefix="morse-hf-launch-")
    config = os.path.join(folder, "job.textproto")
    with open(config, "w") as f:
        f.write(f"workers: {RANKS}\nshards: 1\nexternal {{}}\n")
    with server(config) as address:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                  "--num_processes", str(RANKS), "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no", "--main_process_port", str(free_port())]
        launched, launched_sum, log = run(
            "accelerate_loop.py", *args, command=launch,
            env=dict(env, MORSE_SERVERS=address, MORSE_CONFIG=config, MORSE_INSECURE="1"))
    shutil.rmtree(folder, ignore_errors=True)
    check(log.count("Morse step 12") == RANKS, "every rank took 12 Morse steps")
    under_run, run_sum, _ = run("accelerate_loop.py", *args, shards=1, env=env)
    check(launched == under_run and launched_sum == run_sum,
          f"accelerate launch's job differs from morse-run's: {launched_sum} vs {run_sum}")
    print(f"PASS: accelerate launch with the shard started apart: {len(launched)} OneBitAdam steps, "
          "bit-identical to the same job under morse-run")


def main():
    try:
        import accelerate  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: {sys.executable} has no transformers/accelerate/peft ({e}); the torch2_hf_* tests "
              "run this in the torch 2.x venv (tests/python/torch2-venv.sh)")
        sys.exit(77)
    parts = {"setup": setup, "trainer": lambda: one_stack("hf_trainer.py"),
             "accelerate": lambda: one_stack("accelerate_loop.py"), "diloco": diloco_both, "groups": groups,
             "resume": resume, "fp16": fp16}
    chosen = sys.argv[1:] or list(parts)
    unknown = [p for p in chosen if p not in parts]
    if unknown:
        sys.exit(f"test_hf.py: no part {', '.join(unknown)}; the parts are {', '.join(parts)} (none: all)")
    for part in chosen:
        parts[part]()


# The fp32 runs' arguments: 12 steps of 2 accumulated micro-batches,
# clipped at 1.0 by the stack (Trainer's max_grad_norm,
# accelerator.clip_grad_norm_).
FP32 = ["--steps", "12", "--accumulation", "2", "--max-grad-norm", "1.0"]


def setup():
    wrong_use()
    accelerate_launch()


def one_stack(script):
    """fp32 Adam against DDP (and bf16), Trainer's compile and activation
    checkpointing, and OneBitAdam's convergence, under one stack."""
    ddp, _, _ = run(script, "--optimizer", "ddp", *FP32)
    saved = tempfile.mkdtemp(prefix="morse-hf-model-")
    adam, adam_sum, _ = run(script, "--optimizer", "adam", *FP32,
                            *(["--save-model", saved] if script == "accelerate_loop.py" else []))
    close_to_ddp(f"{script} Adam", ddp, adam, 1e-5)
    if script == "accelerate_loop.py":
        check_saved_model(saved, adam_sum)
    shutil.rmtree(saved, ignore_errors=True)
    # bf16 mixed precision (Trainer's bf16=True, Accelerator's
    # mixed_precision="bf16"): the forward under autocast, as
    # Accelerate's prepare gives DDP's model. The first step's loss
    # (the weights as built) is DDP's bit for bit and not float32's
    # (autocast ran); the rest within bf16's rounding of DDP's.
    ddp16, _, _ = run(script, "--optimizer", "ddp", *FP32, "--bf16")
    adam16, _, _ = run(script, "--optimizer", "adam", *FP32, "--bf16")
    first = min(ddp16)
    check(adam16[first] == ddp16[first],
          f"{script} bf16: the first step's loss {adam16[first]!r} is not DDP's {ddp16[first]!r}")
    check(adam16[first] != adam[first],
          f"{script} bf16: the first step's loss is float32's ({adam[first]!r}): no autocast")
    close_to_ddp(f"{script} Adam bf16", ddp16, adam16, 1e-3)
    if script == "hf_trainer.py":
        # Trainer's torch_compile: compiled in place (Accelerate would
        # compile only a model it wraps), the same bits as eager with
        # aot_eager (test_torch_compile).
        compiled, compiled_sum, log = run(script, "--optimizer", "adam", *FP32, "--compile", "aot_eager")
        check(log.count("(compiled in place)") == RANKS, "every rank's model was compiled")
        check(compiled == adam and compiled_sum == adam_sum,
              "Trainer with torch_compile (aot_eager) differs from eager")
        print("ok: Trainer's torch_compile=True (aot_eager) compiles in place, bit-identical to eager")
        # Activation checkpointing: the layers' forward again inside
        # backward(), whose hooks then fire in the recomputation.
        again, again_sum, log = run(script, "--optimizer", "adam", *FP32, "--activation-checkpointing")
        check(log.count("(activation checkpointing)") == RANKS, "every rank checkpointed")
        check(again == adam and again_sum == adam_sum,
              "Trainer with activation_checkpointing differs from the same run without")
        print("ok: Trainer's activation_checkpointing=True, bit-identical to the run without")
    onebit = ["--steps", "40", "--freeze-step", "10"]
    ddp, _, _ = run(script, "--optimizer", "ddp", *onebit)
    one, _, _ = run(script, "--optimizer", "onebit_adam", *onebit)
    converges_like_ddp(f"{script} OneBitAdam", ddp, one)
    print(f"PASS: {script}: fp32 Adam equals DDP's losses; OneBitAdam converges like DDP")


def fp16():
    """fp16 mixed precision (Trainer's fp16=True, Accelerator's
    mixed_precision="fp16": autocast and the stack's own GradScaler) over
    morse.torch.Adam against the stack's AdamW, on a GPU (the stacks run
    fp16 on CUDA alone; without a GPU this part is skipped, saying so).
    One rank: two would share the one GPU, where the stacks' DDP (NCCL)
    refuses them; the job's verdict over ranks is test_grad_scaler's. The
    first step's loss is the stack's bit for bit (the same autocast
    forward), every step's within 1e-3 (the same steps skipped: a step
    taken by one and skipped by the other moves the loss more)."""
    from harness import has_cuda
    if not has_cuda("fp16 under Trainer and Accelerate"):
        if sys.argv[1:] == ["fp16"]:
            sys.exit(77)  # (ctest: skipped)
        return
    for script in ("hf_trainer.py", "accelerate_loop.py"):
        ddp, _, _ = run(script, "--optimizer", "ddp", *FP32, "--fp16", ranks=1, shards=1)
        adam, _, log = run(script, "--optimizer", "adam", *FP32, "--fp16", ranks=1, shards=1)
        first = min(ddp)
        check(adam[first] == ddp[first],
              f"{script} fp16: the first step's loss {adam[first]!r} is not the stack's {ddp[first]!r}")
        close_to_ddp(f"{script} Adam fp16", ddp, adam, 1e-3)
    print("PASS: fp16 under Trainer and Accelerate: their GradScaler drives morse.torch.Adam, "
          "the losses the stacks' own AdamW's")


def diloco_both():
    for script in ("hf_trainer.py", "accelerate_loop.py"):
        ddp, _, _ = run(script, "--optimizer", "ddp", "--steps", "40", "--freeze-step", "10")
        diloco(script, ddp)


def groups():
    # Trainer's weight decay: its AdamW under DDP decays every parameter but
    # biases and norms (two groups); the example gives a Morse optimizer the
    # same two groups. fp32 Adam equals DDP's losses; OneBitLamb (the BERT
    # recipe, at LAMB's larger lr) and ZeroOneAdam converge like DDP.
    decay = ["--weight-decay", "0.01"]
    ddp, _, _ = run("hf_trainer.py", "--optimizer", "ddp", *FP32, *decay)
    adam, _, _ = run("hf_trainer.py", "--optimizer", "adam", *FP32, *decay)
    close_to_ddp("hf_trainer.py Adam with weight-decay groups", ddp, adam, 1e-5)
    # Trainer building the optimizer itself from a class and its arguments
    # (optimizer_cls_and_kwargs=(morse.torch.AdamW, ...)), with its own
    # decay / no-decay groups: the same losses; and a OneBitAdam run so
    # built, resumed from its checkpoint (rank 0's optimizer.pt loaded into
    # the optimizer Trainer built, before MorseCallback sees it), is
    # bit-identical to the whole run.
    built, _, _ = run("hf_trainer.py", "--optimizer", "adam", "--built-by-trainer", *FP32, *decay)
    close_to_ddp("hf_trainer.py AdamW built by Trainer (optimizer_cls_and_kwargs)", ddp, built, 1e-5)
    out = tempfile.mkdtemp(prefix="morse-hf-built-")
    check_resume("built", "hf_trainer.py", ["--steps", "12", "--freeze-step", "4", "--save-steps", "6",
                                             "--built-by-trainer", *decay], out)
    shutil.rmtree(out, ignore_errors=True)
    longer = ["--steps", "60", "--freeze-step", "15"]  # LAMB starts slower, then passes AdamW
    ddp, _, _ = run("hf_trainer.py", "--optimizer", "ddp", *longer, *decay)
    lamb, _, _ = run("hf_trainer.py", "--optimizer", "onebit_lamb", "--lr", "0.1", *longer, *decay)
    converges_like_ddp("hf_trainer.py OneBitLamb with weight-decay groups", ddp, lamb)
    # ZeroOneAdam with the same groups (each its own local steps and lr sum;
    # DeepSpeed's defaults sync every step after the freeze here).
    zero_one, _, _ = run("hf_trainer.py", "--optimizer", "zero_one_adam", *longer, *decay)
    converges_like_ddp("hf_trainer.py ZeroOneAdam with weight-decay groups", ddp, zero_one)

    # LoRA (peft's get_peft_model): the model's own weights frozen, out of
    # the optimizer, the adapters trained. fp32 Adam equals DDP's losses;
    # a OneBitAdam run resumed from its step-6 checkpoint (Trainer loads the
    # adapters with peft's load_adapter) is bit-identical to the whole run.
    # Rank 1: 1408 adapter elements, too few for a block of 2048 on each
    # of the 2 shards, so the job's default block is 1024 (such a model was
    # refused).
    lora = ["--lora", "1", "--lr", "0.05"]
    ddp, _, _ = run("hf_trainer.py", "--optimizer", "ddp", *FP32, *lora)
    adam, _, _ = run("hf_trainer.py", "--optimizer", "adam", *FP32, *lora)
    close_to_ddp("hf_trainer.py Adam on LoRA adapters", ddp, adam, 1e-5)
    out = tempfile.mkdtemp(prefix="morse-hf-lora-")
    common = ["--steps", "12", "--freeze-step", "4", "--save-steps", "6", *lora]
    checkpoint = check_resume("lora", "hf_trainer.py", common, out)
    check(os.path.isfile(f"{checkpoint}/adapter_model.safetensors"),
          "the LoRA checkpoint holds the adapters")
    shutil.rmtree(out, ignore_errors=True)
    print("PASS: LoRA adapters under Trainer: fp32 Adam equals DDP's losses; a OneBitAdam run "
          "resumed from its checkpoint is bit-identical to the whole run")



def resume():
    import torch
    # Resume: checkpoints at steps 6 and 12 of a OneBitAdam run frozen at 4
    # (the worker error buffers matter); a fresh job resumes from step 6.
    out = tempfile.mkdtemp(prefix="morse-hf-resume-")
    common = ["--steps", "12", "--freeze-step", "4", "--save-steps", "6"]
    checkpoint = check_resume("trainer", "hf_trainer.py", common, out)
    for name in ("optimizer.pt", "morse-rank-0.pt", "morse-rank-1.pt"):
        check(os.path.isfile(f"{checkpoint}/{name}"), f"checkpoint-6 has {name}")
    shutil.copytree(checkpoint, f"{out}/lost/checkpoint-6")
    # ZeroOneAdam saved inside a local interval (past var_freeze_step 2 the
    # intervals are 1, 2, then 4 steps: step 6 falls between the syncs of
    # steps 4 and 8, each rank on its own parameters): every rank's own
    # state beside the checkpoint holds them, and the resumed run, through
    # the syncs of steps 8 and 12, is the whole run's.
    zero_one = ["--optimizer", "zero_one_adam", "--steps", "12", "--freeze-step", "2",
                "--local-step-scaler", "1", "--local-step-clipper", "4", "--save-steps", "6"]
    checkpoint = check_resume("zero-one", "hf_trainer.py", zero_one, out)
    saved = [torch.load(f"{checkpoint}/morse-rank-{r}.pt", weights_only=True)["state"]
             for r in range(2)]
    check(all(s.get("inside_interval") == [6, 4] for s in saved)
          and not torch.equal(saved[0]["interval_x"], saved[1]["interval_x"]),
          "zero-one: checkpoint-6 was saved inside an interval, each rank on its own parameters")
    # And under --node-aggregation: the leader's state holds the interval,
    # rank 1's the node's parameters (rank 0's file given to it by Trainer,
    # it finds its own).
    check_resume("zero-one-agg", "hf_trainer.py", zero_one, out, launcher=("--node-aggregation",))
    # The same with one Morse worker for the two ranks (--node-aggregation):
    # rank 1 holds no optimizer state, its file only the step.
    check_resume("agg", "hf_trainer.py", common, out, launcher=("--node-aggregation",))
    os.remove(f"{out}/lost/checkpoint-6/morse-rank-1.pt")
    _, _, log = run("hf_trainer.py", *common, "--resume", "--output-dir", f"{out}/lost", expect_ok=False)
    check("this rank's own, morse-rank-1.pt, is in none of" in log, "rank 1 names the state it lacks")
    shutil.rmtree(out, ignore_errors=True)
    print("PASS: a Trainer run resumed from its checkpoint is bit-identical to the whole run "
          "(ZeroOneAdam's too, saved inside a local interval, with and without "
          "--node-aggregation); a missing rank state is named")

    # A Trainer run of DDP + AdamW, saved at step 6 (its optimizer.pt
    # torch's per-parameter state), resumed with morse.torch.Adam instead:
    # steps 7..12 as DDP's own (Trainer's two groups: --weight-decay), and
    # OneBitAdam frozen at 4 goes on from AdamW's moments in 1-bit steps,
    # every rank alike (run() checks).
    # The same through Accelerate's save_state / load_state (its
    # optimizer.bin AdamW's state; the model's safetensors).
    swap = ["--steps", "12", "--save-steps", "6", "--weight-decay", "0.01"]
    for script in ("hf_trainer.py", "accelerate_loop.py"):
        out = tempfile.mkdtemp(prefix="morse-hf-from-ddp-")
        ddp, _, _ = run(script, "--optimizer", "ddp", *swap, "--output-dir", f"{out}/ddp")
        for optimizer in ("adam", "onebit_adam"):
            shutil.copytree(f"{out}/ddp/checkpoint-6", f"{out}/{optimizer}/checkpoint-6")
            resumed, _, log = run(script, "--optimizer", optimizer, "--freeze-step", "4", *swap,
                                  "--resume", "--output-dir", f"{out}/{optimizer}")
            check(sorted(resumed) == list(range(7, 13)),
                  f"{script} {optimizer} from DDP's checkpoint logged steps 7..12 ({sorted(resumed)})")
            if optimizer == "adam":
                close_to_ddp(f"{script}: Adam going on from DDP + AdamW's checkpoint",
                             {s: ddp[s] for s in resumed}, resumed, 1e-5)
            else:  # (what it loads is test_torch_state's; here that the stack's resume takes it)
                worst = max(abs(ddp[s] - resumed[s]) / ddp[s] for s in resumed)
                print(f"{script}: OneBitAdam from DDP + AdamW's checkpoint: 6 steps, every rank "
                      f"alike, losses within {worst:.2e} of DDP's")
        shutil.rmtree(out, ignore_errors=True)
    print("PASS: Trainer and Accelerate resume DDP + AdamW's checkpoint with morse.torch.Adam (as "
          "DDP goes on) and OneBitAdam")

    # Accelerate's save_state / load_state: optimizer.bin is rank 0's state,
    # every other rank's lies beside it, and the weights are saved whole
    # (Accelerate took the parameters, views of one flat buffer, for
    # aliases and kept one of them) and loaded (safetensors' load_model
    # refused them).
    out = tempfile.mkdtemp(prefix="morse-hf-accelerate-resume-")
    checkpoint = check_resume("accelerate", "accelerate_loop.py", common, out)
    saved = sorted(os.listdir(checkpoint))
    check({"optimizer.bin", "model.safetensors", "morse-rank-1.pt"} <= set(saved)
          and "morse-rank-0.pt" not in saved, f"checkpoint-6 holds {saved}")
    shutil.copytree(checkpoint, f"{out}/lost/checkpoint-6")
    os.remove(f"{out}/lost/checkpoint-6/morse-rank-1.pt")
    _, _, log = run("accelerate_loop.py", *common, "--resume", "--output-dir", f"{out}/lost",
                    expect_ok=False)
    check("morse-rank-1.pt, is not there" in log, "rank 1 names the state it lacks")
    # ZeroOneAdam saved between two syncs (as in resume()): each rank's
    # parameters and interval in its own file, found again by load_state.
    checkpoint = check_resume(
        "accelerate-zero-one", "accelerate_loop.py",
        ["--optimizer", "zero_one_adam", "--steps", "12", "--freeze-step", "2",
         "--local-step-scaler", "1", "--local-step-clipper", "4", "--save-steps", "6"], out)
    saved = torch.load(f"{checkpoint}/morse-rank-1.pt", weights_only=True)["state"]
    check(saved.get("inside_interval") == [6, 4] and "interval_x" in saved,
          "accelerate-zero-one: checkpoint-6 was saved inside an interval")
    shutil.rmtree(out, ignore_errors=True)
    print("PASS: an Accelerate loop resumed with load_state from its save_state is bit-identical "
          "to the whole run (ZeroOneAdam's too, saved inside a local interval); a missing rank "
          "state is named")


if __name__ == "__main__":
    main()
