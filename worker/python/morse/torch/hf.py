"""Morse optimizers under Hugging Face Trainer and Accelerate.

Trainer: pass the optimizer and MorseCallback, and nothing else changes:

    model = AutoModelForCausalLM.from_config(config).to(args.device)
    opt = morse.torch.OneBitAdam(model.parameters(), lr=args.learning_rate)
    trainer = Trainer(model=model, args=args, train_dataset=...,
                      optimizers=(opt, None), callbacks=[MorseCallback()])

or let Trainer build it over its decay / no-decay parameter groups:

    trainer = Trainer(model=model, args=args, train_dataset=...,
                      optimizer_cls_and_kwargs=(morse.torch.AdamW,
                                                dict(lr=args.learning_rate)),
                      callbacks=[MorseCallback()])

morse.torch.DiLoCo (over any torch inner optimizer) takes the place of
opt the same way; the stack's scheduler and clipping then take each rank's
inner steps.

Accelerate: prepare through morse.torch.hf.prepare instead of
accelerator.prepare:

    model, opt, loader = morse.torch.hf.prepare(accelerator, model, opt, loader)

Clipping needs nothing more: Trainer's max_grad_norm and the loop's
accelerator.clip_grad_norm_ end in torch.nn.utils.clip_grad_norm_, which a
Morse optimizer's parameters take to morse.torch.clip_grad_norm_: it
returns the averaged gradient's norm and the step clips the average, as
DDP's clip after backward() does (each rank's own gradient in a
compression phase, design.md 2.6).

Under `morse-run` (which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
as torchrun does) both stacks see a distributed job, start a gloo process
group for their own bookkeeping, shard the data by rank and would wrap the
model in DistributedDataParallel. Morse averages the gradients itself, so
the model is kept out of DDP (else every gradient would be all-reduced
twice). The callback also

- runs the forward under autocast for bf16 and fp16 (Trainer's
  bf16=True or fp16=True, Accelerator(mixed_precision="bf16" or "fp16")),
  as Accelerate's prepare does for the models it wraps; the parameters and
  gradients stay float32. fp16's loss scaling is the stack's own
  torch.amp.GradScaler, which drives a Morse optimizer as it drives DDP
  (the job skips an overflowing step on every rank; design.md 2.12);
- turns Trainer's clipping off when the optimizer clips by its own
  clip_grad_norm (which must then equal max_grad_norm), so that the step
  is not clipped twice;
- saves every rank's optimizer state beside each checkpoint
  (checkpoint-N/morse-rank-R.pt: its worker error buffer is its own, and
  between two of ZeroOneAdam's syncs its parameters too), and on
  resume loads this rank's own where Trainer loads rank 0's optimizer.pt
  on every rank, so a resumed run is bit-identical to an uninterrupted one.

Under Accelerate, prepare does the same for accelerator.save_state and
load_state (morse-rank-R.pt beside optimizer.bin), and the forward's bf16
autocast.

Importing this module imports transformers (the callback's base class);
accelerate is imported where it is used. The versions tested are pinned in
tests/python/torch2-venv.sh.
"""
import os

import torch

from . import _MorseOptimizer

__all__ = ["MorseCallback", "prepare", "keep_out_of_ddp"]

RANK_STATE = "morse-rank-{rank}.pt"


def _morse_optimizer(optimizer):
    """The Morse optimizer (or DiLoCo) inside Accelerate's wrapper, or None."""
    from .diloco import DiLoCo
    kinds = (_MorseOptimizer, DiLoCo)
    seen = 0
    while optimizer is not None and not isinstance(optimizer, kinds) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, kinds) else None


def _is_diloco(opt):
    from .diloco import DiLoCo
    return isinstance(opt, DiLoCo)


def _state_device(opt):
    """Where `opt`'s state_dict() keeps its tensors (torch.load's map_location)."""
    return opt.device if _is_diloco(opt) else opt._flat.device


def _attach_model(model, opt):
    """Makes sure the optimizer trains this model's parameters in place.
    Trainer moves the model to args.device, and on the CPU that is a copy
    (torch copies a tensor on "cpu" to "cpu:0"): a parameter copied with
    every bit kept is pointed back into the optimizer's flat buffer; any
    other change is refused. DiLoCo's parameters are the model's own
    tensors (its inner optimizer's), which a move keeps."""
    ids = {id(p) for p in model.parameters()}
    if not any(id(p) in ids for p in opt._params):
        raise ValueError("the Morse optimizer was not built from this model's parameters")
    if _is_diloco(opt):
        return
    with torch.no_grad():
        for i, (name, p, (lo, hi)) in enumerate(zip(opt._names, opt._params, opt._ranges)):
            view = opt._flat[lo:hi]
            if p.data_ptr() == view.data_ptr():
                continue
            if (p.device.type != view.device.type or p.dtype != view.dtype or p.numel() != hi - lo
                    or not torch.equal(p.detach().reshape(-1).view(torch.int32), view.view(torch.int32))):
                raise ValueError(
                    f"{name} no longer lives in the Morse optimizer's flat buffer (it is on "
                    f"{p.device}, the optimizer's on {opt._flat.device}): the model was moved, cast "
                    "or reloaded after the optimizer was built. Move the model to its device "
                    "(model.to(args.device)) and load its weights first, then build the optimizer")
            p.data = view.view_as(p)
            p.grad = opt._flat_grad[lo:hi].view_as(p)
            # Pointing .data back is not an in-place change of the parameter
            # (the others keep their versions: a change before still counts).
            opt._x_versions[i] = p._version


def keep_out_of_ddp(model, autocast_handler=None):
    """Marks `model` so that Accelerate's prepare() leaves it as it is:
    no DistributedDataParallel wrapper (Morse averages the gradients), no
    device move, no torch.compile (compiled here in place instead, when
    Accelerate is set to compile: Trainer's torch_compile,
    Accelerator(dynamo_backend=...)). bf16 and fp16 mixed precision
    (Trainer's bf16=True or fp16=True, Accelerator(mixed_precision=...))
    is applied here as
    Accelerate's prepare applies it: the forward runs under torch.autocast
    (`autocast_handler`: the Accelerator's AutocastKwargs, if any) and its
    outputs come back in float32; the parameters and gradients stay
    float32, the optimizer's (see _check_precision).
    Returns it."""
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import DynamoBackend
    # The Accelerator's settings (Trainer has made its own by now).
    state = AcceleratorState() if is_initialized() else None
    precision = str(getattr(state, "mixed_precision", None) or "no")
    _check_precision(precision)
    plugin = getattr(state, "dynamo_plugin", None)
    compiled = getattr(model, "_compiled_call_impl", None) is not None
    if plugin is not None and plugin.backend != DynamoBackend.NO and not compiled:
        model.compile(**plugin.to_kwargs())  # in place: the parameters stay Morse's
    if precision in ("bf16", "fp16") and "_original_forward" not in model.__dict__:
        _autocast_forward(model, autocast_handler)
    model._is_accelerate_prepared = True
    return model


def _check_precision(precision):
    """ValueError for a mixed precision ("no", "bf16", "fp16", ...) Morse
    does not train with under these stacks: fp8. (fp16's GradScaler,
    torch.amp's or before torch 2.3 torch.cuda.amp's, tells a Morse
    optimizer at scale().)"""
    if precision in ("no", "bf16", "fp16"):
        return
    raise ValueError(
        f"mixed_precision={precision!r}: Morse trains under 'no', 'bf16' and 'fp16' (fp16 with "
        "torch.amp.GradScaler); use bf16 (Trainer's bf16=True, "
        "Accelerator(mixed_precision='bf16')), or float32")


def _autocast_forward(model, autocast_handler):
    """model.forward under Accelerate's autocast context for bf16, its
    outputs converted to float32: what Accelerator.prepare_model does for
    a model it prepares (and unwrap_model undoes, by _original_forward)."""
    from types import MethodType
    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.modeling import get_mixed_precision_context_manager
    autocast = get_mixed_precision_context_manager(True, autocast_handler)
    model._original_forward = model.forward
    bound = hasattr(model.forward, "__func__")
    wrapped = convert_outputs_to_fp32(autocast(model.forward.__func__ if bound else model.forward))
    model.forward = MethodType(wrapped, model) if bound else wrapped


def prepare(accelerator, *objects):
    """accelerator.prepare(*objects) for a job whose optimizer is a Morse
    one: the models among `objects` stay out of DDP (keep_out_of_ddp) and
    must already be on their device; the rest (the optimizer, data loaders
    sharded by rank, schedulers) is prepared as Accelerate does."""
    opts = [o for o in objects if _morse_optimizer(o) is not None]
    if len(opts) != 1:
        raise ValueError(f"morse.torch.hf.prepare needs exactly one Morse optimizer among the "
                         f"objects; got {len(opts)}")
    opt = _morse_optimizer(opts[0])
    _check_precision(str(getattr(accelerator, "mixed_precision", None) or "no"))
    flat = not _is_diloco(opt)  # parameters that are views of one flat buffer
    for o in objects:
        if isinstance(o, torch.nn.Module):
            _attach_model(o, opt)
            keep_out_of_ddp(o, accelerator.autocast_handler)
            if flat:
                _copies_for_safetensors(o, opt)
    if flat:
        # (DiLoCo's inner steps clip each rank's own gradient: Accelerate's
        # own clip, as the script's torch.nn.utils.clip_grad_norm_.)
        _route_clipping(accelerator, opt)
    _checkpoint_each_rank(accelerator, opt)
    _install_skip_report()
    return accelerator.prepare(*objects)


def _install_skip_report():
    """fp16: Accelerate learns that GradScaler skipped a step from the
    optimizer's step() not being called (AcceleratedOptimizer's
    step_was_skipped, which Trainer and Accelerate's prepared schedulers
    read to leave the learning rate where it was, as under DDP). GradScaler
    calls a Morse optimizer's step() (and DiLoCo's) every time
    (_step_supports_amp_scaling), which skips inside; so for those
    step_was_skipped reads what their last step() did (once, for every
    AcceleratedOptimizer)."""
    from accelerate.optimizer import AcceleratedOptimizer
    original = AcceleratedOptimizer.step_was_skipped
    if getattr(original.fget, "morse", False):
        return

    def step_was_skipped(self):
        opt = _morse_optimizer(self.optimizer)
        if opt is not None and self.scaler is not None:
            return opt._skipped_last
        return original.fget(self)

    step_was_skipped.__doc__ = original.__doc__
    step_was_skipped.morse = True
    AcceleratedOptimizer.step_was_skipped = property(step_was_skipped)


def _checkpoint_each_rank(accelerator, opt):
    """accelerator.save_state / load_state with a Morse optimizer.
    Accelerate saves the main process's optimizer.state_dict() (each node's
    with save_on_each_node) and loads that file on every rank, but a rank's
    worker error buffer is its own. So every rank whose state Accelerate
    does not write saves its own beside it (RANK_STATE, as MorseCallback
    does for Trainer), and a rank that load_state gives another rank's
    state loads its own from the same folder instead.

    The model's weights need copies both ways: a Morse optimizer's
    parameters are views of its flat buffer, one storage, which Accelerate's
    safetensors save takes for tensors aliasing each other (save_state and
    save_model kept one parameter and dropped the rest, with a warning)
    and safetensors' load_model refuses ("None is covering the entire
    storage"). accelerator.get_state_dict, which both saves call, gives
    copies (a tied parameter one copy, dropped once as for any tied model),
    and the load reads copies (_copies_for_safetensors)."""
    opt._finds_own_state = True
    original = accelerator.get_state_dict

    def writes():
        """Whether Accelerate's saves write files in this process."""
        each_node = getattr(accelerator.project_configuration, "save_on_each_node", False)
        return accelerator.is_local_main_process if each_node else accelerator.is_main_process

    def get_state_dict(model, unwrap=True):
        state = original(model, unwrap=unwrap)
        return _copied(state, opt._flat) if writes() else state  # (no copy where nothing is written)

    if not _is_diloco(opt):  # (DiLoCo's parameters are the model's own tensors)
        accelerator.get_state_dict = get_state_dict

    def save(models, weights, output_dir):
        if writes():
            return  # its optimizer.bin is its own
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, RANK_STATE.format(rank=opt.rank))
        torch.save(opt.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def load(models, input_dir):
        opt._own_state_file = os.path.join(input_dir, RANK_STATE.format(rank=opt.rank))
        from accelerate.utils.constants import SAFE_MODEL_NAME
        for i, model in enumerate(models):
            name = f"{SAFE_MODEL_NAME}{f'_{i}' if i else ''}.safetensors"
            if os.path.isfile(os.path.join(input_dir, name)) and hasattr(model, "_morse_copies_once"):
                model._morse_copies_once = True  # load_model reads its state_dict() once

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def _copied(state_dict, flat):
    """Replaces in `state_dict` each tensor that is a view of `flat` by a
    copy in host memory (what a save writes; no device memory taken),
    views of the same elements by one copy (tied parameters stay tied).
    Returns it."""
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    copies = {}
    for name, value in state_dict.items():
        if torch.is_tensor(value) and value.device == flat.device and start <= value.data_ptr() < end:
            key = (value.data_ptr(), value.numel())
            if key not in copies:
                copies[key] = value.detach().to("cpu", copy=True)
            state_dict[name] = copies[key]
    return state_dict


def _copies_for_safetensors(model, opt):
    """The load side of _checkpoint_each_rank: safetensors' load_model
    (Accelerate's load_state) reads the model's state_dict() once, to find
    tied parameters, and copies the file's values into the parameters
    themselves; that one state_dict() gives copies (the load hook sets
    model._morse_copies_once)."""
    def hook(module, state_dict, prefix, local_metadata):
        if prefix or not module._morse_copies_once:
            return None
        module._morse_copies_once = False
        return _copied(state_dict, opt._flat)

    model._morse_copies_once = False
    model._register_state_dict_hook(hook)


def _route_clipping(accelerator, opt):
    """accelerator.clip_grad_norm_ on the Morse optimizer's parameters: as
    torch.nn.utils.clip_grad_norm_ (morse.torch.clip_grad_norm_, the
    averaged gradient's, clipped in step()) once fp16's GradScaler has
    unscaled them, as Accelerate's does; for an optimizer built with
    clip_grad_norm, which clips inside step() already, it leaves the
    gradients alone and returns this rank's own gradient's norm (the
    average's is in opt.last_step["grad_norm"] after step()), and must be
    asked for that max_norm. Other parameters are clipped as Accelerate
    does."""
    original = accelerator.clip_grad_norm_
    ours = {id(p) for p in opt._params}

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        mine = [p for p in parameters if id(p) in ours]
        if not mine:
            return original(parameters, max_norm, norm_type)
        if len(mine) != len([p for p in parameters if p.requires_grad]):
            raise ValueError("accelerator.clip_grad_norm_ over the Morse optimizer's parameters and "
                             "others at once: clip them apart")
        # fp16: the gradients unscaled first (once a step), as Accelerate's
        # own clip does.
        accelerator.unscale_gradients()
        if opt.clip_grad_norm is None:
            return torch.nn.utils.clip_grad_norm_(mine, max_norm, norm_type=norm_type)
        grads = [p.grad for p in mine if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type)
                                                     for g in grads]), norm_type)
        if float(max_norm) == float("inf"):
            return norm  # nothing to clip: the norm alone, as for logging
        if float(norm_type) != 2.0 or float(opt.clip_grad_norm) != float(max_norm):
            raise ValueError(
                f"accelerator.clip_grad_norm_(..., max_norm={max_norm}, norm_type={norm_type}) on a "
                f"Morse optimizer that clips by its own clip_grad_norm={opt.clip_grad_norm} (the "
                "averaged gradient's L2 norm, inside step()): clip by one or the other (build the "
                "optimizer without clip_grad_norm, and accelerator.clip_grad_norm_ clips the "
                "averaged gradient as under DDP)")
        return norm

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _callback_base():
    from transformers import TrainerCallback
    return TrainerCallback


class MorseCallback(_callback_base()):
    """A Trainer callback for a Morse optimizer (see the module's doc): one
    given as Trainer(optimizers=(opt, None)), or one Trainer builds itself
    from Trainer(optimizer_cls_and_kwargs=(morse.torch.AdamW, {...})) with
    its decay / no-decay parameter groups."""

    def __init__(self):
        self.opt = None

    def _optimizer(self, optimizer):
        opt = _morse_optimizer(optimizer)
        if opt is None:
            raise ValueError("MorseCallback needs a Morse optimizer: Trainer(..., "
                             "optimizers=(morse.torch.OneBitAdam(model.parameters(), ...), None), "
                             "callbacks=[MorseCallback()]), Trainer(..., optimizer_cls_and_kwargs="
                             "(morse.torch.AdamW, dict(lr=...)), callbacks=[MorseCallback()]), or "
                             "morse.torch.DiLoCo(model, torch.optim.AdamW(model.parameters(), ...), "
                             "sync_every=...)")
        self.opt = opt
        return opt

    def on_init_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(args, "fp16", False):
            _check_precision("fp16")
            _install_skip_report()
        if optimizer is None:
            # Trainer builds the optimizer in train() (optimizer_cls_and_kwargs),
            # after it has moved the model, and loads a checkpoint's state into
            # it before on_train_begin: a Morse optimizer built from here on
            # keeps another rank's state aside, as _use() sets.
            _MorseOptimizer._finds_own_state_when_built = True
            if model is not None:
                keep_out_of_ddp(model)
            return control
        opt = self._optimizer(optimizer)
        if model is not None:
            _attach_model(model, opt)
            keep_out_of_ddp(model)  # with Trainer's bf16 or fp16 autocast
        self._use(args, opt)
        return control

    def _use(self, args, opt):
        """Trainer's clipping and checkpoints with the Morse optimizer."""
        max_norm = float(getattr(args, "max_grad_norm", 0) or 0)
        # (DiLoCo has no clip of its own: Trainer's clips each rank's own
        # gradient for its inner step.)
        if max_norm > 0 and getattr(opt, "clip_grad_norm", None) is not None:
            # Trainer's clip ends in morse.torch.clip_grad_norm_ (the averaged
            # gradient's, as under DDP); an optimizer that clips by its own
            # clip_grad_norm would clip the step twice.
            if float(opt.clip_grad_norm) != max_norm:
                raise ValueError(
                    f"Trainer clips by max_grad_norm={max_norm:g} and the Morse optimizer by its "
                    f"own clip_grad_norm={opt.clip_grad_norm}: clip by one or the other (build the "
                    "optimizer without clip_grad_norm, and Trainer's clip_grad_norm_ clips the "
                    "averaged gradient as under DDP)")
            args.max_grad_norm = 0.0  # the optimizer clips
        opt._finds_own_state = True

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        opt = self._optimizer(optimizer or self.opt)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, RANK_STATE.format(rank=opt.rank))
        torch.save(opt.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
        return control

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        built_by_trainer = self.opt is None  # (optimizer_cls_and_kwargs)
        opt = self._optimizer(optimizer or self.opt)
        if built_by_trainer:
            if model is not None:
                _attach_model(model, opt)
            self._use(args, opt)
        if opt._awaiting_own_state is None:
            return control
        # Trainer loaded rank 0's optimizer.pt here: find this rank's own.
        name = RANK_STATE.format(rank=opt.rank)
        places = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str) and resume:
            places.append(resume)
        places.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        for folder in places:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                opt.load_state_dict(torch.load(path, map_location=_state_device(opt), weights_only=True))
                return control
        rank, step = opt._awaiting_own_state
        raise FileNotFoundError(
            f"resuming rank {opt.rank} at global step {state.global_step}: Trainer loaded rank "
            f"{rank}'s optimizer state (optimizer step {step}), and this rank's own, {name}, is in "
            f"none of {places}. MorseCallback writes it into each checkpoint folder on every rank: "
            "resume from a checkpoint saved with MorseCallback (pass its folder as "
            "TrainingArguments(resume_from_checkpoint=...) if it is not under output_dir), or "
            "copy the morse-rank-*.pt files of that checkpoint beside its optimizer.pt")
