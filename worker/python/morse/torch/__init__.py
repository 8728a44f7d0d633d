"""PyTorch optimizers that train through a Morse job.

`OneBitAdam` (DESIGN 2.1), `Adam` (2.2, any codec and error feedback;
LoCo is codec="int4", feedback="ema") and `ZeroOneAdam` (2.7, 0/1 Adam)
are `torch.optim.Optimizer`s; `DiLoCo` (2.11, diloco.py) wraps any of
torch's as its inner optimizer. On
construction the optimizer joins the job: rank, world size and server
addresses come from the environment `morse-run` sets (MORSE_RANK,
MORSE_WORLD_SIZE, MORSE_SERVERS, MORSE_CONFIG; torchrun's RANK and
WORLD_SIZE where the first two are not set) or from arguments. The
parameters are laid end to end in one flat float32 tensor (each parameter
becomes a view of it, and so does its .grad), so Morse reads gradients and
writes parameters in place, with no copies. Rank 0's initial values become
everyone's.

Parameters may live on the CPU or on one CUDA device. On a GPU the flat
parameters, their gradient, m, v and the worker's error buffer stay in
device memory; encoding (momentum, error feedback, sign packing) and the
update run there, ordered after the work queued on PyTorch's current stream,
and only the compressed bytes cross PCIe. CPU and GPU workers in one job
hold bit-identical models.

With overlap=True (the default), a hook on each parameter's gradient
accumulator pushes a partition as soon as every gradient in it is ready, so
communication overlaps the rest of the backward pass, as DDP's buckets do.
Gradient accumulation needs no argument: the first step (which pushes at
step()) counts the backward() calls per step, and later steps push at the
last of as many (or pass accumulation_steps, or use opt.no_sync()). A
script that edits .grad, or changes lr, between backward() and step() from
its first step on gets every step pushed at step(); one that begins such a
thing in a later step gets a warning for that step, whose pushes had left,
and DDP's result from the next (see docs/python.md, "Torch idioms").
`torch.nn.utils.clip_grad_norm_` after backward() clips the averaged
gradient, as under DDP: while a Morse optimizer exists, morse.torch's
clip_grad_norm_ stands in for torch's (see clip_grad_norm_ below).
"""
import bisect
import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import warnings
import weakref

import torch

from .. import _native
from .._native import MorseError
from .state import _COMMIT_KEYS, _STATE_DICT_KEYS, _StateDict, _as_list, torch_optim_state_dict

__all__ = ["OneBitAdam", "Adam", "AdamW", "ZeroOneAdam", "OneBitLamb", "DiLoCo", "MorseError",
           "torch_optim_state_dict", "from_deepspeed"]


def _zero_grad_default():
    """The installed torch's default for Optimizer.zero_grad(set_to_none)."""
    import inspect
    try:
        default = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default
    except (KeyError, TypeError, ValueError):
        return False
    return bool(default) if isinstance(default, bool) else False


_ZERO_GRAD_SETS_TO_NONE = _zero_grad_default()


def _env(name, value, cast=str, torchrun=None):
    """An argument, else $name, else torchrun's $torchrun (RANK, WORLD_SIZE:
    so that `torchrun ... train.py` with MORSE_SERVERS set works)."""
    if value is not None:
        return value
    for key in (name, torchrun):
        if key and key in os.environ:
            try:
                return cast(os.environ[key])
            except ValueError:
                raise MorseError(f"INVALID_ARGUMENT: {key}={os.environ[key]!r} is not a {cast.__name__}")
    raise MorseError(
        f"FAILED_PRECONDITION: {name} is not set; run the script under morse-run (or torchrun "
        f"with MORSE_SERVERS set) or pass rank=, world_size= and servers= to the optimizer")


# The Morse optimizers built, oldest first (weak references), for
# clip_grad_norm_ to find its parameters' (the newest one that has them).
_OPTIMIZERS = []
_TORCH_CLIP_GRAD_NORM = torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, as DDP gives it for a Morse
    optimizer's parameters: the norm of the averaged gradient (of order
    norm_type, any that torch takes), which the optimizer's step() then clips by
    max_norm (the same clip factor as torch's, min(1, max_norm / (norm +
    1e-6))). Building a Morse optimizer
    puts this in place of torch.nn.utils.clip_grad_norm_, so scripts call it
    as they always have; other parameters go to torch's own.

    Unlike DDP, .grad keeps this rank's own gradient (Morse averages in the
    exchange, not in .grad) and is left as it is: the clip is applied in
    step(). The call waits for the exchange (every reply), as DDP's waits
    for its all-reduce. Where the step has no averaged gradient (OneBitAdam's
    compression phase, ZeroOneAdam's 1-bit and local steps) the rule
    is DeepSpeed's: each rank clips its own gradient, and the call returns
    that rank's own norm; from the first call on, those steps push at
    step(), once the clip is known, instead of during backward(). There
    the call is torch's own on the rank's .grad (on a node, on the node's
    average), scaled in place, and step() pushes .grad as it finds it, so
    an edit after the clip is in torch's order. Call it on
    every rank alike, over all of the optimizer's parameters or some of
    them (then each parameter is clipped by its own factors: design.md 2.6,
    "Clipping part of the model"); several calls in a step compose as
    torch's (each returns the norm of the gradient the earlier ones
    clipped). Under morse-run --node-aggregation every rank of
    the node calls it: the node's gradient is gathered then, and each rank
    returns the norm DDP's would (sharded: combined from the slices')."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    _OPTIMIZERS[:] = [ref for ref in _OPTIMIZERS if ref() is not None]
    for ref in reversed(_OPTIMIZERS):
        opt = ref()
        owned = opt._owned(parameters) if opt is not None else None
        if owned is None:
            continue
        return opt._clip_grad_norm(max_norm, norm_type, error_if_nonfinite, owned)
    extra = {} if foreach is None else {"foreach": foreach}
    return _TORCH_CLIP_GRAD_NORM(parameters, max_norm, norm_type=norm_type,
                                 error_if_nonfinite=error_if_nonfinite, **extra)


def _install_clip_grad_norm():
    """Puts clip_grad_norm_ where scripts look for torch's (once)."""
    import torch.nn.utils.clip_grad as clip_module
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    clip_module.clip_grad_norm_ = clip_grad_norm_


_TORCH_SCALE = None  # torch.amp.GradScaler.scale, where _install_grad_scaler_hook replaced it


def _install_grad_scaler_hook():
    """Puts a notice into torch.amp.GradScaler.scale (once): every live Morse
    optimizer learns, before backward(), that the step's loss is scaled and
    by which scaler, so that its pushes wait for step(), where the job
    decides whether the step's gradients overflowed (_scaler_step)."""
    global _TORCH_SCALE
    # (torch 1.13: torch.cuda.amp.GradScaler alone, which torch 2's
    # subclasses.)
    scaler_class = getattr(getattr(torch, "amp", None), "GradScaler", None) or \
        getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)
    if scaler_class is None or _TORCH_SCALE is not None:
        return
    _TORCH_SCALE = scaler_class.scale

    def scale(self, outputs):
        if self.is_enabled():
            for ref in _OPTIMIZERS:
                # (A node's DiLoCo is listed too, for clip_grad_norm_: its
                # inner steps are its own, and it hears of the scaler at
                # step().)
                told = getattr(ref(), "_loss_scaled_by", None)
                if told is not None:
                    told(self)
        return _TORCH_SCALE(self, outputs)
    scale.__doc__ = _TORCH_SCALE.__doc__
    scaler_class.scale = scale


def _base_config(config, workers, servers):
    """The job's base config: the file `config` (or MORSE_CONFIG) names, else
    one for `workers` workers and the shards `servers` lists."""
    config = config if config is not None else os.environ.get("MORSE_CONFIG")
    if config:
        with open(config) as f:
            return f.read()
    return f"workers: {workers}\nshards: {len(servers)}\nexternal {{}}\n"


def _rank_checkpoint(session, worker, name=None):
    """This rank's checkpoint path (`name`, default worker-<worker>.ckpt, in
    MORSE_CHECKPOINT_DIR) and the job's checkpoint.every_steps when
    MORSE_CHECKPOINT_DIR is set (morse-run --rank-restarts), else (None, 0);
    MorseError if the job does not checkpoint."""
    checkpoint_dir = os.environ.get("MORSE_CHECKPOINT_DIR")
    if not checkpoint_dir:
        return None, 0
    every = session.checkpoint_every()
    if not every:
        raise MorseError("FAILED_PRECONDITION: MORSE_CHECKPOINT_DIR is set but the job does not "
                         "checkpoint: add checkpoint { every_steps: N } to the config (morse-run "
                         "--config)")
    return os.path.join(checkpoint_dir, name or f"worker-{worker}.ckpt"), every


def _group_shapes(groups):
    """Each group's trained parameters' shapes (what a layout written
    beside a rank's checkpoints records of its groups)."""
    return [[list(p.shape) for p in g["params"] if p.requires_grad] for g in groups]


def _restarted_layout(base):
    """A rank restarted by morse-run --rank-restarts (MORSE_REJOIN=1) after
    add_param_group: the layout of its newest checkpoints, as
    add_param_group wrote it beside them (<base>.gen<g>.json: the
    generation g, each group's first step and its trained parameters'
    shapes; the checkpoints <base>.gen<g>.ckpt.<step>; base worker-<w>, or
    a sharded node's slice-<k>-worker-<w>), with the steps it has one of;
    None where it has none of a later layout than the first."""
    folder = os.environ.get("MORSE_CHECKPOINT_DIR")
    if not folder or os.environ.get("MORSE_REJOIN") != "1" or not os.path.isdir(folder):
        return None
    found = [int(m.group(1)) for m in (re.fullmatch(rf"{re.escape(base)}\.gen(\d+)\.json", f)
                                       for f in os.listdir(folder)) if m]
    if not found:
        return None
    generation = max(found)
    with open(os.path.join(folder, f"{base}.gen{generation}.json")) as f:
        layout = json.load(f)
    prefix = f"{base}.gen{generation}.ckpt."
    layout["steps"] = sorted(int(f[len(prefix):]) for f in os.listdir(folder)
                             if f.startswith(prefix) and f[len(prefix):].isdigit())
    if not layout["steps"]:
        raise MorseError(
            f"FAILED_PRECONDITION: {base} was lost inside add_param_group at step "
            f"{layout['first_steps'][-1]}, after the shards took the new layout and before its "
            "checkpoint of it: it cannot rejoin the job; restart the job from a saved "
            "state_dict()")
    layout["step"] = layout["steps"][-1]
    return layout


def _external_model(params, layers=(), groups=(), generation=0):
    """(dim, the JobConfig line) of the model the parameters `params` make:
    `layers` the element counts of onebit_lamb's layers in order (each
    tensor, and each group's padding; none: not sent), `groups` those of
    parameter groups trained with their own lr and weight_decay, padding
    included (none: one group); `generation` the times add_param_group laid
    the model out anew."""
    shapes = ";".join("x".join(str(d) for d in p.shape) or "scalar" for p in params)
    dim = sum(groups) if len(groups) > 1 else sum(p.numel() for p in params)
    fingerprint = int.from_bytes(hashlib.sha256(shapes.encode()).digest()[:8], "little")
    extra = " ".join(f"layers: {n}" for n in layers)
    if len(groups) > 1:
        extra += "".join(f" groups: {n}" for n in groups)
    if generation:
        extra += f" generation: {generation}"
    return dim, (f'external {{ dim: {dim} shapes_fingerprint: {fingerprint} shapes: "{shapes}" '
                 f'{extra} }}')


def _codec_lines(codec, down_codec, feedback, feedback_beta):
    """The JobConfig lines of the codecs both ways and the error feedback of
    both sides; ValueError for a feedback_beta that feedback does not use."""
    if feedback_beta is not None and feedback != "ema":
        raise ValueError(f"feedback_beta={feedback_beta!r} is the weight of feedback='ema'; "
                         f"feedback={feedback!r} has none")
    beta = f" beta: {float(feedback_beta)!r}" if feedback_beta is not None else ""
    return [f'up_codec {{ codec: "{codec}" }}',
            f'down_codec {{ codec: "{down_codec or codec}" }}',
            f'worker_feedback {{ mode: "{feedback}"{beta} }}',
            f'server_feedback {{ mode: "{feedback}"{beta} }}']


_SECURITY_ENV = {"tls_ca": "MORSE_TLS_CA", "tls_cert": "MORSE_TLS_CERT", "tls_key": "MORSE_TLS_KEY",
                 "tls_server_name": "MORSE_TLS_SERVER_NAME", "token_file": "MORSE_TOKEN_FILE"}


def _security(security):
    """The worker's credentials: `security` if given (a dict with the keys of
    morse-worker's flags: tls_ca, tls_cert, tls_key, tls_server_name,
    token_file, insecure), else from MORSE_TLS_CA, MORSE_TLS_CERT,
    MORSE_TLS_KEY, MORSE_TLS_SERVER_NAME, MORSE_TOKEN_FILE and MORSE_INSECURE=1
    (morse-run sets these)."""
    if security is not None:
        return dict(security)
    out = {key: os.environ[env] for key, env in _SECURITY_ENV.items() if os.environ.get(env)}
    if os.environ.get("MORSE_INSECURE", "") in ("1", "true", "yes"):
        out["insecure"] = True
    return out





class _MorseOptimizer(_StateDict, torch.optim.Optimizer):
    # torch.amp.GradScaler hands a step it drives to the optimizer (torch
    # 2's grad_scale and found_inf attributes; torch 1.13's grad_scaler
    # argument), so that every rank skips together where any rank's
    # gradients overflowed (_scaler_step).
    _step_supports_amp_scaling = True
    # morse.torch.hf.MorseCallback sets it where Trainer will build the
    # optimizer itself (optimizer_cls_and_kwargs): _finds_own_state below.
    _finds_own_state_when_built = False

    def __init__(self, params, *, optimizer, lr, betas, eps, weight_decay, freeze_step,
                 codec, down_codec, feedback, feedback_beta, bias_correction, mask_zero_variance,
                 bound_update,
                 schedule, steps,
                 config, rank, world_size, servers, overlap, block_elems, partition_elems, security,
                 accumulation_steps=None, missing_grads="raise", broadcast_buffers=True, buffers=None,
                 apply_at_step=True, clip_grad_norm=None, zero_one=None, lamb=None,
                 _layout=None):
        # What it was built with, to build it again over more parameters
        # (add_param_group); `_layout` is then (the layout generation, each
        # group's first step, the node's group under --node-aggregation,
        # which a node forms once, and whether this rank rejoins the job
        # from its checkpoint: restarted, it adds the run's groups again).
        built = {k: v for k, v in locals().items()
                 if k not in ("self", "params", "_layout", "__class__")}
        if missing_grads not in ("raise", "zero"):
            raise ValueError(f"missing_grads={missing_grads!r}: 'raise' or 'zero'")
        # Given the model itself, the optimizer sees its buffers too (BatchNorm
        # running statistics) and keeps them equal on every rank, as DDP's
        # broadcast_buffers: rank 0's go out with each step and every rank
        # takes them when the step ends.
        if buffers is not None and not broadcast_buffers:
            raise ValueError("buffers= are broadcast only with broadcast_buffers=True; pass one or "
                             "the other")
        if isinstance(params, torch.nn.Module):
            if buffers is None and broadcast_buffers:
                buffers = list(params.named_buffers())
            params = params.named_parameters()
        self._buffers = []
        if buffers is not None:
            for i, b in enumerate(buffers):
                name, t = b if isinstance(b, tuple) else (f"buffer {i}", b)
                try:
                    t.detach().cpu()[:0].numpy() if t.dim() else t.detach().cpu().numpy()
                except (TypeError, RuntimeError) as e:
                    raise TypeError(f"buffer {name} is {t.dtype}, which Morse cannot broadcast ({e}); "
                                    "pass broadcast_buffers=False") from None
                self._buffers.append((name, t))
        params = list(params)
        if not params:
            raise ValueError("the optimizer got no parameters")
        # model.named_parameters() gives errors the parameters' names.
        names = None
        if all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
            names = [n for n, _ in params]
            params = [p for _, p in params]
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        every = [p for group in self.param_groups for p in group["params"]]
        every_name = names or [f"parameter {i} {tuple(p.shape)}" for i, p in enumerate(every)]
        # A parameter listed twice would sit twice in the flat buffer: its
        # gradient pushed and counted in the norms twice (torch.optim warns
        # and steps it twice).
        first_seen = {}
        for name, p in zip(every_name, every):
            if id(p) in first_seen:
                raise ValueError(f"{name} is the same tensor as {first_seen[id(p)]}: list each "
                                 "parameter once (model.parameters() does)")
            first_seen[id(p)] = name
        # Frozen parameters (requires_grad=False) stay out of the flat buffer:
        # Morse never touches them, as torch.optim never updates them.
        self._params = [p for p in every if p.requires_grad]
        self._names = [n for n, p in zip(every_name, every) if p.requires_grad]
        self._left_out = [(n, p) for n, p in zip(every_name, every) if not p.requires_grad]
        if not self._params:
            raise ValueError("every parameter has requires_grad=False; there is nothing to train")
        for i, p in enumerate(self._params):
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {i} ({tuple(p.shape)}) is {p.dtype}; "
                                "Morse trains float32 parameters")
            if p.device != self._params[0].device:
                raise ValueError(f"parameter {i} is on {p.device}, parameter 0 on "
                                 f"{self._params[0].device}; Morse trains parameters on one device")
        self._rank = _env("MORSE_RANK", rank, int, torchrun="RANK")
        world = _env("MORSE_WORLD_SIZE", world_size, int, torchrun="WORLD_SIZE")
        servers = _env("MORSE_SERVERS", servers)
        # morse-run --node-aggregation: one Morse worker per node (node.py);
        # =sharded: this rank trains its slice of the parameters alone.
        self._node = None
        self._others = []  # sharded: the trained parameters of the other slices
        self._slices = None  # sharded: [(first, end)] of every slice in self._node_params
        worker, workers = self._rank, world
        aggregation = os.environ.get("MORSE_NODE_AGGREGATION")
        if aggregation:
            from .node import node_of_job, slices, uneven
            if aggregation not in ("1", "sharded"):
                raise MorseError(f"INVALID_ARGUMENT: MORSE_NODE_AGGREGATION={aggregation!r}: 1 "
                                 "(the leader steps for the node) or sharded (morse-run sets it)")
            kept = _layout[2] if _layout else None
            self._node = kept if kept is not None else node_of_job(self._rank, world)
            worker, workers = self._node.node, self._node.nnodes
            local_size = self._node.size
            self._node_params, self._node_names = self._params, self._names
            # Each parameter's place in the node's gradient, which is where
            # its values lie in a rank's staging region (node.py).
            self._node_offsets = list(itertools.accumulate([0] + [p.numel() for p in self._params]))
            # The node's gradients are gathered during backward() (bucket by
            # bucket, _node_bucket_ready) and averaged at step(), where the
            # leader (or each slice's owner) pushes them.
            node_overlap, overlap = overlap, False
            # The ranks of a node gather bucket by bucket during backward()
            # only where all do: their exchanges must be the same.
            overlaps = self._node.objects(bool(node_overlap))
            if len(set(overlaps)) > 1:
                raise ValueError(
                    f"overlap={node_overlap} here, but local ranks "
                    f"{[k for k, o in enumerate(overlaps) if o != overlaps[0]]} of node "
                    f"{self._node.node} set overlap={not overlaps[0]} and the others "
                    f"{overlaps[0]}: under --node-aggregation every rank of a node must pass the "
                    "same overlap")
            if aggregation == "sharded":
                sizes = [p.numel() for p in self._params]
                starts = slices(sizes, local_size)
                self._slices = list(zip(starts[:-1], starts[1:]))
                cut = uneven(sizes, starts, self._names)
                if cut is not None and _layout is None and self._rank == 0:
                    k, held, share, name, size = cut
                    warnings.warn(
                        f"morse: --node-aggregation=sharded gives each local rank a slice of "
                        f"whole parameters, and slice {k} holds {held:,} of the model's "
                        f"{sum(sizes):,} elements, {share:.2f} times an even share (its largest "
                        f"parameter is {name}, of {size:,} elements): local rank {k} of each "
                        "node holds that much more optimizer state than an even cut would give "
                        "it. Morse does not cut a parameter between slices; fewer ranks per "
                        "node even it out", RuntimeWarning, stacklevel=3)
                first, end = self._slices[self._node.local_rank]
                self._params, self._names = self._params[first:end], self._names[first:end]
                mine = {id(p) for p in self._params}
                self._others = [p for p in self._node_params if id(p) not in mine]
        self._worker, self._workers = worker, workers
        # A rank restarted after add_param_group: its checkpoints are of the
        # layout with every group the run had added, which the script adds
        # again (before its first backward(): "Adding a parameter group" in
        # docs/python.md); until it has, the optimizer waits for them.
        self._awaiting = None
        restarted = None
        if _layout is None and os.environ.get("MORSE_REJOIN") == "1":
            stem = (f"worker-{worker}" if self._slices is None
                    else f"slice-{self._node.local_rank}-worker-{worker}")
            if self._node is None:
                restarted = _restarted_layout(stem)
            else:
                # A node's ranks take its leader's layout (sharded: every
                # owner has its own, of one generation), from the newest
                # step every owner has a checkpoint of.
                owns = self._node.is_leader or self._slices is not None
                told = self._node.objects(_restarted_layout(stem) if owns else None)
                restarted = told[0]
                if restarted is not None and self._slices is not None:
                    common = set.intersection(*(set(t["steps"]) for t in told))
                    if not common:
                        raise MorseError(
                            f"FAILED_PRECONDITION: the slices of node {self._node.node} have no "
                            "checkpoint of one step after add_param_group: restart the job "
                            "from a saved state_dict()")
                    restarted = dict(restarted, step=max(common))
        if restarted is not None:
            have = _group_shapes(self.param_groups)
            want = restarted["groups"]
            if have != want[:len(have)]:
                raise MorseError(
                    f"FAILED_PRECONDITION: rank {worker} restarted from its checkpoint of step "
                    f"{restarted['step']}, whose parameter groups have the shapes {want}; the "
                    f"optimizer was built with {have}: build it as the run did")
            if len(have) < len(want):
                self._awaiting = restarted
                self._built_with = built
                self._session = None
                return
            _layout = (restarted["generation"], restarted["first_steps"], self._node, True)
        trained = {id(p) for p in self._params}
        device = self._params[0].device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameters on {device}: Morse trains CPU and CUDA tensors")
        self._cuda = device.type == "cuda"
        # Several groups (torch's list of dicts) share betas and eps (one
        # update rule). Each group with parameters to train is a segment of
        # the flat buffer that no partition straddles, and each push carries
        # its group's lr and weight_decay, read at every step: groups built
        # with their own values train apart, and groups that agree when
        # built may be set apart later (a scheduler's lambda per group), as
        # in torch. Groups that agree stay one segment only where they could
        # not train apart anyway: with schedule="cosine" (one lr for the
        # model); there they must go on agreeing.
        counts = [sum(p.numel() for p in g["params"] if id(p) in trained) for g in self.param_groups]
        first = self.param_groups[0]
        differ = any(_hyper_of(g) != _hyper_of(first) for g in self.param_groups)
        self._groups_apart = differ or (schedule == "constant" and sum(n > 0 for n in counts) > 1)
        self._schedule = schedule
        # Every optimizer follows param_groups' betas and eps too, each group
        # its own (a scheduler that cycles the momentum), except under
        # Morse's own schedule, which takes the job's, one for the model.
        self._follows_moments = schedule == "constant"
        self._check_groups()
        self._segments = ([i for i, n in enumerate(counts) if n > 0] if self._groups_apart
                          else [0])
        if self._groups_apart and schedule != "constant":
            raise ValueError(f"param_groups with their own lr or weight_decay follow torch's values "
                             f"at every step; schedule={schedule!r} sets one lr for the whole model. "
                             "Use torch's schedulers (with the default schedule='constant')")
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        base = _base_config(config, workers, servers)
        # The job's betas and eps are param_groups[0]'s (a group may give its
        # own, in place of the arguments'), fixed from here on: every rank
        # and shard applies them (_check_update_rule).
        betas, eps = self.param_groups[0]["betas"], self.param_groups[0]["eps"]
        self._update_rule = (_as_list(betas), _as_list(eps))
        adam = [f"beta1: {float(betas[0])!r}", f"beta2: {float(betas[1])!r}", f"eps: {float(eps)!r}",
                f"weight_decay: {float(weight_decay)!r}"]
        adam.append(f"bias_correction: {'true' if bias_correction else 'false'}")
        lines = [
            None,  # the model, below
            f'optimizer: "{optimizer}"',
            "adam { " + " ".join(adam) + " }",
            f'lr {{ schedule: "{schedule}" lr: {float(lr)!r} }}',  # torch 2 takes a tensor lr
            f"steps: {steps}",
        ] + _codec_lines(codec, down_codec, feedback, feedback_beta)
        # With the constant schedule (the default) the steps follow
        # param_groups[0]'s lr and weight_decay, read at every step, so torch's
        # schedulers and manual changes work; with schedule="cosine" the job's
        # schedule rules and param_groups' lr must stay as given.
        self._follow_groups = schedule == "constant"
        self._initial_hyper = self._group_hyper()
        self._sent_hyper = None
        self._sent_moments = None
        self._freeze_step = freeze_step if optimizer in ("onebit_adam", "onebit_lamb") else None
        self._lamb = optimizer == "onebit_lamb"
        self._commit_key = _COMMIT_KEYS.get(optimizer, "commit")
        self._mask_zero_variance = mask_zero_variance
        if optimizer in ("onebit_adam", "onebit_lamb"):
            lines.append(f"freeze_step: {freeze_step}")
        if optimizer in ("onebit_adam", "zero_one_adam", "onebit_lamb"):
            lines.append(f"mask_zero_variance: {'true' if mask_zero_variance else 'false'}")
            lines.append(f"bound_update: {'true' if bound_update else 'false'}")
        self._zero_one = dict(zero_one) if zero_one is not None else None
        if zero_one is not None:
            lines.append("zero_one_adam { " + " ".join(f"{k}: {int(v)}" for k, v in zero_one.items()) + " }")
        if lamb is not None:
            lines.append("onebit_lamb { " + " ".join(f"{k}: {float(v)!r}" for k, v in lamb.items()) + " }")
        # Clipping by the global norm (torch's clip_grad_norm_ on the global
        # batch): of the averaged gradient where the step has one (Adam,
        # OneBitAdam's warmup), of each rank's own gradient in OneBitAdam's
        # compression phase (as DeepSpeed). A job setting, the same on every
        # rank and on the shards' mirrors.
        if clip_grad_norm is not None:
            try:
                clip = float(clip_grad_norm)
            except (TypeError, ValueError):
                clip = float("nan")
            if not clip > 0 or clip == float("inf"):
                raise ValueError(f"clip_grad_norm={clip_grad_norm!r}: a positive, finite max_norm "
                                 "(or None for no clipping)")
            # A sharded node's slices clip by the model's norm, which no
            # slice's job knows: the node clips each step as
            # clip_grad_norm_ does (_slice_step), every slice by the
            # model's factor.
            if self._slices is None:
                lines.append(f"clip_grad_norm: {clip!r}")
        self.clip_grad_norm = clip_grad_norm
        if block_elems:
            lines.append(f"block_elems: {block_elems}")
        if partition_elems:
            lines.append(f"partition_elems: {partition_elems}")
        # Groups trained apart are segments of the flat buffer that start on
        # a block (the error buffers keep per-block state): each but the
        # last is padded to whole blocks with elements no parameter uses
        # (zero, with a zero gradient). The parameter tensors are
        # onebit_lamb's layers, and each group's padding one more (so that
        # no real layer's sums see it).
        sizes = [counts[i] for i in self._segments]
        layers = [p.numel() for p in self._params]
        if len(sizes) > 1:
            block = _native.job_block_elems(base, "\n".join(["external { }"] + lines[1:]))
            sizes = [-(-n // block) * block for n in sizes[:-1]] + sizes[-1:]
            layers = []
            for i, size in zip(self._segments, sizes):
                group = [p.numel() for p in self.param_groups[i]["params"] if id(p) in trained]
                layers += group + ([size - sum(group)] if size > sum(group) else [])
        self._built_with = built
        self._generation, first_steps = _layout[:2] if _layout else (0, ())
        # The step from which each group trains (add_param_group's, and a
        # loaded state's): its bias corrections count from there.
        self._first_steps = list(first_steps) + [0] * (len(self.param_groups) - len(first_steps))
        dim, lines[0] = _external_model(self._params, layers=layers, groups=sizes,
                                        generation=self._generation)
        self.job_overrides = "\n".join(lines)

        # One flat tensor for the parameters and one for their gradients, on
        # the parameters' device. Each parameter becomes a view of it, with
        # its values in their logical order: a non-contiguous one (a
        # transpose made a Parameter) becomes contiguous, as DDP trains it.
        self._flat = torch.zeros(dim, dtype=torch.float32, device=device)
        self._flat_grad = torch.zeros(dim, dtype=torch.float32, device=device)
        self._ranges = []
        starts = dict(zip(self._segments, itertools.accumulate([0] + sizes[:-1])))
        group_of = [i for i, g in enumerate(self.param_groups) for p in g["params"]
                    if id(p) in trained]
        offset, group = 0, self._segments[0]
        with torch.no_grad():
            for p, g in zip(self._params, group_of):
                if self._groups_apart and g != group:
                    offset, group = starts[g], g  # the next group's segment
                n = p.numel()
                self._flat[offset:offset + n].copy_(p.reshape(-1))
                p.data = self._flat[offset:offset + n].view_as(p)
                p.grad = self._flat_grad[offset:offset + n].view_as(p)
                self._ranges.append((offset, offset + n))
                offset += n
        # The session's host copy of x: the flat tensor itself on the CPU; on
        # a GPU a host tensor that carries rank 0's values until use_cuda
        # moves the model into the device tensors.
        host_x = self._flat.cpu() if self._cuda else self._flat
        self._session = None  # a node's other ranks have none (node.py)
        self._node_first_step = 0  # a node's other rank: the step it started from
        # A rank that morse-run (--rank-restarts) may restart saves its whole
        # state every checkpoint.every_steps steps to MORSE_CHECKPOINT_DIR, and
        # restarted (MORSE_REJOIN=1) starts from that checkpoint.
        self._checkpoint, self._checkpoint_every = None, 0
        # (A restarted rank's later add_param_group lays the job out anew as
        # every rank's does; only its first layout rejoins.)
        rejoin = os.environ.get("MORSE_REJOIN") == "1" and (_layout is None or _layout[3])
        self._rejoined = rejoin
        # Module buffers go through slice 0's job (sharded node) and its
        # owners share them with their nodes.
        self._session_buffers = bool(self._buffers) and (self._slices is None
                                                         or self._node.local_rank == 0)
        if self._node is None or self._node.is_leader or self._slices is not None:
            try:
                self._session = _native.Session(base, self.job_overrides, worker, servers,
                                                host_x.numpy(), _security(security))
            except MorseError as e:
                if self._slices is None or "every shard needs a block" not in str(e):
                    raise
                k = self._node.local_rank
                first, end = self._slices[k]
                raise MorseError(
                    f"{e}\n  (--node-aggregation=sharded: slice {k} is parameters {first}..{end - 1} "
                    f"({', '.join(self._names[:3])}{', ...' if end - first > 3 else ''}), "
                    f"{sum(p.numel() for p in self._params)} elements, too few for its "
                    f"{len(servers)} shards; slices are whole parameters, so give fewer --servers "
                    "or fewer ranks per node, or use --node-aggregation (the leader steps for the "
                    "node)") from None
            # A sharded node's slices are jobs whose workers share an index
            # (the node): each keeps its own files, of its last two
            # checkpoints' steps (<path>.<step>), so that a node restarted
            # between two ranks' writes finds a step common to all.
            # After add_param_group (a later layout generation) a rank's
            # checkpoints are <name>.<step> too, of that layout's own name.
            stem = (f"worker-{worker}" if self._slices is None
                    else f"slice-{self._node.local_rank}-worker-{worker}")
            self._checkpoint, self._checkpoint_every = _rank_checkpoint(
                self._session, worker,
                f"{stem}.gen{self._generation}.ckpt" if self._generation else f"{stem}.ckpt")
            if rejoin:
                # The model, moments and error buffer of the checkpoint's step
                # (none: the shards' model and a zero error buffer); the
                # script goes on from step_index, and the steps the shards
                # completed since are replayed with the replies they kept.
                self._session.start(True, self._rejoin_checkpoint())
            else:
                if self._generation:
                    # Laid out anew: the shards take the new layout once
                    # every rank has joined with it.
                    try:
                        self._session.wait_all_joined()
                    except MorseError as e:
                        who = ("every rank" if not self._elastic else
                               "rank 0 and every rank in the last step's membership (an "
                               "elastic job's ranks that had left are not waited for)")
                        raise MorseError(
                            f"{e}\n  (add_param_group at step {first_steps[-1]}: {who} "
                            "must call it between the same two steps, with the same "
                            "parameter groups)") from None
                self._session.start(False)  # rank 0 uploads; the others receive rank 0's values
        if self._node is not None:
            # The node's gradients and parameters move through shared
            # memory where the host lets them (node.py): the most a rank
            # exchanges is its flat buffer or the node's gradient.
            self._node.use_shared_memory(max(dim, sum(p.numel() for p in self._node_params)))
        if self._slices is not None:
            if self._cuda:
                with torch.no_grad():
                    self._flat.copy_(host_x)  # the slice's job's values
            # A restarted node's slices resume at one step (a fresh job's
            # may start where another node's load_state_dict has already
            # taken the shards: each rank then loads its own state too).
            steps = self._node.objects(self._session.step_index) if rejoin else [0]
            if len(set(steps)) > 1:
                raise MorseError(
                    f"FAILED_PRECONDITION: the slices of node {self._node.node} rejoined at steps "
                    f"{steps} (local ranks in order): no checkpoint of one step was left to every "
                    "rank of the node (checkpoint.every_steps), so the node cannot go on from one "
                    "step; restart the job from its shards' checkpoints")
            self._share_slices()  # and every rank takes the other slices'
        elif self._node is not None:
            self._node.share(host_x)  # the node takes its leader's values
            if self._cuda:
                with torch.no_grad():
                    self._flat.copy_(host_x)
            # Its step too (a restarted node's leader resumes where its
            # checkpoint and the shards' replies take it).
            first = self._node.objects(self._session.step_index if self._session else None)[0]
            if self._session is None:
                self._node_first_step = first
        if self._cuda and self._session is not None:
            self._device = device
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).synchronize()  # the copies into _flat are done
                self._session.use_cuda(self._flat.data_ptr(), self._flat_grad.data_ptr())
        self._joined = False
        # Morse writes the parameters through raw memory, which leaves torch's
        # version counters alone; any in-place change by torch
        # (load_state_dict, copy_, clamp_ on a parameter) bumps that
        # parameter's counter.
        self._x_versions = [p._version for p in self._params]
        self._partitions = self._session.partitions() if self._session is not None else []
        # Which partitions each parameter touches, and how many parameters
        # each partition waits for.
        self._touches = [[q for q, (b, e) in enumerate(self._partitions) if b < hi and e > lo]
                         for lo, hi in self._ranges]
        self._waiting_for = [sum(q in t for t in self._touches) for q in range(len(self._partitions))]
        self._pending = None
        self._overlap = overlap
        # With overlap the replies arrive during backward(); kept until
        # step(), the parameters change only there, as with torch.optim
        # (apply_at_step=False applies them as they arrive: faster on big
        # models, but the parameters then change under backward()).
        if overlap and apply_at_step:
            self._session.set_defer_apply(True)
        if accumulation_steps is not None and accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps}: at least 1")
        # None: learnt from the first step, which pushes at step() and so can
        # count the backward() calls that reach each parameter.
        self._accumulation = accumulation_steps or 1
        self._learns_accumulation = accumulation_steps is None
        self._learned_accumulation = False
        self._missing_grads = missing_grads
        self._counts = [0] * len(self._params)  # backward() passes that reached each parameter
        # no_sync(): inside it, backward() only accumulates; a step that used
        # it pushes each parameter at the first backward() outside it.
        self._in_no_sync = False
        self._no_sync_step = False
        self._synced = [False] * len(self._params)
        self._grad_version = None  # the flat gradient's version at the last push
        # The gradients as backward() left them (the first step) or as they
        # were pushed (later steps, once the first showed edits after
        # backward(): Trainer's norm logging calls clip_grad_norm_ every
        # step). An edit that leaves every bit as it was is no edit.
        self._snapshot = torch.empty_like(self._flat_grad) if overlap else None
        self._snapshot_versions = [None] * len(self._params)
        # Without that copy (the first step showed no edit), a sample of the
        # bits each partition was pushed with: an edit through .data first
        # made in a later step moves no version counter (_sampled_edit).
        self._sample_index, self._sample_bounds = _sample_layout(self._partitions, self._ranges,
                                                                 self._flat_grad.device)
        self._samples = (torch.empty(len(self._sample_index), device=self._flat_grad.device)
                         if overlap else None)
        self._hooks = []
        if overlap:
            for i, p in enumerate(self._params):
                if p.requires_grad:
                    accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                    self._hooks.append((accumulator, accumulator.register_hook(
                        lambda *unused, i=i: self._gradient_ready(i))))
        self.last_step = {}
        # clip_grad_norm_ after backward() (the module's function): seen in
        # this run (its steps then begin with the workers' clipping), and
        # in the step in flight (the pushes' state then).
        self._clips = False
        self._clipped = False
        # The step in flight clips this rank's own gradient with its pushes
        # at step() (a compressing step): each clip_grad_norm_ is torch's own
        # on .grad, in place (_own_clip); None until the step's first clip.
        self._own_clipping = None
        self._own_scaled = False  # ... and one has scaled .grad
        # A clip of part of the model in the step in flight: a factor per
        # parameter, and the gradient the norms are of (_part_clip).
        self._part_factors = None
        self._part_base = None
        self._pushed = None
        # The step in flight's clip_grad_norm_ put the clipped average in
        # .grad, as DDP's leaves it (_show_clipped_average), and an edit
        # after it that no factor per parameter gives made .grad the step's
        # gradient (_amending: the session sends it, design.md 2.6).
        self._shown = False
        self._amending = False
        # Whether clip_grad_norm_ shows the clipped average in .grad: on the
        # CPU always; on CUDA tensors, where it costs a decode of the model
        # on the host and its copy to the device in every clipped step, once
        # the script was seen editing .grad after a clip in a step that
        # averages (until then .grad keeps the rank's own gradient there).
        self._shows_average = not self._cuda
        # The first step showed .grad edited between backward() and step():
        # the pushes wait for step() (or clip_grad_norm_), as overlap=False.
        self._holds_pushes = False
        # What the step in flight did after its pushes had left (another
        # backward(), an edit of .grad, a first clip_grad_norm_, an lr
        # change): see _surprised.
        self._surprise = None
        self._first_hyper = None  # lr and weight_decay at the first step's backward()
        # fp16 loss scaling (torch.amp.GradScaler): the scaler that scaled the
        # step's loss (its scale() tells every Morse optimizer), and the
        # job's verdict on whether the step overflowed, once taken.
        self._scaler = None
        self._loss_scaled = False
        self._overflowed = None
        self._skipped_last = False  # whether the last step() skipped (morse.torch.hf reads it)
        self._world = world
        self._elastic = re.search(r"^\s*min_workers\s*:", base, re.M) is not None
        if not any(ref() is self for ref in _OPTIMIZERS):
            _OPTIMIZERS.append(weakref.ref(self))
        _install_clip_grad_norm()
        _install_grad_scaler_hook()
        # Set by morse.torch.hf.MorseCallback: another rank's state_dict is
        # kept aside (rank, step) until this rank's own is loaded. (Set
        # from the start where Trainer builds the optimizer itself and loads
        # a checkpoint into it before the callback sees it.)
        self._finds_own_state = _MorseOptimizer._finds_own_state_when_built
        self._awaiting_own_state = None
        # Set by morse.torch.hf.prepare's load_state hook: this rank's own
        # state of the checkpoint Accelerate is loading, loaded in place of
        # another rank's.
        self._own_state_file = None
        # Tells this optimizer's own state_dict() of the current step apart
        # (load_state_dict of it restores nothing).
        self._nonce = os.urandom(8).hex()
        self._gathered = None  # a node's rank: the step's gather, once done (_node_gather)
        self._clip_gathered = False  # ... done at clip_grad_norm_
        self._sent_copied = False  # ... and what it sent copied there (_keep_sent)
        # The rank that steps for a node (or a slice), in a step whose
        # gather came at the clip: [(local rank, the factors by which it
        # scaled each parameter's .grad since, None for another edit)] of
        # the other ranks, which must be its own (_judge_node_edits).
        self._node_edit_scales = None
        # ... in a step whose clips were the leader's own (_node_own_clip):
        # the local ranks whose .grad at step() was not the leader's.
        self._node_grads_differ = None
        self._node_clipped = None  # ... and the gradient the last such clip gave every rank
        # ... or, in a step that averages, whether the last clip gave every
        # rank of the node the clipped average as its .grad (_node_show).
        self._node_shown = False
        self._node_buckets = None
        self._push_error = None  # a leader's push at the gather failed: raised at its step
        self._pushed_before_last = 0  # partitions the leader pushed before the last bucket
        self._buckets_in_backward = None
        # (Not yet for CUDA tensors: a bucket's copy to the host in the hook
        # would hold up the device's backward() until it is done; they are
        # gathered at step(), as before, until this is built and measured
        # on a GPU with copies that do not wait.)
        if self._node is not None and node_overlap and not self._cuda:
            self._start_node_buckets(partition_elems or (1 << 20))

    def add_param_group(self, param_group):
        """torch's add_param_group (progressive unfreezing), between a
        step() and the next backward(), on every rank alike: the new group
        trains from this step on as torch's optimizer trains it, its Adam
        state counting from here (design.md 2.1, "A group that starts
        later"). The flat buffer and the shards' layout are made anew with
        the group at the end (design.md 4, "A new layout mid-job"): rank 0
        carries the run's state over, so the other groups go on as they
        were. Adam, and OneBitAdam and OneBitLamb before freeze_step (the
        new layers' LAMB coefficients start as a job's do), ZeroOneAdam
        while a variance step is left before var_freeze_step (the group
        held until the next one, design.md 2.7; before its first step as
        if built with the group), CPU and CUDA tensors, the constant
        schedule; under --node-aggregation every rank of every node calls
        it (=sharded: the slices cut anew, the state moving with its
        parameters); in an elastic job rank 0 and the
        ranks still in it call it (those that had left are not waited for,
        and cannot join the new layout); with --rank-restarts a restarted
        rank's script adds the groups again before its first backward()
        (a restarted node's, on every rank of it; docs/python.md)."""
        if not hasattr(self, "_session"):  # torch's __init__ adding the groups
            super().add_param_group(param_group)
            return
        if self._awaiting is not None:
            self._add_awaited_group(param_group)
            return
        why = self._why_no_new_group()
        if self._node is not None:  # the node's ranks refuse alike (the leader checks the rule)
            why = next((w for w in self._node.objects(why) if w), None)
        if why:
            raise ValueError(f"add_param_group: {why}")
        param_group = dict(param_group, params=_group_params(param_group))
        groups = [dict(g) for g in self.param_groups]
        torch.optim.Optimizer(groups + [param_group], self.defaults)  # torch's checks
        step = self.step_index
        # The run's state, held on the host (on CUDA tensors the device then
        # holds one layout's optimizer state at a time, but for the flat
        # buffers: the old session goes before the new one is made).
        state = self._state_dict(server_error=True, on_host=True)["state"]
        # A sharded node's slices are cut anew over the grown model, so its
        # parameters' state moves with them between the node's ranks: each
        # gives the others its slice's arrays by parameter (x's moments and
        # the node's worker error; on node 0, its shards' error too).
        moved = self._state_by_parameter(state) if self._slices is not None else None
        for accumulator, handle in self._hooks:
            handle.remove()
        self._hooks = []
        # .grad as it is (a backward() before this call without overlap, or
        # the new parameters' own, which torch's optimizer would take at its
        # next step) goes on in the new flat buffer.
        grads = {id(p): p.grad.detach().to("cpu", copy=True)
                 for g in groups + [param_group] for p in _group_params(g)
                 if p.requires_grad and p.grad is not None}
        first_steps = self._first_steps + [step]
        # On CUDA tensors the old layout's session (its engine's state on the
        # device) goes before the new one is made; on the CPU it stays until
        # then, and the new session's channels find its connections to the
        # shards open (a call 250-340 ms against 340-520 at 4M parameters,
        # tests/bench/add_param_group_cost.py). torch's __init__ adds the
        # groups again.
        session = None if self._cuda else self._session
        try:
            self._rebuild(groups + [param_group], (self._generation + 1, first_steps, False))
        finally:
            del session
        with torch.no_grad():
            for p in self._params:
                if id(p) in grads:
                    p.grad.copy_(grads[id(p)])
        # Each array grows from what the new layout starts with (zeros; 1-bit
        # LAMB's layer state its initial values): the old elements and
        # layers keep their places, the new ones come after them. The last
        # step's commit (1-bit LAMB's) starts empty: the new layout's shards
        # are restored after that step and need none.
        fresh = {} if self._session is None else self._own_state(torch.device("cpu"))
        if moved is not None:
            state = self._slice_state(state, moved, fresh)
        for key, value in list(state.items()):
            if not torch.is_tensor(value):
                continue
            like = fresh[key] if key in fresh else torch.zeros(self._flat.numel())
            if like.numel() == 0:
                state[key] = like
            elif value.numel() < like.numel():
                grown = like.to(dtype=value.dtype, device=value.device).clone()
                grown[:value.numel()] = value
                state[key] = grown
        state["first_steps"] = first_steps
        self.load_state_dict({"state": state, "param_groups": self._saved_groups()})
        if self._checkpoint:
            # A rank restarted from here on starts from the new layout: its
            # description first, then its checkpoint of this step.
            self._write_layout()
            self._save_checkpoint()

    def _layers(self):
        """Each parameter's layer (1-bit LAMB's, design.md 2.8: every
        parameter tensor, and each group's padding, a layer of its own) and
        the layers' count."""
        layer, end, of = 0, 0, []
        for lo, hi in self._ranges:
            layer += lo != end  # the padding before it, a layer
            of.append(layer)
            layer, end = layer + 1, hi
        return of, layer + (end != self._flat.numel())

    def _layer_keys(self):
        """state_dict's keys of the optimizer's arrays kept by layer."""
        return {_STATE_DICT_KEYS.get(name, name)
                for name, _, per_element in self._session.state_arrays() if not per_element}

    def _state_by_parameter(self, state):
        """On a sharded node, before add_param_group lays it out anew: each
        parameter's part of every per-element array of the node's slices'
        states (and its layer's of 1-bit LAMB's layer state), by its index
        in the node's parameters, from every rank."""
        first = self._slices[self._node.local_rank][0]
        layer_keys = self._layer_keys()
        arrays = {key: value for key, value in state.items() if torch.is_tensor(value)
                  and value.numel() == self._flat.numel() and key not in layer_keys}
        layer_of, layers = self._layers()
        by_layer = {key: state[key].reshape(layers, -1) for key in layer_keys}
        mine = {}
        for i, (lo, hi) in enumerate(self._ranges):
            mine[first + i] = {key: value[lo:hi].clone() for key, value in arrays.items()}
            mine[first + i].update({key: value[layer_of[i]].clone()
                                    for key, value in by_layer.items()})
        moved = {}
        for told in self._node.objects(mine):
            moved.update(told)
        return moved

    def _slice_state(self, state, moved, fresh):
        """This rank's state for its slice of the grown model: its
        parameters' arrays as _state_by_parameter gave them (zeros for the
        new ones and for padding; a layer's state as a job starts it), the
        server error on node 0 alone."""
        first = self._slices[self._node.local_rank][0]
        keys = {key for arrays in moved.values() for key in arrays}
        if self._worker != 0:
            keys.discard("server_error")
        layer_keys = self._layer_keys()
        layer_of, layers = self._layers()
        sliced = dict(state)  # (the scalars, and a last commit, which the caller drops)
        for key in keys:
            if key in layer_keys:
                array = fresh[key].clone().reshape(layers, -1)
            else:
                array = torch.zeros(self._flat.numel())
            for i, (lo, hi) in enumerate(self._ranges):
                if key in moved.get(first + i, {}):
                    array[layer_of[i] if key in layer_keys else slice(lo, hi)] = \
                        moved[first + i][key]
            sliced[key] = array.reshape(-1)
        sliced["node_slice"] = [self._node.local_rank, len(self._slices)]
        return sliced

    def _check_not_awaiting(self, what):
        """MorseError if this rank, restarted after add_param_group, still
        waits for the script to add the run's groups again."""
        if self._awaiting is None:
            return
        layout = self._awaiting
        raise MorseError(
            f"FAILED_PRECONDITION: {what} on rank {self._rank}, restarted from its checkpoint of "
            f"step {layout['step']}, whose layout has {len(layout['groups'])} parameter groups, "
            f"the later ones added at steps {layout['first_steps'][1:]}; the optimizer has "
            f"{len(self.param_groups)}: call add_param_group with the others before the first "
            "backward(), as the run did (a script that may be restarted adds them by the step "
            "it starts from, e.g. `if step >= k and len(opt.param_groups) == n`)")

    def _write_layout(self):
        """Beside this rank's checkpoints (--rank-restarts), the layout
        they are of (_restarted_layout reads it)."""
        path = self._checkpoint[:-len(".ckpt")] + ".json"
        with open(path + ".tmp", "w") as f:
            json.dump({"generation": self._generation, "first_steps": self._first_steps,
                       "groups": _group_shapes(self.param_groups)}, f)
        os.replace(path + ".tmp", path)

    def _add_awaited_group(self, param_group):
        """add_param_group on a rank restarted after the run had added
        groups: the script adds them again, in order (their shapes are
        checked against the checkpoint's); with the last, the optimizer
        rejoins the job from its checkpoint of that layout."""
        layout = self._awaiting
        param_group = dict(param_group, params=_group_params(param_group))
        groups = [dict(g) for g in self.param_groups] + [param_group]
        torch.optim.Optimizer(groups, self.defaults)  # torch's checks
        have = _group_shapes(groups)
        want = layout["groups"]
        if have != want[:len(have)]:
            raise ValueError(
                f"add_param_group on rank {self._worker}, restarted from its checkpoint of step "
                f"{layout['step']}: the groups would have the shapes {have}, the checkpoint's "
                f"(added at steps {layout['first_steps'][1:]}) are {want}: add the groups the "
                "run added, in its order")
        if len(groups) < len(want):
            super().add_param_group(param_group)
            return
        self._rebuild(groups, (layout["generation"], layout["first_steps"], True))

    def _rebuild(self, groups, layout):
        """This optimizer made anew over `groups` (torch's __init__ adds
        them again) with `layout` = (generation, each group's first step,
        whether it rejoins from its checkpoint), its session dropped first:
        built from a module, it keeps the module's buffers and names, and a
        node keeps its group."""
        names = {id(p): name for p, name in zip(self._params, self._names)}
        generation, first_steps, rejoins = layout
        del self._session
        _MorseOptimizer.__init__(self, groups, _layout=(generation, first_steps, self._node, rejoins),
                                 **dict(self._built_with, buffers=list(self._buffers) or None))
        self._names = [names.get(id(p), name) for p, name in zip(self._params, self._names)]

    def _why_no_new_group(self):
        """Why add_param_group cannot add a group now, or None."""
        if self._pending is not None or getattr(self, "_launched", None):
            return ("this step's gradients are on their way to the shards: call it between "
                    "step() and the next backward()")
        if self._schedule != "constant":
            return (f"schedule={self._schedule!r} sets one lr for the whole model; groups need "
                    "the default schedule='constant'")
        # What the job's optimizer counts from a group's own first step is
        # the C++ rule's to say (compress::CheckStepHyper, as the shards do;
        # a node's leader says it for the node).
        why = None if self._session is None else self._session.first_step_refusal(self.step_index)
        if why:
            return (f"{type(self).__name__} cannot train a group from step {self.step_index}: "
                    f"{why}. Build the optimizer with every parameter, those to thaw later in a "
                    "group of their own with lr 0 and weight_decay 0")
        return None

    @property
    def rank(self):
        return self._rank

    @property
    def accumulation_steps(self):
        """backward() calls per step: as given, or as the first step had them."""
        return self._accumulation

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's `model.no_sync()` idiom for gradient accumulation: the
        backward() calls inside accumulate into .grad and push nothing; the
        next backward() outside pushes each parameter as its gradient is
        final, however many calls the step had (no accumulation_steps
        needed); a step whose backward() calls were all inside pushes at
        step()."""
        previous = self._in_no_sync
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = previous

    def _gradient_ready(self, i):
        if self._in_no_sync:
            self._no_sync_step = True
        if self._holds_pushes:
            self._counts[i] += 1  # the script edits .grad: step() pushes
            return
        if not self._joined:
            self._counts[i] += 1  # counted to learn the accumulation
            p, (lo, hi) = self._params[i], self._ranges[i]
            self._snapshot[lo:hi].copy_(p.grad.reshape(-1))
            self._snapshot_versions[i] = (p.grad, p.grad._version)
            # The views of the flat gradient share its version: the last
            # hook's is theirs as backward() left them.
            self._snapshot_flat_version = self._flat_grad._version
            if self._first_hyper is None:
                self._first_hyper = self._group_hyper()  # as the hooks would push them
            return  # the first step waits for every worker, then sends all
        if self._no_sync_step:
            if self._in_no_sync:
                return  # accumulating: the backward() after no_sync() pushes
            if self._synced[i]:
                self._surprised(f"a second backward() outside no_sync() reached {self._names[i]} "
                                "after the first had pushed its gradient")
                return
            self._synced[i] = True
        else:
            self._counts[i] += 1
        if not self._no_sync_step and self._counts[i] < self._accumulation:
            return  # gradient accumulation: push at the last backward()
        if not self._no_sync_step and self._counts[i] > self._accumulation:
            self._surprised(
                f"backward() reached {self._names[i]} {self._counts[i]} times, with "
                f"accumulation_steps={self._accumulation}"
                f"{' (as many as in the first step)' if self._learned_accumulation else ''}, "
                "after the last of those had pushed its gradient")
            return
        self._attach_grad(i)
        if self._pending is None:
            self._begin()
            self._pending = list(self._waiting_for)
        ready = []
        for q in self._touches[i]:
            self._pending[q] -= 1
            if self._pending[q] == 0:
                ready.append(q)
        if ready:
            self._send(ready)
        if self._snapshot is not None:
            for q in ready:
                b, e = self._partitions[q]
                self._snapshot[b:e].copy_(self._flat_grad[b:e])
        elif self._samples is not None:
            for q in ready:
                i0, i1 = self._sample_bounds[q]
                torch.index_select(self._flat_grad, 0, self._sample_index[i0:i1],
                                   out=self._samples[i0:i1])
        self._grad_version = self._flat_grad._version

    def _push_now(self, at_clip=False):
        """Pushes what backward() has not (everything, in the first step or
        with overlap=False): the step's gradients are final, at step() or
        at clip_grad_norm_ (at_clip). Keeps what step() checks in
        self._pushed."""
        first = not self._joined
        if first:
            # A fresh job waits for every rank before its first push; a
            # restarted rank joins a running one (a shard restarted since
            # counts only the ranks that joined it again).
            if not self._rejoined:
                self._session.wait_all_joined()
            self._joined = True
        # Gradients edited after the backward pass pushed them (clipping,
        # scaling, zeroing, another backward) bump the flat gradient's version;
        # with a snapshot, only changed bits count (see _edited_after_backward).
        edited = self._pending is not None and self._flat_grad._version != self._grad_version
        if first and self._snapshot is not None:
            edited = self._edited_after_backward_first(free=not at_clip)
        # A parameter whose .grad is None got no gradient in this step
        # (zero_grad(set_to_none=True) and a backward() that did not reach it):
        # torch.optim skips it; Morse updates every element every step.
        missing = [name for name, p in zip(self._names, self._params) if p.grad is None]
        self._restore_views()
        if not first and self._snapshot is not None and self._pending is not None:
            # The bits decide (an edit through .data moves no version counter).
            edited = self._edited_after_backward()
        elif (not edited and not first and self._snapshot is None and self._samples is not None
              and self._pending is not None):
            edited = self._sampled_edit()
        if self._pending is None:
            self._begin()
        if self._cuda:
            self._send([q for q in range(len(self._partitions))
                        if self._pending is None or self._pending[q] > 0])
        self._pending = [0] * len(self._partitions)  # every partition is on its way
        # Pushed before step() (by clip_grad_norm_): step() compares with
        # what left.
        pushed = (self._flat_grad._version, self._flat_grad.clone()) if at_clip else None
        self._pushed = (first, edited, missing, pushed)

    def _edited_after_backward_first(self, free=True):
        """The first step: whether any .grad changed after backward() left it
        (the hooks kept a copy). Keeps the copy for the next steps' pushes
        if something touched .grad at all; else frees it (`free`; pushed by
        clip_grad_norm_, step() decides, seeing what came after)."""
        touched, changed = False, False
        for p, seen, (lo, hi) in zip(self._params, self._snapshot_versions, self._ranges):
            if seen is None:
                continue  # backward() did not reach it: pushed at step()
            if p.grad is not None and p.grad._base is self._flat_grad:
                moved = self._flat_grad._version != self._snapshot_flat_version
            else:
                moved = p.grad._version != seen[1] if p.grad is not None else True
            now = p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(self._snapshot[lo:hi])
            # The bits too: an edit through .data moves no version counter.
            differs = not _same_bits(now, self._snapshot[lo:hi])
            if p.grad is not seen[0] or moved or differs:
                touched = True
                changed = changed or differs
        self._snapshot_versions = None
        self._snapshot_touched = touched
        if not touched and free:
            self._snapshot = None  # nothing edits the gradients after backward()
        return changed

    def _edited_after_backward(self):
        """Whether the bits of any partition pushed during backward() differ
        from what was pushed."""
        return any(not _same_bits(self._flat_grad[b:e], self._snapshot[b:e])
                   for q, (b, e) in enumerate(self._partitions) if self._pending[q] == 0)

    def _sampled_edit(self):
        """Whether the sampled bits of any partition pushed during backward()
        differ from what was pushed: an edit through .data (p.grad.data.mul_)
        first made after the first step, which no version counter shows. The
        sample (_sample_layout) holds every parameter's first and last
        element and one in 64 of each partition, so any edit of whole
        parameters shows; a sparse one may not."""
        if not any(self._pending):  # every partition left during backward(): one comparison
            return not _same_bits(torch.index_select(self._flat_grad, 0, self._sample_index),
                                  self._samples)
        for q, (i0, i1) in enumerate(self._sample_bounds):
            if self._pending[q] != 0 or i0 == i1:
                continue  # pushed now, as it is
            now = torch.index_select(self._flat_grad, 0, self._sample_index[i0:i1])
            if not _same_bits(now, self._samples[i0:i1]):
                return True
        return False

    def _surprised(self, what, holds=True):
        """The step in flight did something after its pushes had left
        (overlap): the step goes on with what was pushed, and step() adapts
        (_adapt). The first such thing in a step is the one reported."""
        if self._surprise is None:
            self._surprise = (what, holds)

    def _adapt(self, what, holds):
        """DDP's rule for what the script did after the step's pushes had
        left cannot hold for that step: say so, and (`holds`) push at step()
        from the next step on, as overlap=False, where every idiom gives
        DDP's result."""
        step = self.step_index - 1
        after = (f"from step {step + 1} on every step pushes at step() (as overlap=False), which "
                 "gives DDP's result for any edit, any number of backward() calls and a change "
                 "of lr before step(); doing it from the first step on (the first step pushes at "
                 "step() and decides), opt.no_sync() or accumulation_steps= keep the overlap"
                 if holds else f"it clips as under DDP from step {step + 1} on; call it from the "
                 "first step on (or pass clip_grad_norm=) to clip every step")
        warnings.warn(f"morse: in step {step} {what}. With overlap=True each partition is pushed "
                      "during backward() once its gradients are ready, so that step used the "
                      f"gradients as they were pushed; {after}", RuntimeWarning, stacklevel=3)
        if holds:
            self._holds_pushes = True
            self._snapshot = None

    def _attach_grad(self, i):
        # model.zero_grad(set_to_none=True) (torch 2's default) lets backward()
        # make a new .grad: gather it into the flat gradient before pushing.
        p, (lo, hi) = self._params[i], self._ranges[i]
        view = self._flat_grad[lo:hi]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)

    def _group_hyper(self):
        """(lr, weight_decay) of each segment of the flat buffer: of every
        group with parameters to train when the groups train apart, else
        param_groups[0]'s alone."""
        return tuple(_hyper_of(self.param_groups[i]) for i in self._segments)

    def _check_group(self, i, key, after_step=None):
        """ValueError unless param_groups[i][key] is param_groups[0]'s."""
        mine, first = self.param_groups[i][key], self.param_groups[0][key]
        if _as_list(mine) == _as_list(first):
            return
        when = "" if after_step is None else f" (step {after_step} used param_groups[0]'s)"
        if key in ("lr", "weight_decay"):
            raise ValueError(
                f"param_groups[{i}] has {key} {mine!r}, param_groups[0] {first!r}{when}: the "
                "groups had the same lr and weight_decay when the optimizer was built, and "
                f"{self._why_one_segment()} they train as one segment of the flat buffer, so they "
                "must go on agreeing; give them different values when building it or the same "
                "values now")
        raise ValueError(
            f"param_groups[{i}] has {key} {mine!r}, param_groups[0] {first!r}{when}: a Morse "
            f"optimizer applies one {key} to the whole model (one update rule on every rank and "
            "shard), so every group must have the same")

    def _step_moments(self):
        """Each segment's (beta1, beta2, eps) where any differs from the
        job's (followed with schedule='constant'), else None."""
        rules = tuple(_moments_of(self.param_groups[i]) for i in self._segments)
        job = (*self._update_rule[0], *self._update_rule[1])
        return None if all(rule == job for rule in rules) else rules

    def _check_update_rule(self, after_step=None):
        """ValueError if param_groups[0]'s betas or eps differ from the
        job's (a scheduler that cycles them, a manual change) where the
        optimizer cannot follow them (with Morse's own schedule): the shards
        and every rank apply the values the optimizer was built with, so a
        change would otherwise be ignored."""
        if getattr(self, "_follows_moments", False):
            return
        for key, built in zip(("betas", "eps"), self._update_rule):
            now = self.param_groups[0][key]
            if _as_list(now) == built:
                continue
            shown = tuple(built) if key == "betas" else built[0]
            when = "" if after_step is None else f" (step {after_step} used {shown})"
            raise ValueError(
                f"param_groups[0] has {key} {_shown_value(now)}, but the optimizer was built with "
                f"{shown}{when}: with schedule={self._schedule!r}, {type(self).__name__}'s betas "
                "and eps are the job's update rule, fixed when it starts on every rank and shard "
                "(with the default schedule='constant' they are followed step by step, as torch's "
                "schedulers set them). A scheduler that cycles the momentum (OneCycleLR and "
                "CyclicLR, whose cycle_momentum=True is the default) needs schedule='constant'; "
                "otherwise build the optimizer with the values you want")

    def _why_one_segment(self):
        """Why groups that agreed when built train as one (for messages)."""
        if self._schedule != "constant":
            return f"with schedule={self._schedule!r} (one lr for the whole model)"
        return "with one of them holding every parameter to train"

    def _check_groups(self, after_step=None):
        """ValueError unless param_groups[0] has the job's betas and eps,
        every group has param_groups[0]'s, and its lr and weight_decay
        unless the groups train apart (at construction and every step: a
        change in one group would otherwise be ignored)."""
        if hasattr(self, "_update_rule"):
            self._check_update_rule(after_step)
        # Groups trained apart with Adam take their own betas and eps too.
        moments = () if self._groups_apart and self._follows_moments else ("betas", "eps")
        keys = moments if self._groups_apart else ("lr", "weight_decay") + moments
        for i in range(1, len(self.param_groups)):
            for key in keys:
                self._check_group(i, key, after_step)

    def _begin(self):
        changed = [n for n, p, v in zip(self._names, self._params, self._x_versions) if p._version != v]
        # A node's leader gets here for the node (_node_step checked that
        # its ranks hold the same parameters).
        if changed and self._session.step_index == 0:
            # Weights loaded after the optimizer was built, before the first
            # step (a fine-tuning script's order): they become the job's.
            # Rank 0 gives them to the shards, every other rank that loaded
            # them waits until the shards hold the same; the pushes of step
            # 0 carry each partition's hash, so a rank that did not load
            # them when rank 0 did (or the reverse) fails the step, saying so.
            with self._device_context(), self._explained():
                if self._cuda:  # the copies into the parameters are done
                    torch.cuda.current_stream(self._device).synchronize()
                self._session.reload_model()
            self._x_versions = [p._version for p in self._params]
        elif changed and self._session.exchanged_step != self._session.step_index:
            # Inside a ZeroOneAdam local interval each rank's parameters are
            # its own (design.md 2.7): a change is this rank's, its local
            # steps go on from it, and the interval's sync gives every rank
            # x from the anchor, which the shards hold, as always. Nothing
            # to give them (a swap and restore of the same bits, as EMA
            # helpers make for an evaluation, changes nothing).
            self._x_versions = [p._version for p in self._params]
        elif changed:
            # Changed after a step (a clamp_, a max_norm embedding's renorm,
            # load_state_dict(best)), as DDP allows: the changed weights
            # become the job's (before a ZeroOneAdam local interval, its
            # anchor), the optimizer's state going on. Rank 0
            # gives the shards its x; the others wait until they hold the
            # same; the next pushes carry each partition's hash, so a rank
            # that changed its weights otherwise stops the job, saying so.
            # Nothing to give where the shards hold this model already:
            # written back with the bits the step left (weights swapped in
            # for an evaluation and restored, as EMA helpers do), or changed
            # alike on every rank and given to them by rank 0 before this
            # rank got here.
            holds = self._holds_shards_model()
            with self._device_context(), self._explained():
                if not holds:
                    if self._cuda:
                        torch.cuda.current_stream(self._device).synchronize()
                    self._session.reload_model()
                if self._checkpoint and self.step_index % self._checkpoint_every == 0:
                    # This step's checkpoint, written as the last step
                    # ended, may predate the change: a restart from it
                    # replays this step's pushes, which are of these
                    # weights, and would not make the change again (the
                    # script made it after that step).
                    self._save_checkpoint()
            self._x_versions = [p._version for p in self._params]
        self._check_groups()
        if self._session_buffers and self._rank == 0:
            self._session.set_buffers(self._pack_buffers())
        hyper = self._group_hyper()
        if self._follow_groups:
            moments = self._step_moments() if self._follows_moments else None
            firsts = [self._first_steps[i] for i in self._segments]
            self._session.set_step_hyper([lr for lr, _ in hyper], [wd for _, wd in hyper], moments,
                                         firsts if any(firsts) else None)
            self._sent_hyper, self._sent_moments = hyper, moments
        elif hyper != self._initial_hyper:
            (lr, weight_decay), = hyper
            raise ValueError(f"param_groups[0] has lr {lr} and weight_decay {weight_decay}, but with "
                             f"schedule={self._schedule!r} the job's schedule sets them as built "
                             f"({_shown_hyper(self._initial_hyper)}); use either Morse's schedule "
                             "or torch's (with the default schedule='constant')")
        with self._explained():
            if self.clip_grad_norm is None or self._slices is not None:
                self._session.set_step_clipping(self._clips or self.clip_grad_norm is not None)
            if self._cuda:
                self._session.begin_device()
            else:
                self._session.begin(self._flat_grad.numpy())

    def _holds_shards_model(self):
        """Whether the shards hold these parameters (the step after a write
        to them: compares each partition's hash of x with the shards')."""
        with self._device_context(), self._explained():
            if self._cuda:  # torch's writes to the parameters are done
                torch.cuda.current_stream(self._device).synchronize()
            return self._session.holds_shards_model()

    def _pack_buffers(self):
        return b"".join(t.detach().cpu().contiguous().numpy().tobytes() for _, t in self._buffers)

    def _take_buffers(self):
        """Every rank takes rank 0's buffers of the step that just ended."""
        got = self._session.received_buffers()
        mine = sum(t.numel() * t.element_size() for _, t in self._buffers)
        if len(got) != mine:
            raise MorseError(
                f"FAILED_PRECONDITION: rank 0 sent {len(got)} bytes of module buffers, this rank "
                f"(rank {self._rank}) has {mine}: build the same model on every rank, with the same "
                "broadcast_buffers setting")
        if self._rank == 0:
            return
        self._unpack_buffers(got)

    def _unpack_buffers(self, got):
        data, at = bytearray(got), 0
        with torch.no_grad():
            for _, t in self._buffers:
                if t.numel():
                    t.copy_(torch.frombuffer(data, dtype=t.dtype, count=t.numel(), offset=at).view(t.shape))
                at += t.numel() * t.element_size()

    @contextlib.contextmanager
    def _explained(self):
        try:
            yield
        except MorseError as error:
            if " stopped the job at step " in str(error):
                # Another rank's step failed and it stopped the job on the
                # shards: its reason is in the message, its parameters in its
                # own error.
                raise MorseError(f"{error}\n  this rank (rank {self._rank}) is stopped too; the "
                                 "failing rank's own error says where and what to try") from None
            if "not finite" in str(error):
                raise self._explain(error) from None
            raise

    def _explain(self, error):
        """A non-finite value stopped the step: say where and what to try."""
        step = self.step_index
        if self._freeze_step is None:
            phase = "adam"
        else:
            phase = "compression phase" if step >= self._freeze_step else "warmup"
        bad, largest = [], (0.0, None)
        with torch.no_grad():
            for name, (lo, hi) in zip(self._names, self._ranges):
                x, g = self._flat[lo:hi], self._flat_grad[lo:hi]
                if not (torch.isfinite(x).all() and torch.isfinite(g).all()):
                    bad.append(name)
                else:
                    top = x.abs().max().item() if hi > lo else 0.0
                    if top > largest[0]:
                        largest = (top, name)
        where = (f"non-finite values in {', '.join(bad)}" if bad else
                 f"no parameter holds Inf or NaN; the largest |x| is {largest[0]:.3g} in {largest[1]}")
        advice = ("likely causes: a learning rate too large for this model"
                  + ("; in 1-bit Adam's compression phase, elements whose frozen variance is tiny but "
                     "not zero get steps of about lr*scale/sqrt(v) unless bound_update (default True) "
                     "bounds them (keep bound_update and mask_zero_variance on, or try a larger eps "
                     "such as 1e-6, a later freeze_step, or a lower lr)"
                     if phase == "compression phase" else "")
                  + "; a loss that is already Inf or NaN (check it before step())")
        return MorseError(f"{error}\n  at step {step} ({phase}): {where}\n  {advice}")

    def _send(self, partitions):
        """Pushes the partitions (ids, in order) in one call. On CUDA the
        session's work on the gradient from now on (these encodes, a clip's
        norm) waits for the work queued so far on PyTorch's current stream,
        without blocking the host; an empty list only waits."""
        if not partitions and not self._cuda:
            return
        if self._cuda:
            with torch.cuda.device(self._device):
                with self._explained():
                    self._session.send_partitions(
                        partitions, torch.cuda.current_stream(self._device).cuda_stream)
        else:
            with self._explained():
                self._session.send_partitions(partitions)

    def _restore_views(self):
        # Someone may have replaced a .grad (set_to_none, or an assignment);
        # gather it back into the flat gradient.
        for p, (lo, hi) in zip(self._params, self._ranges):
            view = self._flat_grad[lo:hi]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            else:
                continue
            p.grad = view.view_as(p)

    def zero_grad(self, set_to_none=None):
        """As torch.optim's, with the installed torch's default for set_to_none
        (False in torch 1.x, True from torch 2.0): the flat gradient is zeroed
        in place, and with set_to_none every .grad is set to None as well (the
        next backward() gathers the new gradients back into the flat buffer),
        so a parameter that then gets no gradient is seen as such at step()."""
        if set_to_none is None:
            set_to_none = _ZERO_GRAD_SETS_TO_NONE
        if self._awaiting is not None:  # (a restarted rank: no flat buffer yet)
            torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)
            return
        self._flat_grad.zero_()
        if set_to_none:
            for p in self._params:
                p.grad = None
        for p in self._others:  # a sharded node's other slices: as torch.optim
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None, **amp):
        # (**amp: torch 1.13's GradScaler passes grad_scaler=; torch 2's,
        # given no such parameter, sets attributes instead, without a warning.)
        grad_scaler = amp.pop("grad_scaler", None)
        if amp:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(amp)}")
        self._check_not_awaiting("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._skipped_last = self._scaler_step(grad_scaler)
            if self._skipped_last:
                return loss  # every rank skips it: some rank's gradients overflowed
        finally:
            self._loss_scaled, self._overflowed = False, None
            _warn_if_group_cannot_take_back(self._elastic)
        _check_own_state_loaded(self, "optimizer state of step",
                                "its worker error buffer is its own, and another's would change "
                                "the run")
        if self._slices is not None:
            self._slice_step()
        elif self._node is not None:
            self._node_step()
        else:
            self._worker_step()
        # A group's lr or weight_decay set apart from the others after this
        # step's pushes left (between backward() and step()).
        self._check_groups(after_step=self.step_index - 1)
        self._check_thawed()
        return loss

    def _loss_scaled_by(self, scaler):
        """A torch.amp.GradScaler scales a loss (before its backward()): the
        step's gradients are scaled and may overflow on some rank, so its
        pushes wait for step() (as overlap=False), where the ranks decide
        together whether to skip it."""
        self._scaler, self._loss_scaled = scaler, True
        if not self._holds_pushes:
            self._holds_pushes = True
            self._snapshot = None
        # A node's ranks gather their gradients at step() from now on (no
        # bucket leaves during backward()).
        self._node_buckets = None

    def _scaler_step(self, grad_scaler):
        """A step that torch.amp.GradScaler drives (fp16 loss scaling; its
        grad_scale and found_inf attributes): as under DDP, where every rank
        sees the averaged gradient, the job skips the step on every rank if
        any rank's gradients hold Inf or NaN (a MAX of the ranks' verdicts
        over torch.distributed's group), and tells each rank's scaler so,
        so that every rank's loss scale moves alike; else it unscales .grad
        where the script did not (scaler.unscale_) and the step goes on.
        Returns whether the step is skipped. ValueError where Morse cannot
        (see below)."""
        found_inf, grad_scale = _amp_of(self)
        if grad_scaler is None and found_inf is None:
            return False
        if grad_scaler is not None and not hasattr(grad_scaler, "_per_optimizer_states"):
            found_inf = None  # not torch's GradScaler (refused below)
        if (grad_scaler is not None and found_inf is not None) or not self._loss_scaled \
                or grad_scaler not in (None, self._scaler):
            # (A scale() that did not tell this optimizer: its pushes left
            # during backward(), scaled, before anything knew of an
            # overflow.)
            raise _grad_scaler_refused(
                self, "this step", "this GradScaler hands Morse the step only after its pushes "
                "have left (torch's GradScaler tells a Morse optimizer at scale(), before "
                "backward())")
        if grad_scaler is not None:
            # torch 1.13's contract (step(grad_scaler=)): the optimizer
            # unscales .grad through the scaler, where the script did not
            # (scaler.unscale_), which records this rank's verdict.
            state = grad_scaler._per_optimizer_states[id(self)]
            if not state["found_inf_per_device"]:
                grad_scaler.unscale_(self)
            grad_scale = None  # unscaled
            own = 1 if sum(v.item() for v in state["found_inf_per_device"].values()) > 0 else 0
        else:
            own = 1 if found_inf.item() > 0 else 0
        overflowed = self._step_overflowed(own=own)
        # The job's verdict in the scaler's own record (what its update()
        # reads), so that every rank backs off or grows its scale alike.
        states = getattr(self._scaler, "_per_optimizer_states", None)
        if states is not None and id(self) in states:
            for t in states[id(self)].get("found_inf_per_device", {}).values():
                t.fill_(1.0 if overflowed else 0.0)
        if overflowed:
            self._skip_step()
            return True
        if grad_scale is not None:  # as scaler.unscale_ would, had the script called it
            _unscale(self._node_params if self._node is not None else self._params, grad_scale)
        return False

    def _step_overflowed(self, own=None):
        """Whether some rank's gradients in this loss-scaled step hold Inf or
        NaN: the job's verdict, taken once a step on every rank alike (a
        collective of torch.distributed's default group, which this starts
        over MASTER_ADDR and MASTER_PORT, as morse-run and torchrun set
        them, where the script has not), kept in self._overflowed: 0, 1
        (Inf), 2 (NaN somewhere). `own`: this rank's, else found here. A
        process restarted by morse-run --rank-restarts (MORSE_REJOIN=1)
        stops here: it cannot join the others' group again (its
        init_process_group finds their connections gone), and its
        GradScaler starts over."""
        if self._overflowed is None and os.environ.get("MORSE_REJOIN") == "1":
            raise MorseError(
                f"FAILED_PRECONDITION: fp16 loss scaling {_CANNOT_TAKE_BACK}: this rank is back "
                "from a restart, and the job's ranks agree on each step's overflow through "
                "torch.distributed's group, which it cannot join again (and its GradScaler "
                f"would start over from its initial scale); {_RESTART_WHOLE}")
        if self._overflowed is None:
            if own is None:
                params = self._node_params if self._node is not None else self._params
                own = _overflow_of([p.grad for p in params if p.grad is not None])
            self._overflowed = _job_max(own, self._rank, self._world)
        return self._overflowed > 0

    def _skip_step(self):
        """Ends a step that every rank skips: nothing was pushed (its pushes
        wait for step()), and nothing of it counts."""
        n = len(self._params)
        self._counts, self._synced, self._no_sync_step = [0] * n, [False] * n, False
        self._pending, self._pushed, self._clipped = None, None, False
        self._part_factors = self._part_base = None
        self._own_clipping, self._own_scaled = None, False
        self._shown = self._amending = False

    def _check_thawed(self):
        """MorseError if a parameter frozen when the optimizer was built
        (left out of the flat buffer) has a gradient now: torch.optim would
        train it, and Morse cannot."""
        thawed = [n for n, p in self._left_out if p.requires_grad and p.grad is not None]
        if not thawed:
            return
        shown = ", ".join(thawed[:5]) + (f" and {len(thawed) - 5} more" if len(thawed) > 5 else "")
        raise MorseError(
            f"FAILED_PRECONDITION: {shown} had requires_grad=False when the optimizer was built "
            f"and got a gradient in step {self.step_index - 1}, which trained the other "
            "parameters alone; torch.optim would have trained it too, but Morse left it out of "
            "the flat buffer the shards hold (fixed when the job starts). To thaw parameters "
            "later, build the optimizer with them trainable, in a parameter group of their own "
            "with lr=0 and weight_decay=0 (they stay bit for bit as they are), and raise its lr "
            "when they thaw")

    def _owned(self, parameters):
        """For clip_grad_norm_: None if none of `parameters` is this
        optimizer's (or it leaves clipping to torch); else the indices of
        its trainable parameters among them. ValueError for a mix."""
        trained = self._params if self._node is None else self._node_params
        mine = {id(p) for p in trained}
        ours = [p for p in parameters if id(p) in mine]
        if not ours:
            return None
        if self.clip_grad_norm is not None:
            return None  # the optimizer clips (clip_grad_norm=); torch's as before
        others = [p for p in parameters if id(p) not in mine and p.grad is not None]
        if others:
            raise ValueError("clip_grad_norm_ over a Morse optimizer's parameters and others at "
                             "once: clip them apart (Morse clips the averaged gradient of all of "
                             "its own)")
        chosen = {id(p) for p in ours}
        return [i for i, p in enumerate(trained) if id(p) in chosen]

    def _clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite, owned):
        """clip_grad_norm_ on this optimizer's parameters (see the module's)."""
        order = float(norm_type)
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_(..., max_norm={max_norm}) on a Morse optimizer's "
                             "parameters: a positive max_norm (inf for the norm alone)")
        if self._loss_scaled and self._step_overflowed():
            # Some rank's gradients overflowed: every rank skips the step,
            # and the norm is not finite, as DDP's of the averaged gradient
            # (NaN where some rank's holds a NaN, else Inf).
            norm = math.nan if self._overflowed == 2 else math.inf
            return self._norm_tensor(norm, order, error_if_nonfinite, len(owned))
        if self._node is not None:
            return self._node_clip(max_norm, order, error_if_nonfinite, owned)
        if self._shown and not self._amending:
            self._fold_or_amend()  # an edit since the last clip's .grad
        if self._amending:
            return self._amended_clip(max_norm, order, error_if_nonfinite, owned)
        if self._own_clipping is None and self.clip_grad_norm is None:
            if self._clipped or self._part_factors is not None:
                self._own_clipping = False
            else:
                self._push_for_clip()
                with self._explained():
                    self._own_clipping = self._session.clips_locally()
        if self._own_clipping:
            return self._own_clip(max_norm, order, error_if_nonfinite, owned)
        if len(owned) < len(self._params) or self._part_factors is not None:
            norm = self._part_clip(max_norm, order, error_if_nonfinite, owned)
        else:
            norm = self._worker_clip(max_norm, order, error_if_nonfinite, len(owned))
        self._show_clipped_average()
        return norm

    def _show_clipped_average(self):
        """After a clip_grad_norm_ of the averaged gradient whose pushes left
        at the clip (the step's first, or overlap=False): .grad becomes what
        DDP's holds after its clip, the clipped average, every rank's the
        same bits (the session's ClippedAverage: the replies decoded and
        scaled as every replica will), so that an edit of .grad after the
        clip acts on it as under DDP; step() compares .grad with it
        (design.md 2.6, "Edits after the clip"). In a node the rank that
        steps (the leader, or a slice's owner) shows it and _node_show gives
        it to every rank. Not in a compressing step, where the pushes left
        during backward() (step() adapts there), or on CUDA tensors (it would
        cost a decode of the model on the host and its copy to the device
        every clipped step: .grad keeps the rank's own gradient there until
        the script is seen editing it after a clip, _shows_average).
        Returns whether it showed it."""
        pushed = self._pushed[3] if self._pushed is not None else None
        if pushed is None or self._own_clipping or not self._shows_average:
            return False
        if self._part_factors is not None:
            if self._part_base[1]:
                return False  # this rank's own gradient
            with self._explained():
                self._session.clip_pieces(_clip_pieces(self._ranges, self._part_factors,
                                                       self._flat_grad.numel()))
        elif not self._clipped or self._clipped[2] is None:
            return False  # the step runs unclipped
        self._restore_views()
        with self._device_context(), self._explained():
            if self._cuda:  # decoded on the host, where the engine stages the replies
                average = torch.empty(self._flat_grad.numel(), dtype=torch.float32)
                self._session.clipped_average(average)
                with torch.no_grad():
                    self._flat_grad.copy_(average)
            else:
                self._session.clipped_average(self._flat_grad)
        first, edited, missing, _ = self._pushed
        self._pushed = (first, edited, missing, (self._flat_grad._version, self._flat_grad.clone()))
        self._shown = True
        return True

    def _learn_to_show(self):
        """The step just ended edited .grad after clip_grad_norm_, otherwise
        than by factors, where .grad held this rank's own clipped gradient
        (CUDA tensors, _shows_average): the step trained on the clipped
        average unedited. From the next step on .grad after the clip holds
        the clipped average, as under DDP, and such edits amend the step
        (and the pushes wait for the clip)."""
        step = self.step_index - 1
        self._show_average()
        warnings.warn(
            f"morse: in step {step} .grad was edited after clip_grad_norm_ on CUDA tensors, "
            "where .grad after the clip holds this rank's own gradient until a script is seen "
            "editing it: that step trained on the clipped average without the edit. From step "
            f"{step + 1} on .grad after clip_grad_norm_ holds the clipped average, as DDP's does, "
            "and edits of it train as under DDP (at the cost of a decode of the model on the host "
            "and its copy to the GPU in each clipped step)", RuntimeWarning, stacklevel=3)

    def _show_average(self):
        """From the next step on .grad after clip_grad_norm_ holds the
        clipped average (_shows_average), and an overlapping rank holds its
        pushes until the clip, which an edit after it may amend."""
        self._shows_average = True
        if self._overlap:
            self._holds_pushes = True
            self._snapshot = None

    def _fold_or_amend(self):
        """A clip_grad_norm_ after an earlier one of the step showed the
        clipped average in .grad: an edit since then that scaled each
        parameter's whole gradient joins the step's clip (_fold_edit), any
        other makes .grad the step's gradient from here on (_amending)."""
        self._restore_views()
        shown = self._pushed[3][1]
        if _same_bits(self._flat_grad, shown):
            return
        if self._fold_edit(shown) is None:
            self._amending = True
            return
        if self._part_base[0] is None:  # the clip's norms are of the average from here on
            self._part_base = (self._averaged_gradient(), False, {})
        self._pushed = self._pushed[:3] + ((self._flat_grad._version, self._flat_grad.clone()),)

    def _amended_clip(self, max_norm, order, error_if_nonfinite, owned):
        """clip_grad_norm_ once .grad is the step's gradient (_amending):
        torch's own on .grad, in place, as DDP's on the averaged gradient
        its .grad holds (every rank's the same)."""
        limit = 0.0 if math.isinf(max_norm) else max_norm
        self._restore_views()
        norm = self._norm_by_parameter(self._flat_grad, order, owned)
        returned = self._norm_tensor(norm, order, error_if_nonfinite, len(owned))
        self._scale_in_place(owned, _float32(_clip_factor(norm, limit)))
        return returned

    def _scale_in_place(self, owned, scale):
        """A clip of .grad itself, as torch's: the parameters of indices
        `owned` scaled by `scale` (a float32 factor) where it is below 1."""
        if scale < 1.0:
            with torch.no_grad():
                for i in owned:
                    lo, hi = self._ranges[i]
                    self._flat_grad[lo:hi].mul_(scale)

    def _own_clip(self, max_norm, order, error_if_nonfinite, owned):
        """clip_grad_norm_ in a step that clips this rank's own gradient and
        pushes it at step() (a compressing step; DeepSpeed's rule): torch's
        own, on .grad as it is now, scaled in place, so that .grad is
        torch's after it and an edit after it is pushed as torch would have
        it (step() pushes .grad as it finds it). The step's first clip of
        the whole model by L2 takes the session's sum of squares and its
        factor (compress::ClipScale), as clip_grad_norm= does: the same
        bits."""
        limit = 0.0 if math.isinf(max_norm) else max_norm
        self._restore_views()  # a .grad the script replaced is the one to clip
        if len(owned) == len(self._params) and order == 2.0 and not self._own_scaled:
            if self._cuda:
                self._send([])  # the session's sum reads .grad as torch's work leaves it
            with self._explained():
                sum_of_squares = self._session.clip(0.0)  # and the session scales by nothing
            norm = math.sqrt(sum_of_squares)
            scale = _clip_scale(sum_of_squares, limit)
        else:
            norm = self._norm_by_parameter(self._flat_grad, order, owned)
            scale = _float32(_clip_factor(norm, limit))
        returned = self._norm_tensor(norm, order, error_if_nonfinite, len(owned))
        self._own_scaled = True
        self._scale_in_place(owned, scale)
        return returned

    def _part_clip(self, max_norm, order, error_if_nonfinite, owned):
        """clip_grad_norm_ over some of the parameters (`owned`: their
        indices), or any clip in a step that had one (design.md 2.6,
        "Clipping part of the model"): as torch's on the gradient the step's
        earlier calls clipped, with a factor per parameter. In a step that
        averages, the norms are of the averaged gradient (decoded from the
        replies every worker holds) and step() sends the factors as the
        step's clip pieces; in a compressing step, of this rank's own
        gradient, which step() scales in place before its pushes leave."""
        seen_each = self._part_norms(order, owned)
        if seen_each is None:  # this step runs unclipped (_unclipped_step)
            return self._norm_tensor(self._norm_by_parameter(self._flat_grad, order, owned),
                                     order, error_if_nonfinite, len(owned))
        seen = _norm_of_norms(seen_each, order)
        self._part_scale(owned, seen, max_norm)
        return self._norm_tensor(seen, order, error_if_nonfinite, len(owned))

    def _part_norms(self, order, owned):
        """The norms of order `order` of the parameters of indices `owned`
        (among self._params) as the step's earlier clips left them, in
        order; None where the step runs unclipped (its pushes left before
        its first clip). The step's first such call takes the base gradient
        and turns the factor of its earlier clips of the whole model, if
        any, into one per parameter."""
        if self._part_factors is None:
            clipped = self._clipped
            if clipped and clipped[2] is None:
                return None
            self._push_for_clip()
            try:
                with self._device_context(), self._explained():
                    own = self._session.clips_locally()
                    if own and self._cuda:
                        raise MorseError(
                            "UNIMPLEMENTED: clip_grad_norm_ over part of a Morse optimizer's "
                            "parameters on CUDA tensors in a step that compresses (its pushes "
                            "left at the clip, on the GPU): pass them all (model.parameters())")
                    self._session.clip(0.0)  # waits for every reply where the step averages
            except MorseError as error:
                self._clipped = (self._unclipped_step(error), 1.0, None)
                return None
            base = self._flat_grad if own else self._averaged_gradient()
            factor = clipped[1] if clipped else 1.0
            self._part_factors = [factor] * len(self._params)
            self._part_base = (base, own, {})
        base, own, by_order = self._part_base
        if order not in by_order:
            by_order[order] = [float(torch.linalg.vector_norm(base[lo:hi].double(), order))
                               for lo, hi in self._ranges]
        norms = by_order[order]
        factors = self._part_factors
        # Each parameter's norm as the earlier calls left it (order 0 counts
        # non-zeros, which a factor keeps unless it is 0).
        return [(norms[i] if factors[i] != 0.0 else 0.0) if order == 0 else norms[i] * factors[i]
                for i in owned]

    def _averaged_gradient(self):
        """The step's averaged gradient, decoded from the replies this rank
        holds (a new host tensor), once the clip has waited for them."""
        base = torch.empty(self._flat_grad.numel(), dtype=torch.float32)
        with self._explained():
            self._session.average_gradient(base)
        return base

    def _part_scale(self, owned, seen, max_norm):
        """A clip of part of the model whose parameters (indices `owned`)
        have the norm `seen`: their factors times its clip factor."""
        more = 1.0 if math.isinf(max_norm) else _clip_factor(seen, max_norm)
        if more < 1.0:
            for i in owned:
                self._part_factors[i] *= more

    def _node_clip(self, max_norm, order, error_if_nonfinite, owned):
        """clip_grad_norm_ in a node (every rank of it calls it): the node's
        gradient is gathered (once a step), the leader clips as the node's
        worker does (_worker_clip) and tells the node the norm; sharded,
        each owner takes its slice's norms, the node combines them into the
        model's (each order's norm of the slices' norms, as torch takes the
        norm of the parameters' norms) and each owner clips its slice by
        that norm's factor. Every rank returns the norm."""
        node = self._node
        if self._gathered is None:
            self._node_gather(at_clip=True)
        norm = self._node_own_clip(max_norm, order, owned)
        if norm is not None:
            return self._norm_tensor(norm, order, error_if_nonfinite, len(owned))
        failure, error, norm = self._gathered[1], None, None
        if self._node_shown:
            norm = self._node_clip_after_show(max_norm, order, owned, failure)
            if norm is not None:
                return self._norm_tensor(norm, order, error_if_nonfinite, len(owned))
        # A clip of part of the model, or any clip in a step that had one
        # (every rank of the node calls it: the leader, or every owner,
        # decides alike).
        part = len(owned) < len(self._node_params) or self._part_factors is not None
        if self._slices is not None and part:
            local = self._stepped_here(owned)
        if failure is None and self._session is not None:
            try:
                if self._slices is None and part:
                    norm = float(self._part_clip(max_norm, order, False, owned))
                elif self._slices is None:
                    norm = float(self._worker_clip(max_norm, order, False, len(owned)))
                elif part:
                    norm = self._part_norms(order, local)  # this slice's parameters' norms
                else:
                    norm = self._slice_norms(order)
            except Exception as e:  # the node hears it before this rank raises it
                error, failure = e, _told(e)
        if self._slices is None:
            failure, norm = node.objects((failure, norm) if node.is_leader else None)[0]
            failed = [(0, failure)] if failure is not None else []
        else:
            outcomes = node.objects((failure, norm))
            failed = [(k, f) for k, (f, _) in enumerate(outcomes) if f is not None]
            if not failed and part:
                # The slices hold the parameters in order: their norms
                # together are the model's, as one worker lists them.
                norm = _norm_of_norms([n for _, each in outcomes for n in each], order)
                self._part_scale(local, norm, max_norm)
            elif not failed:
                norm = self._combine_slice_norms([n for _, n in outcomes], order, max_norm)
        self._raise_clip_failure(failed, error)
        self._node_show()
        return self._norm_tensor(norm, order, error_if_nonfinite, owned)

    def _node_outcomes(self, failure, value):
        """Every rank of a node: the (local rank, failure) of the ranks
        that step (the leader; sharded, every owner) that failed, and their
        `value`s in local-rank order."""
        node = self._node
        if self._slices is None:
            failure, value = node.objects((failure, value) if node.is_leader else None)[0]
            return ([(0, failure)] if failure is not None else []), [value]
        outcomes = node.objects((failure, value))
        return [(k, f) for k, (f, _) in enumerate(outcomes) if f is not None], [v for _, v in outcomes]

    def _node_show(self):
        """After a node's clip of the averaged gradient: the rank that steps
        (or each slice's owner) shows the clipped average in .grad
        (_show_clipped_average) and every rank of the node takes it as its
        .grad, as DDP's ranks hold it, kept to compare the ranks' .grad
        with at step() and at a later clip (_node_grads_agree). Not for the
        optimizer's own clip_grad_norm= (a sharded node's step() clips so;
        the script reads no .grad after it). Where nothing is shown, each
        rank keeps what it sent, to compare its .grad with at step()
        (_keep_sent)."""
        if self.clip_grad_norm is not None:
            self._keep_sent()
            return
        failure, error, shown = None, None, False
        if self._session is not None:
            try:
                shown = self._show_clipped_average()
            except Exception as e:  # the node hears it before this rank raises it
                error, failure = e, _told(e)
        failed, shown = self._node_outcomes(failure, shown)
        self._raise_clip_failure(failed, error)
        if not any(shown):
            self._keep_sent()
            return
        self._share_stepped_grads()
        self._node_shown = True

    def _share_stepped_grads(self):
        """Every rank of the node takes as its .grad what the ranks that
        step hold (the leader's, or each slice's owner's), kept to compare
        the ranks' .grad with (_node_grads_agree)."""
        if self._slices is None:
            self._restore_views()
            self._node.share(self._flat_grad)
        else:
            self._share_slice_grads()
        self._node_clipped = self._kept_clip()

    def _node_clip_after_show(self, max_norm, order, owned, failure):
        """A node's clip_grad_norm_ after an earlier one of the step gave
        every rank the clipped average (_node_show): the ranks' .grad must
        agree; an edit since that scaled each parameter's whole gradient
        joins the step's clip (_fold_or_amend) and the clip goes on as the
        first did (None returned); any other makes .grad the step's gradient
        on every slice (amended at step()), and this clip is torch's own on
        it, as _node_own_clip's: the norm returned."""
        error, amending = None, None
        differ = self._node_grads_agree("between two clip_grad_norm_ calls")
        failure = failure or differ
        if self._session is not None and failure is None:
            try:
                if self._shown and not self._amending:
                    self._fold_or_amend()
                amending = self._amending
            except Exception as e:
                error, failure = e, _told(e)
        failed, amending = self._node_outcomes(failure, amending)
        self._raise_clip_failure(failed, error)
        if not any(amending):
            if self._slices is not None:
                # Where one slice's edit joined its clip as factors, every
                # slice's clip goes on by factors, so that the owners clip
                # alike (_node_clip's `part`).
                _, parts = self._node_outcomes(None, self._part_factors is not None)
                if any(parts):
                    if self._part_factors is None:
                        try:
                            self._clip_as_pieces()
                            self._part_base = (self._averaged_gradient(), False, {})
                        except Exception as e:
                            error, failure = e, _told(e)
                    failed, _ = self._node_outcomes(failure, None)
                    self._raise_clip_failure(failed, error)
            return None
        mine, norms = self._stepped_here(owned), None
        if self._session is not None:
            self._amending = True  # every slice, where one is (each its own job)
            self._restore_views()
            norms = self._grad_norms(order, mine)
        _, norms = self._node_outcomes(None, norms)  # the slices' norms, in the model's order
        norm = _norm_of_norms([n for each in norms for n in each], order)
        if self._session is not None:
            self._scale_in_place(mine, _float32(_clip_factor(norm, max_norm)))
        self._share_stepped_grads()
        return norm

    def _stepped_here(self, owned):
        """Of the node's parameters of indices `owned`, those this rank
        steps (a sharded node's slice; the leader, all), as indices among
        self._params."""
        if self._slices is None:
            return list(owned)
        first, end = self._slices[self._node.local_rank]
        return [i - first for i in owned if first <= i < end]

    def _grad_norms(self, order, indices):
        """The norms of order `order` (in double) of the gradients of this
        optimizer's parameters of `indices`, one by one."""
        return [float(torch.linalg.vector_norm(self._flat_grad[lo:hi].double(), order))
                for lo, hi in (self._ranges[i] for i in indices)]

    def _keep_sent(self):
        """In a step whose gather came at its first clip_grad_norm_ and
        whose clip neither is the node's own (_node_own_clip) nor showed the
        clipped average (_node_show): a copy of what this rank sent of the
        gradients it does not step (unchanged since), which step() compares
        .grad with (_judge_node_edits); once a step."""
        if self._sent_copied:
            return
        missing, failure, sent = self._gathered
        self._gathered = (missing, failure, [(p, g.clone() if g is not None else None)
                                             for p, g in sent])
        self._sent_copied = True

    def _raise_clip_failure(self, failed, error):
        """After a node's clip_grad_norm_ exchange: raises this rank's own
        `error`, or the first of `failed` ((local rank, message) of the
        ranks that failed) naming that rank; nothing where none failed."""
        if not failed:
            return
        if error is not None:
            raise error
        k, failure = failed[0]
        raise MorseError(f"{failure}\n  (clip_grad_norm_ of local rank {k}, which steps "
                         f"{'the node' if self._slices is None else f'slice {k}'}; this rank is "
                         f"rank {self._rank})")

    def _node_own_clip(self, max_norm, order, owned):
        """clip_grad_norm_ in a node's step that clips the node's own
        gradient and pushes it at step() (a compressing step): as on one
        rank (_own_clip), torch's own on the node's average, scaled in place
        where it is stepped (by the leader; sharded, each slice by its owner
        with the model's factor) and given to every rank of the node as its
        .grad, so that .grad after it is torch's on every rank (DDP's inside
        the node, 1-bit Adam's rule between nodes) and an edit after it, the
        same on every rank, is pushed as torch would have it. Before a later
        clip in the step the ranks' .grad must still agree. Returns the norm
        where it clipped so; None where the step clips otherwise (_node_clip
        goes on)."""
        node = self._node
        sharded = self._slices is not None
        own, failure, norms = self._own_clipping, self._gathered[1], None
        if own and failure is None:
            failure = self._node_grads_agree("between two clip_grad_norm_ calls")
        error = None
        if self._session is not None and failure is None and own is None:
            try:
                if self.clip_grad_norm is not None or self._clipped \
                        or self._part_factors is not None:
                    own = False
                else:
                    self._push_for_clip()
                    with self._explained():
                        own = self._session.clips_locally()
            except Exception as e:  # the node hears it before this rank raises it
                error, failure = e, _told(e)
        if self._session is not None and failure is None and own:
            try:
                if sharded:  # this slice's parameters' norms, the model's combined below
                    norms = self._grad_norms(order, self._stepped_here(owned))
                else:
                    norms = float(self._own_clip(max_norm, order, False, owned))
            except Exception as e:
                error, failure = e, _told(e)
        if sharded:
            outcomes = node.objects((failure, own, norms))
            failed = [(k, f) for k, (f, _, _) in enumerate(outcomes) if f is not None]
            own = all(o for _, o, _ in outcomes)
        else:
            failure, own, norms = node.objects((failure, own, norms) if node.is_leader else None)[0]
            failed = [(0, failure)] if failure is not None else []
        self._raise_clip_failure(failed, error)
        self._own_clipping = own
        if not own:
            return None
        if not sharded:
            self._share_stepped_grads()  # the leader's clipped gradient, every rank's .grad
            return norms
        norm = _norm_of_norms([n for _, _, each in outcomes for n in each], order)
        self._scale_in_place(self._stepped_here(owned), _float32(_clip_factor(norm, max_norm)))
        self._share_stepped_grads()
        return norm

    def _kept_clip(self):
        """What a node's own clip has just given every rank as .grad, kept
        to compare .grad with later (_node_grads_agree): the regions of
        shared memory it came through from the leader (sharded: from each
        slice's owner), read where they lie; a copy where it came through
        gloo."""
        node = self._node
        owners = 1 if self._slices is None else len(self._slices)
        kept = [node.kept(owner=k) for k in range(owners)]
        if any(k is None for k in kept):
            return [torch.cat([g.detach().reshape(-1) for g in self._node_grads()])]
        return kept

    def _node_grads(self):
        """The node's gradient as this rank holds it, in pieces that follow
        one another (no copies): its flat gradient (a sharded node's rank:
        every parameter's .grad, zeros where one has none)."""
        self._restore_views()
        if self._slices is None:
            return [self._flat_grad]
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._node_params]

    def _share_slice_grads(self):
        """A sharded node: every rank takes each slice's .grad from the
        slice's owner."""
        def grad_of(p):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            return p.grad
        self._restore_views()  # the owner's .grad: views of its flat gradient
        self._share_from_owners(grad_of)

    def _share_from_owners(self, tensor_of):
        """A sharded node: every rank takes tensor_of(p) (a parameter, its
        .grad) of each slice's parameters from the slice's owner."""
        node = self._node
        for k, (first, end) in enumerate(self._slices):
            tensors = [tensor_of(p) for p in self._node_params[first:end]]
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            node.share(flat, owner=k)
            if k != node.local_rank:
                at = 0
                with torch.no_grad():
                    for t in tensors:
                        t.copy_(flat[at:at + t.numel()].view_as(t))
                        at += t.numel()

    def _node_grads_agree(self, when):
        """In a step whose clips are the node's own (_node_own_clip): every
        rank of the node compares its .grad with local rank 0's; a failure
        message naming the ranks that differ, else None. Each rank first
        compares its own with what the clip gave it (_kept_clip); only
        where some rank changed it do the ranks compare with local rank 0's
        (NodeGroup.differing)."""
        node = self._node
        grads = self._node_grads()
        if not any(node.objects(not _same_pieces(grads, self._node_clipped))):
            return None
        differ = node.differing(grads)
        if not differ:
            return None
        than = ("its leader (local rank 0), whose gradients the step uses" if self._slices is None
                else "local rank 0 (each slice's owner pushes its own)")
        return (f"FAILED_PRECONDITION: local ranks {differ} of node {node.node} changed .grad {when} "
                f"in step {self.step_index} otherwise than {than}: edit .grad the same way on every "
                "rank")

    def _slice_norms(self, order):
        """A sharded node's owner, at clip_grad_norm_: its slice's norms of
        `order` and of order 2 (of the job's averaged gradient, or of the
        node's own in a compressing step), before any clip this step."""
        if self._clipped:
            norms, _, _ = self._clipped
            return norms(order), norms(2.0)
        self._push_for_clip()
        with self._device_context(), self._explained():
            own = self._session.clips_locally()
            norms = self._step_norms(None if own else self._session.clip(0.0), own)
        self._clipped = (norms, 1.0, 0.0)  # the limit is set in _combine_slice_norms
        return norms(order), norms(2.0)

    def _push_for_clip(self):
        """A step's first clip: its pushes carry the workers' clipping from
        now on; what backward() has not pushed goes now."""
        self._clips = True
        if self._pending is None:
            self._push_now(at_clip=True)  # nothing pushed yet: the first step, overlap=False
        elif self._cuda:
            self._send([])  # the norm reads the gradient: after torch's work on it (_push_now waits too)

    def _combine_slice_norms(self, norms, order, max_norm):
        """The model's norm from every slice's (`norms`: (of `order`, of
        order 2) by slice), and each owner's clip by its factor, composed
        with the step's earlier clips as torch's: the slices' sessions clip
        by L2, each by the max_norm that gives its slice that factor."""
        def combine(values, p):
            if math.isinf(p):
                return max(values)
            if p == 0:
                return sum(values)
            return sum(v ** p for v in values) ** (1.0 / p)
        whole = combine([n for n, _ in norms], order)
        clipped_norms, factor, _ = self._clipped
        seen = whole * factor
        more = 1.0 if math.isinf(max_norm) else _clip_factor(seen, max_norm)
        if more < 1.0:
            l2 = norms[self._node.local_rank][1]  # this slice's, before any clip
            limit = factor * more * (l2 + 1e-6) if math.isfinite(seen) else max_norm
            with self._device_context(), self._explained():
                self._session.clip(limit)
        self._clipped = (clipped_norms, factor * more, 0.0)
        return seen

    def _worker_clip(self, max_norm, order, error_if_nonfinite, owned):
        """clip_grad_norm_ as one Morse worker (every rank, or a node's
        leader for the node)."""
        if self._clipped:
            return self._clip_again(max_norm, order, error_if_nonfinite, owned)
        # inf: the norm alone (Trainer's logging); Morse's clip factor is 1.
        limit = 0.0 if math.isinf(max_norm) else max_norm
        self._push_for_clip()
        own = False  # the norms are of this rank's own gradient, not the average's
        try:
            with self._device_context(), self._explained():
                if order == 2.0:
                    sum_of_squares = self._session.clip(limit)
                    own = self._session.clips_locally()
                    norms = self._step_norms(sum_of_squares, own)
                elif self._session.clips_locally():
                    # This rank's own gradient (a compressing step): the
                    # shards clip by L2 norms, so the max_norm whose L2
                    # factor is this norm's, as the shards' mirrors apply it.
                    own = True
                    norms = self._step_norms(None, own)
                    factor = _clip_factor(norms(order), limit)
                    self._session.clip(self._l2_max_norm(norms, order, factor, limit))
                else:
                    # The averaged gradient: every reply's norms, then the
                    # L2 max_norm with this norm's factor.
                    norms = self._step_norms(self._session.clip(0.0), own)
                    factor = _clip_factor(norms(order), limit)
                    if factor < 1.0:
                        self._session.clip(self._l2_max_norm(norms, order, factor, limit))
        except MorseError as error:
            norms = self._unclipped_step(error)
            limit = None  # nothing clips this step
        norm = norms(order)
        # The clip so far: the step's norms, the factor it applies and the
        # L2 max_norm that gives it, which a later call in the step composes
        # with (_clip_again).
        factor = _clip_factor(norm, limit or 0.0)
        self._clipped = (norms, factor, limit)
        return self._norm_tensor(norm, order, error_if_nonfinite, owned)

    def _fold_edit(self, pushed):
        """At step(), gradients edited after clip_grad_norm_ had pushed them
        (`pushed`: what left): where the edit scaled each parameter's
        whole gradient by one factor (a mul_ by a float32, a zero_, a div_;
        _scale_between), as DDP would the clipped average, the factors join
        the step's clip, sent as its clip pieces, and the step gives DDP's
        result (to float rounding). Returns the factors by parameter where it did, else None:
        anything else (another edit, a compressing step, whose pushes read
        the gradient at step()) is left to the caller (an amended step, or a
        refusal)."""
        clipped = self._clipped
        if self._part_factors is not None:
            if self._part_base[1]:
                return None  # a compressing step: its own gradient, scaled at step()
        elif not clipped or clipped[2] is None:
            return None  # not clipped by the workers this step, or it ran unclipped
        scales = []
        for lo, hi in self._ranges:
            scale = _scale_between(pushed[lo:hi], self._flat_grad[lo:hi])
            if scale is None:
                return None
            scales.append(scale)
        if self._part_factors is None:
            with self._device_context(), self._explained():
                if self._session.clips_locally():
                    return None
            self._clip_as_pieces()
        self._part_factors = [f * c for f, c in zip(self._part_factors, scales)]
        return scales

    def _clip_as_pieces(self):
        """The step's clip of the whole model becomes a factor per parameter
        (the step's clip pieces, design.md 2.6), each the clip's factor."""
        with self._device_context(), self._explained():
            self._session.clip(0.0)
        self._part_factors = [self._clipped[1]] * len(self._params)
        self._part_base = (None, False, {})

    def _unclipped_step(self, error):
        """A step's first clip_grad_norm_ came after its pushes had left
        unclipped during backward() (what `error` says; any other error is
        raised): the step runs unclipped, and the call returns this rank's
        own norm. Returns the norms of this rank's own gradient."""
        if "began without the workers' clipping" not in str(error):
            raise error
        self._surprised("clip_grad_norm_ was called for the first time, after the step's "
                        "gradients had been pushed unclipped during backward(): the step ran "
                        "unclipped, and the call returned this rank's own gradient's norm",
                        holds=False)
        return self._step_norms(None, True)

    def _step_norms(self, sum_of_squares, own):
        """The norms of the step's gradient before any clip, by order: the
        averaged gradient's (the shards' norms of every reply), or with
        `own` this rank's (a compressing step's clip). sum_of_squares: the
        L2 one's square, as the session clips by it."""
        cache = {} if sum_of_squares is None else {2.0: math.sqrt(sum_of_squares)}
        average = []  # the averaged gradient, fetched once for other orders

        def norm_of(order):
            if order not in cache:
                if own and order in (1.0, 2.0, math.inf):
                    cache[order] = float(torch.linalg.vector_norm(self._flat_grad.double(), order))
                elif own:
                    cache[order] = self._norm_by_parameter(self._flat_grad, order)
                elif order in (1.0, 2.0, math.inf):
                    with self._device_context(), self._explained():
                        cache[order] = self._session.average_norm(order)
                else:
                    # Another order (3, 0.5, ...): of the averaged gradient
                    # itself, which the shards send no norm of.
                    if not average:
                        average.append(self._averaged_gradient())
                    cache[order] = self._norm_by_parameter(average[0], order)
            return cache[order]
        return norm_of

    def _norm_by_parameter(self, flat, order, owned=None):
        """torch's clip_grad_norm_ of order `order` over the views of `flat`
        at this optimizer's parameters (those of indices `owned`, or all):
        each parameter's norm, then the norm of those (in double)."""
        ranges = self._ranges if owned is None else [self._ranges[i] for i in owned]
        norms = [torch.linalg.vector_norm(flat[lo:hi].double(), order) for lo, hi in ranges]
        if not norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(norms), order))

    @staticmethod
    def _l2_max_norm(norms, order, factor, limit):
        """The max_norm the session clips by (on the L2 norm, as every
        replica and mirror does, design.md 2.6) for `factor`: 0 for none, the
        call's own for an L2 clip, and for a clip of another order the L2
        max_norm with its factor (where that norm is not finite, the call's,
        which scales by 0 as torch's does when both are infinite)."""
        if factor >= 1.0:
            return 0.0
        if order == 2.0 or not math.isfinite(norms(order)):
            return limit
        return factor * (norms(2.0) + 1e-6)

    def _clip_again(self, max_norm, order, error_if_nonfinite, owned):
        """Another clip_grad_norm_ in the step, as torch's on the gradient
        the earlier ones clipped: it returns that gradient's norm, and the
        step clips by the product of the factors (one L2 max_norm for the
        shards, which clip the averaged gradient once)."""
        norms, factor, limit = self._clipped
        seen = norms(order) * factor
        more = 1.0 if math.isinf(max_norm) or limit is None else _clip_factor(seen, max_norm)
        if more < 1.0:
            # The one max_norm whose factor on the first L2 norm is the
            # product: this call's own where nothing clipped before.
            if factor == 1.0 and order == 2.0:
                combined = max_norm
            else:
                combined = factor * more * (norms(2.0) + 1e-6)
            with self._device_context(), self._explained():
                self._session.clip(combined)
            self._clipped = (norms, factor * more, combined)
        return self._norm_tensor(seen, order, error_if_nonfinite, owned)

    def _norm_tensor(self, norm, order, error_if_nonfinite, owned):
        """clip_grad_norm_'s return value, as torch's."""
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"The total norm of order {order} for gradients from {owned} "
                               "parameters is non-finite, so it cannot be clipped. To disable this "
                               "error and scale the gradients by the non-finite norm anyway, set "
                               "`error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=torch.float32, device=self._flat.device)

    def _device_context(self):
        return torch.cuda.device(self._device) if self._cuda else contextlib.nullcontext()

    def _worker_step(self):
        """The step as one Morse worker (every rank, or a node's leader)."""
        # A node's stepping rank: the other ranks' edits since the clip,
        # this step's alone whatever happens.
        others, self._node_edit_scales = self._node_edit_scales, None
        grads_differ, self._node_grads_differ = self._node_grads_differ, None
        # A step whose clips were torch's own, in place (_own_clip): its
        # pushes take .grad as it is now, every edit in torch's order.
        own_clipped, self._own_clipping, self._own_scaled = self._own_clipping, None, False
        # .grad held the clipped average (_show_clipped_average), and it is
        # the step's gradient where edited otherwise than by factors.
        shown, amend = self._shown, self._amending
        self._shown = self._amending = False
        if self._pushed is None:
            self._push_now()
        first, edited, missing, pushed = self._pushed
        self._pushed = None
        if own_clipped:
            if pushed is not None:  # (what the first clip found, before it scaled .grad)
                self._restore_views()
                pushed = None
            if not first:  # (the first step's edits before its clip still decide)
                edited = False
        folded = None  # the factors of an edit after the clip that joined it
        learned = False  # .grad first seen edited after the clip, not shown (CUDA)
        if edited and not first and pushed is None and self._snapshot is not None:
            # Pushed during backward() (overlap), clipped, then edited: an
            # edit that scaled whole parameters joins the step's clip.
            folded = self._fold_edit(self._snapshot)
            edited = folded is None
        late = False  # edited after clip_grad_norm_ pushed them
        if pushed is not None:
            touched = (self._flat_grad._version != pushed[0]
                       or any(p.grad is None or p.grad.data_ptr() != self._flat_grad[lo:hi].data_ptr()
                              for p, (lo, hi) in zip(self._params, self._ranges)))
            if touched:
                self._restore_views()
            # Changed bits count (an edit through .data moves no version counter).
            late = not _same_bits(self._flat_grad, pushed[1])
            if late and not amend:
                folded = self._fold_edit(pushed[1])  # whole parameters scaled: it joins the clip
                late = folded is None
            if late and shown:
                amend, late = True, False  # .grad, edited, is the step's gradient
            if late and not self._shows_average:
                # (A node's leader learns for the node: it alone shows the
                # clipped average, which every rank then takes, _node_show;
                # a sharded node's owners learn together, _slice_step.)
                with self._device_context(), self._explained():
                    learned = not self._session.clips_locally()  # a step that averages
                late = not learned
            if not (touched or late) and first and self._snapshot is not None and not self._snapshot_touched:
                self._snapshot = None  # nothing edits the gradients after backward()
        changed = None
        if self._follow_groups and self._sent_hyper is not None and self._group_hyper() != self._sent_hyper:
            changed = self._group_hyper()  # the pushes carried the old values
        moments_moved = (self._follows_moments and self._sent_hyper is not None
                         and self._step_moments() != self._sent_moments)
        self._pending = None
        self._clipped = False
        scaled_here = own_clipped  # .grad scaled in place for the pushes at step()
        if self._part_factors is not None:
            # The step's clip of part of the model: the averaged gradient's
            # pieces to every replica and mirror, or this rank's own
            # gradient scaled where its pushes read it (a compressing step).
            factors, (_, own, _) = self._part_factors, self._part_base
            self._part_factors = self._part_base = None  # this step's alone, whatever happens
            scaled_here = scaled_here or own
            if own:
                with torch.no_grad():
                    for (lo, hi), factor in zip(self._ranges, factors):
                        if factor != 1.0:
                            self._flat_grad[lo:hi].mul_(_float32(factor))
            elif not amend:
                with self._explained():
                    self._session.clip_pieces(_clip_pieces(self._ranges, factors,
                                                           self._flat_grad.numel()))
        if amend:
            with self._explained():
                self._session.amend(self._flat_grad.cpu() if self._cuda else self._flat_grad)
        if self._cuda:
            if scaled_here:  # the pushes (encoded at finish()) read .grad as torch's work leaves it
                self._send([])
            with torch.cuda.device(self._device), self._explained():
                self.last_step = self._session.finish()
        else:
            with self._explained():
                self.last_step = self._session.finish()
        if self._checkpoint and self.step_index % self._checkpoint_every == 0:
            self._save_checkpoint()
        # The averaged gradient's norm before clipping, when the step clipped
        # it (what DDP's clip_grad_norm_ returns).
        sum_of_squares = self._session.grad_sum_of_squares()
        if sum_of_squares is not None:
            self.last_step["grad_norm"] = math.sqrt(sum_of_squares)
        if self._learns_accumulation and any(self._counts) and not self._no_sync_step:
            self._accumulation = max(self._counts)
            self._learns_accumulation, self._learned_accumulation = False, True
        self._counts = [0] * len(self._params)
        self._no_sync_step = False
        self._synced = [False] * len(self._params)
        if self._session_buffers:
            self._take_buffers()
        moved = self._first_hyper is not None and self._first_hyper != self._group_hyper()
        if first and (edited or moved or amend) and self._overlap:
            # The first step pushed at step(), edits (or lr changes) included:
            # the script makes them after backward(), so later steps push at
            # step() too; so where it edited .grad after clip_grad_norm_
            # otherwise than by factors (an amended step), which needs the
            # pushes to wait for the clip.
            self._holds_pushes = True
            self._snapshot = None
            edited = False
        # A node's stepping rank: its other ranks edited their .grad after
        # the clip as it did (the same factors), or the step is refused.
        if others is not None and not late and not learned:
            # (A step that learned trained on the clipped average without
            # any rank's edit.)
            mine = folded or [1.0] * len(self._params)
            differ = [k for k, scales in others if scales != mine]
            if differ:
                k = self._node.local_rank
                which = "its leader (local rank 0)," if self._slices is None else \
                    f"local rank {k}, which steps slice {k},"
                raise MorseError(
                    f"FAILED_PRECONDITION: local ranks {differ} of node {self._node.node} "
                    f"changed .grad after clip_grad_norm_ in step {self.step_index - 1} "
                    f"otherwise than {which} whose gradients the step used: edit .grad the same "
                    "way on every rank (after clip_grad_norm_, only by scaling a parameter's "
                    "whole gradient: mul_, div_, zero_)")
        if grads_differ is not None:
            raise MorseError(grads_differ)
        if learned:
            self._learn_to_show()
        if late:
            raise MorseError(
                "FAILED_PRECONDITION: the gradients changed after clip_grad_norm_ pushed them "
                f"in step {self.step_index - 1}, which used them as they were at "
                "clip_grad_norm_: after it, only a parameter's whole gradient scaled (mul_, "
                "div_, zero_) joins the step's clip"
                f"{' (on CUDA tensors, in a step that averages)' if self._cuda else ''}; make other edits "
                "before clip_grad_norm_, as under DDP its clip factor is of the gradient it sees")
        if edited:
            self._surprised("the gradients changed after backward() had pushed them (editing, "
                            "scaling or zeroing .grad)")
        if changed is not None:
            self._surprised(f"lr/weight_decay changed to {_shown_hyper(changed)} between backward() "
                            f"and step(), after the pushes had left with "
                            f"{_shown_hyper(self._sent_hyper)}; the step used those")
        if moments_moved:
            self._surprised("betas/eps changed between backward() and step(), after the pushes had "
                            f"left with {self._sent_moments or 'the ones the optimizer was built with'}"
                            "; the step used those")
        surprise, self._surprise = self._surprise, None
        if surprise is not None:
            self._adapt(*surprise)
        self._check_missing(missing)
        if self._freeze_step is not None and self.step_index == self._freeze_step and self._worker == 0:
            self._report_freeze()

    def _node_gather(self, at_clip=False):
        """The step's gradients to the rank that steps for the node (the
        leader; sharded, each slice's to its owner), once a step: at
        step(), or at the first clip_grad_norm_ (`at_clip`: this rank then
        keeps what it sent of the gradients it does not step, to see edits
        made after the clip). There the ranks' pairs and digests are
        checked and the average put in the flat gradient. Keeps (missing
        names, this rank's failure or None, what it sent) in self._gathered."""
        from .node import flat_grads
        node = self._node
        missing = [name for name, p in zip(self._node_names, self._node_params) if p.grad is None]
        # With overlap the gradients left in buckets during backward().
        bucketed = self._node_buckets is not None
        edited = self._launch_node_buckets() if bucketed else False
        self._restore_views()
        pairs = self._node_pairs()
        mine = 0 if self._slices is None else node.local_rank
        # Parameters written since the last step (a clamp_, a
        # load_state_dict): each rank tells the rank that steps them their
        # hash, slice by slice (the leader's: one slice).
        written_by_slice = []
        for k, (start, end) in enumerate(self._slices or [(0, len(self._node_params))]):
            if k == mine:
                params = self._params
                written = any(p._version != v for p, v in zip(self._params, self._x_versions))
            else:
                params = self._node_params[start:end]
                written = any(p._version != self._other_versions[id(p)] for p in params)
            written_by_slice.append(_digest_of(params) if written else None)
        if bucketed:
            # Only the ranks' settings and digests are left to send, and
            # whether any rank's gradients changed after they left; the
            # buckets' averages are taken once these agree.
            changed, hypers, by_slice = node.settings(edited, pairs, written_by_slice)
            digests = by_slice[mine]
            if changed:
                self._collect_node_buckets(take=False)
                bucketed = False
                self._node_buckets = None
                warnings.warn(
                    f"morse: in step {self.step_index} a rank of node {node.node} changed "
                    "gradients after backward() had sent them to the node (an edit of .grad, "
                    "another backward()); the step uses them as they are at step(), gathered "
                    "again, and from now on the node gathers them at step() (pass "
                    "accumulation_steps= or use no_sync() to accumulate with overlap)",
                    RuntimeWarning, stacklevel=4)
        if not bucketed and self._slices is None:
            average, hypers, digests = node.average(self._flat_grad, pairs, written_by_slice[0])
        elif not bucketed:
            for k, (start, end) in enumerate(self._slices):
                offset = self._node_offsets[start]
                grads = (torch.cat([self._flat_grad[lo:hi] for lo, hi in self._ranges]) if k == mine
                         else flat_grads(self._node_params[start:end],
                                         node.staging(offset, self._node_offsets[end] - offset)))
                got = node.average(grads, pairs, written_by_slice[k], owner=k, offset=offset)
                if k == mine:
                    average, hypers, digests = got
        if self._slices is None:
            kept = self._params if at_clip and not node.is_leader else []
        else:
            kept = self._others if at_clip else []

        def take():  # the average into the gradients of the parameters this rank steps
            if self._slices is None:
                self._flat_grad.copy_(average)
                return
            at = 0
            for lo, hi in self._ranges:
                self._flat_grad[lo:hi].copy_(average[at:at + hi - lo])
                at += hi - lo
        failure = None
        if self._session is not None:
            failure = self._node_disagrees(hypers, digests)
        if bucketed:
            # The leader pushes each partition as soon as the buckets have
            # brought all of its average (after the first step, not for a
            # clip, which pushes with the step's clipping).
            self._collect_node_buckets(take=failure is None, push=(
                self._slices is None and self._session is not None and self._joined
                and not at_clip))
        elif failure is None and self._session is not None:
            take()
        # (Copied where the clip neither is the node's own nor shows the
        # clipped average, both of which compare whole gradients instead:
        # _keep_sent.)
        sent = [(p, p.grad.detach() if p.grad is not None else None) for p in kept]
        self._gathered = (missing, failure, sent)
        self._sent_copied = not sent
        self._clip_gathered = at_clip

    def _start_node_buckets(self, elems):
        """A node's rank with overlap: its gradients leave for the rank that
        steps for them during backward(), in buckets of whole parameters of
        about `elems` elements (the job's partition_elems, else 1Mi), each
        once its parameters' gradients are final, in the same order on every
        rank of the node (node.buckets); step() averages what arrived."""
        from .node import buckets
        sizes = [p.numel() for p in self._node_params]
        starts = [0, len(sizes)] if self._slices is None else [f for f, _ in self._slices] + [len(sizes)]
        self._node_buckets = buckets(sizes, starts, elems)
        self._bucket_of = [0] * len(sizes)
        for b, (_, members) in enumerate(self._node_buckets):
            for j in members:
                self._bucket_of[j] = b
        self._reset_node_buckets()
        for j, p in enumerate(self._node_params):
            if p.requires_grad:
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append((accumulator, accumulator.register_hook(
                    lambda *unused, j=j: self._node_bucket_ready(j))))

    def _reset_node_buckets(self):
        self._bucket_left = [len(m) for _, m in self._node_buckets]
        self._node_counts = [0] * len(self._node_params)
        self._next_bucket = 0
        self._launched = []  # (bucket, what left, in backward(), handle)
        self._no_sync_step = False

    def _node_bucket_ready(self, j):
        """backward() finished parameter j's gradient: once every gradient
        of the next bucket is final (the last backward() of the step, as
        accumulation_steps or no_sync() say), its gather starts."""
        if self._node_buckets is None or self._gathered is not None:
            return
        if self._in_no_sync:
            self._no_sync_step = True
            return
        self._node_counts[j] += 1
        if self._node_counts[j] != (1 if self._no_sync_step else self._accumulation):
            return  # accumulating; a backward() after the bucket left is seen at step()
        self._bucket_left[self._bucket_of[j]] -= 1
        while (self._next_bucket < len(self._node_buckets)
               and self._bucket_left[self._next_bucket] == 0):
            self._launch_node_bucket(in_backward=True)

    def _launch_node_bucket(self, in_backward):
        from .node import flat_grads
        b = self._next_bucket
        owner, members = self._node_buckets[b]
        params = [self._node_params[j] for j in members]
        # A copy (host float32), in shared memory where the node has it, at
        # the place of the bucket's first parameter (members run from the
        # last to the first): the buckets in flight at once lie apart.
        offset = self._node_offsets[min(members)]
        sent = flat_grads(params, self._node.staging(offset, self._node_offsets[max(members) + 1] - offset))
        self._launched.append((b, sent, in_backward, self._node.gather_async(sent, owner, offset)))
        self._next_bucket += 1

    def _edited_since_sent(self):
        """Whether a gradient sent during backward() changed since (an edit
        of .grad, another backward()), bit for bit: version counters miss
        edits through .data."""
        for b, sent, in_backward, _ in self._launched:
            if not in_backward:
                continue
            at = 0
            for j in self._node_buckets[b][1]:
                p = self._node_params[j]
                now = sent[at:at + p.numel()]
                at += p.numel()
                if not _same_bits(p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(now),
                                  now):
                    return True
        return False

    def _launch_node_buckets(self):
        """At step() (or the first clip_grad_norm_) with buckets: starts the
        ones backward() did not. Returns whether this rank changed a
        gradient after its bucket left."""
        while self._next_bucket < len(self._node_buckets):
            self._launch_node_bucket(in_backward=False)
        # How many of the step's buckets left during backward() (of all).
        self._buckets_in_backward = (sum(1 for *_, early, _ in self._launched if early),
                                     len(self._launched))
        return self._edited_since_sent()

    def _collect_node_buckets(self, take, push=False):
        """Waits for the step's buckets, in order. With `take`, the rank
        that steps a bucket's parameters puts their average in its flat
        gradient; with `push` (the leader, whose settings and digests
        agreed) it pushes each partition as soon as every parameter it
        touches has its average, so that the encodes and the first
        exchanges run while the later buckets arrive and are summed. An
        error of the session there is kept for _step_for_node, which tells
        the node before raising it."""
        first = 0 if self._slices is None else self._slices[self._node.local_rank][0]
        self._push_error = None
        push = push and take
        if push:
            try:
                if self._pending is None:
                    self._begin()
                    self._pending = list(self._waiting_for)
            except Exception as e:  # noqa: BLE001 (told to the node at the step)
                self._push_error, push = e, False
        # How many partitions left before the last bucket's average was in
        # (what the pushes gained), for tests and benchmarks.
        self._pushed_before_last = 0
        for k, (b, _, _, handle) in enumerate(self._launched):
            mean = self._node.collect(handle)
            if mean is None or not take:
                continue
            ready, at = [], 0
            for j in self._node_buckets[b][1]:
                lo, hi = self._ranges[j - first]
                self._flat_grad[lo:hi].copy_(mean[at:at + hi - lo])
                at += hi - lo
                if push:
                    for q in self._touches[j - first]:
                        self._pending[q] -= 1
                        if self._pending[q] == 0:
                            ready.append(q)
            if ready:
                try:
                    self._send(sorted(ready))
                    if k < len(self._launched) - 1:
                        self._pushed_before_last += len(ready)
                except Exception as e:  # noqa: BLE001
                    self._push_error, push = e, False
        if take:
            self._grad_version = self._flat_grad._version  # what the pushes read: no edit
        self._reset_node_buckets()

    def _node_step(self):
        """The step of a rank in a node of several (node.py): the leader
        steps for the node with the average of its ranks' gradients, and
        every rank takes the leader's parameters (and module buffers)."""
        node = self._node
        if self._gathered is None:
            self._node_gather()
        missing, failure, sent = self._gathered
        self._gathered = None
        error = None
        self._judge_node_edits(sent)  # by the leader, edits made after the clip
        if node.is_leader:
            error, outcome = self._step_for_node(failure)
            failure, _, buffers, _ = node.finish(*outcome)
        else:
            failure, _, buffers, _ = node.finish()
            if failure is not None:
                error = MorseError(f"{failure}\n  (the step of this node's leader, rank "
                                   f"{node.leader}; this rank is rank {self._rank})")
        self._own_clipping, self._own_scaled = None, False  # (the leader's step took them)
        node.share(self._flat)
        if not node.is_leader:
            # The leader's step decided on what this rank wrote; it holds
            # the leader's parameters now (the copy bumps their versions).
            self._x_versions = [p._version for p in self._params]
        if buffers is not None and not node.is_leader:
            self._unpack_buffers(buffers)
        if error is not None:
            raise error
        self._check_missing(missing)

    def _judge_node_edits(self, sent):
        """At step(), in a step whose gather came at clip_grad_norm_ (the
        only one in which `sent`, what this rank sent then of the gradients
        it does not step, holds anything): every rank of the node tells the
        rank that steps each parameter (the leader, or the slice's owner)
        the factor by which it scaled that parameter's .grad since (None for
        another edit), which that rank's step compares with its own
        (_worker_step), refusing the step unless they agree."""
        self._node_edit_scales = None
        if self._own_clipping or self._node_shown:
            # The leader's own clip (_node_own_clip), or the clipped average
            # shown (_node_show): .grad the leader's (each slice's owner's)
            # on every rank since, each edit after it the same on every
            # rank, which the step takes as the leader's (_worker_step).
            failure = self._node_grads_agree("after clip_grad_norm_")
            self._node_clipped, self._node_shown = None, False
            if self._session is not None:  # (the rank steps for the node, or a slice)
                self._node_grads_differ = failure
            return
        if not self._clip_gathered:
            return
        node = self._node
        index = {id(p): i for i, p in enumerate(self._node_params)}
        mine = {index[id(p)]: None if (p.grad is None) != (g is None) else
                1.0 if g is None else _scale_between(g.reshape(-1), p.grad.reshape(-1))
                for p, g in sent}
        told = node.objects(mine)
        if self._session is not None:
            first, end = (0, len(self._node_params)) if self._slices is None \
                else self._slices[node.local_rank]
            self._node_edit_scales = [(k, [scales[i] for i in range(first, end)])
                                      for k, scales in enumerate(told) if k != node.local_rank]

    def _save_checkpoint(self):
        """This rank's checkpoint of the step just ended (a sharded node's
        slice: <path>.<step>, the one before kept)."""
        if self._slices is None and not self._generation:
            self._session.save_checkpoint(self._checkpoint)
            return
        step = self._session.step_index
        self._session.save_checkpoint(f"{self._checkpoint}.{step}")
        for old in self._checkpoint_steps():
            if old < step - self._checkpoint_every:
                os.remove(f"{self._checkpoint}.{old}")

    def _checkpoint_steps(self):
        """The steps of this slice's checkpoint files, ascending."""
        folder, name = os.path.split(self._checkpoint)
        return sorted(int(f[len(name) + 1:]) for f in os.listdir(folder or ".")
                      if f.startswith(name + ".") and f[len(name) + 1:].isdigit())

    def _rejoin_checkpoint(self):
        """The checkpoint a restarted rank starts from: its own (leader,
        plain rank; after add_param_group its newest of the layout), or a
        sharded node's latest step every slice has one of ("" where none:
        the shards' model)."""
        if self._slices is None and not self._generation:
            return self._checkpoint or ""
        mine = self._checkpoint_steps() if self._checkpoint else []
        if self._slices is None:
            return f"{self._checkpoint}.{max(mine)}"  # (_restarted_layout found one)
        common = set(mine)
        for steps in self._node.objects(mine):
            common &= set(steps)
        return f"{self._checkpoint}.{max(common)}" if common else ""

    def _node_pairs(self):
        """What a node's ranks must agree on each step, as (a, b) pairs:
        every group's (lr, weight_decay), then its (beta1, beta2) and
        (eps, 0)."""
        hyper = tuple(_hyper_of(g) for g in self.param_groups)
        rules = tuple(_moments_of(g) for g in self.param_groups)
        return hyper + tuple(p for b1, b2, eps in rules for p in ((b1, b2), (eps, 0.0)))

    def _node_disagrees(self, hypers, digests):
        """On the rank that steps for the node (or its slice), given every
        local rank's pairs (_node_pairs) and digests: a failure message if
        they set different values or hold different parameters, else None."""
        if len(set(hypers)) > 1:
            n = len(self.param_groups)
            shown = ", ".join(
                f"{_shown_hyper(h[:n])} with betas and eps "
                + ", ".join(f"({a:.7g}, {b:.7g})" for a, b in h[n:]) for h in hypers)
            return (f"FAILED_PRECONDITION: the ranks of node {self._node.node} set different "
                    f"(lr, weight_decay), betas or eps: {shown} (local ranks in order); "
                    "every rank must use the same")
        return self._node_weights_differ(digests)

    def _step_for_node(self, failure):
        """On the rank that steps for its node (the leader, or a slice's
        owner), the gather's `failure` (the ranks disagree) or None: steps
        as the node's worker unless there is one. Returns (the error this
        rank raises, or None; (failure, checksum, buffers, members) for the node)."""
        error = None
        if failure is not None:
            error = MorseError(failure)
        else:
            try:
                early, self._push_error = self._push_error, None
                if early is not None:
                    raise early  # a push at the gather (_collect_node_buckets)
                self._worker_step()
            except Exception as e:  # the node hears it before this rank raises it
                error, failure = e, _told(e)
        checksum = self._session.checksum() if failure is None else None
        buffers = self._pack_buffers() if self._session_buffers and failure is None else None
        members = self._session.members() if failure is None else None
        return error, (failure, checksum, buffers, members)

    def _slice_step(self):
        """The step of a rank of a sharded node (node.py): each slice's
        gradients are averaged on its owner, each owner steps its slice as
        its node's worker in the slice's job, and every rank takes every
        slice's new parameters (and local rank 0's module buffers)."""
        node = self._node
        if self.clip_grad_norm is not None and not self._clipped:
            # clip_grad_norm=: the model's norm, as clip_grad_norm_ takes it.
            self._node_clip(float(self.clip_grad_norm), 2.0, False,
                            list(range(len(self._node_params))))
        if self._gathered is None:
            self._node_gather()
        missing, failure, sent = self._gathered
        self._gathered = None
        self._judge_node_edits(sent)  # by each slice's owner, edits made after the clip
        showed = self._shows_average
        error, outcome = self._step_for_node(failure)
        self._own_clipping, self._own_scaled = None, False  # (the slice's step took them)
        learned = self._shows_average and not showed  # (_learn_to_show, in this slice's step)
        outcomes = node.finish_all(*outcome, learned=learned)
        if not self._shows_average and any(o[4] for o in outcomes):
            # Another owner learned to show its slice's clipped average:
            # every owner shows its own from now on, so that the .grad
            # every rank takes after a clip is the clipped average throughout.
            self._show_average()
        for k, (failed, *_) in enumerate(outcomes):
            if error is None and failed is not None:
                error = MorseError(f"{failed}\n  (the step of slice {k}'s owner, rank "
                                   f"{node.node * node.size + k}; this rank is rank {self._rank})")
        self._share_slices()
        if node.local_rank != 0 and outcomes[0][2] is not None:
            self._unpack_buffers(outcomes[0][2])
        if error is not None:
            raise error
        self._check_missing(missing)

    def _share_slices(self):
        """A sharded node: every rank takes each slice's parameters from
        the slice's owner."""
        self._share_from_owners(lambda p: p)
        self._other_versions = {id(p): p._version for p in self._others}

    def _node_weights_differ(self, digests):
        """On a node's leader, given each local rank's digest of the
        parameters it wrote since the last step (None: untouched, so the
        node's parameters of the last step): a failure message unless every
        rank holds the leader's parameters. The leader's step then makes a
        change the job's as any worker's (_begin)."""
        if all(d is None for d in digests):
            return None
        mine = _digest_of(self._params)
        differ = [r for r, d in enumerate(digests) if d is not None and d != mine]
        own = digests[self._node.local_rank]
        if not differ and any(d is None for d in digests) and own is not None:
            # Some ranks kept the last step's parameters, the leader wrote
            # its own: the same only if it wrote back the same bits.
            with self._device_context(), self._explained():
                if not self._holds_shards_model():
                    differ = [r for r, d in enumerate(digests) if d is None]
        if not differ:
            return None
        step = self.step_index
        when = f"after step {step - 1}" if step > 0 else "before the first step"
        k = self._node.local_rank
        than = "than its leader" if self._slices is None else f"of slice {k} than local rank {k}, which steps it,"
        return (f"FAILED_PRECONDITION: local ranks {differ} of node {self._node.node} hold "
                f"other parameters {than} {when} (written on some ranks only, or "
                "differently): change (or load) the weights the same way on every rank")

    def _check_missing(self, missing):
        if missing and self._missing_grads == "raise":
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise MorseError(
                f"FAILED_PRECONDITION: {shown} got no gradient in step {self.step_index - 1} "
                "(.grad is None after zero_grad(set_to_none=True)); torch.optim would have skipped "
                "them, Morse applied a zero gradient (their momentum keeps moving them, and weight "
                "decay applies). Give them a gradient every step, freeze them "
                "(requires_grad=False) before building the optimizer, or pass "
                "missing_grads='zero' to accept zero gradients (what torch does with "
                "zero_grad(set_to_none=False) once they have had one)")

    def _report_freeze(self):
        # v is frozen from here on: which parameters hold elements with v = 0.
        _, _, v, _ = self._session.get_state()
        first = 0 if self._slices is None else self._slices[self._node.local_rank][0]
        counts = [(first + i, p, int((v[lo:hi] == 0).sum())) for i, (p, (lo, hi))
                  in enumerate(zip(self._params, self._ranges))]
        total = sum(c for _, _, c in counts)
        what = ("masked (mask_zero_variance)" if self._mask_zero_variance
                else "NOT masked: they get +-scale/eps updates (mask_zero_variance=False)")
        trained = sum(p.numel() for p in self._params)  # without groups' padding
        where = "" if self._slices is None else f" (slice {self._node.local_rank}'s parameters)"
        print(f"morse: v frozen at step {self._freeze_step}; {total} of {trained} elements{where} have "
              f"v = 0 and are {what}", flush=True)
        for i, p, c in counts:
            if c:
                print(f"morse:   parameter {i} {tuple(p.shape)}: {c} of {p.numel()}", flush=True)

    @property
    def step_index(self):
        """Steps completed by this worker (a node's rank: by its node)."""
        if self._awaiting is not None:
            return self._awaiting["step"]  # where its checkpoint has it start
        if self._session is None:
            return self._node.steps + self._node_first_step
        return self._session.step_index

    def membership(self):
        """The ranks whose gradients the last step averaged, ascending: every
        rank, except in an elastic job (min_workers, morse-run --min-workers)
        after a step that completed without some (docs/python.md, "Elastic
        jobs"); under --node-aggregation, every rank of the nodes averaged
        (a node's ranks leave together). A sampler that splits the data
        among the ranks left can use it."""
        if self._node is not None:
            # The shards' workers are the nodes: the ranks of those averaged.
            return self._node.member_ranks()
        return self._session.members()

    def checksum(self):
        """A checksum of this worker's x, m and v (equal on every worker; a
        node's rank: its leader's after the last step)."""
        if self._session is None:
            return self._node.checksum
        return self._session.checksum()

def _group_params(group):
    """A param group's parameters as a list (torch takes a tensor or any
    iterable)."""
    params = group["params"]
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _amp_of(opt):
    """(found_inf, grad_scale): what torch 2's GradScaler set on `opt`
    (_step_supports_amp_scaling) for the step it drives, or None each."""
    return opt.__dict__.get("found_inf"), opt.__dict__.get("grad_scale")


def _grad_scaler_refused(opt, what, why):
    """The ValueError for a GradScaler driving `what` (a step of `opt`)
    where it cannot, `why`; the scaler's attributes taken off `opt` first
    (GradScaler deletes them only after a step returns)."""
    for name in ("grad_scale", "found_inf"):
        opt.__dict__.pop(name, None)
    return ValueError(f"torch.amp.GradScaler (fp16 loss scaling) drives {what}: {why}. Train in "
                      "bf16 (torch.autocast(..., dtype=torch.bfloat16), no GradScaler) or in "
                      "float32")


def _unscale(params, grad_scale):
    """Each .grad of `params` times float32(1 / grad_scale), as
    GradScaler.unscale_ would."""
    inv_scale = grad_scale.double().reciprocal().float()
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv_scale.to(p.grad.device))


def _overflow_of(grads):
    """0 where the tensors `grads` are finite, 2 where one holds a NaN, else
    1: GradScaler's own check (one pass, by device; a look at each tensor
    where this torch has none for the device, as torch 1.13 on the CPU),
    then a look for NaNs only where it found something."""
    found = False
    check = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    for device in {g.device for g in grads}:
        on = [g for g in grads if g.device == device]
        flag = None
        if check is not None:
            flag = torch.zeros(1, device=device)
            try:
                check(on, flag, torch.ones(1, device=device))  # (times 1: .grad keeps its values)
            except NotImplementedError:
                flag = None
        if flag is not None:
            found = found or bool(flag.item() > 0)
        else:
            found = found or any(not bool(torch.isfinite(g).all()) for g in on)
    if not found:
        return 0
    return 2 if any(bool(g.isnan().any()) for g in grads) else 1


def _job_max(value, rank, world):
    """The largest of the ranks' integer `value`s (this is rank `rank` of
    `world`): a MAX over torch.distributed's default group, which must hold
    the job's ranks (started here over env://, gloo, where the script has
    not started it)."""
    if world == 1:
        return int(value)
    import torch.distributed as dist
    if not dist.is_available():
        raise MorseError("FAILED_PRECONDITION: fp16 loss scaling needs torch.distributed (the "
                         "ranks skip an overflowing step together), which this torch lacks")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise MorseError(f"FAILED_PRECONDITION: fp16 loss scaling: torch.distributed's default "
                         f"group has this process as rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, the Morse job as rank {rank} of {world}; the "
                         "ranks that skip an overflowing step together must be the job's")
    value = torch.tensor([float(value)])
    if dist.get_backend() == "nccl":
        value = value.cuda()
    try:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    except RuntimeError as e:  # a rank gone (killed; restarted by --rank-restarts)
        raise MorseError(
            "UNAVAILABLE: fp16 loss scaling: the ranks could not agree whether this step "
            f"overflowed: a rank left torch.distributed's group ({e}), through which they agree "
            f"on it, so they cannot go on without that rank (fp16 loss scaling "
            f"{_CANNOT_TAKE_BACK}, and an elastic job under it cannot leave one out); "
            f"{_RESTART_WHOLE}") from None
    return int(value.item())


def _warn_if_group_cannot_take_back(elastic=False):
    """Once a job, on rank 0: where morse-run --rank-restarts is to take
    lost ranks back (MORSE_CHECKPOINT_DIR), or an elastic job (`elastic`:
    min_workers) to go on without them, and torch.distributed's default
    group is up (started by the script, by Trainer or Accelerate, or for
    fp16 loss scaling), says at the first step that a lost rank will stop
    the job instead: a restarted rank cannot join that group again (its
    init_process_group finds the others' connections gone), and the
    group's next collective fails on the ranks left."""
    global _GROUP_WARNED
    restarts = bool(os.environ.get("MORSE_CHECKPOINT_DIR"))
    if (_GROUP_WARNED or not (restarts or elastic) or os.environ.get("MORSE_REJOIN") == "1"
            or os.environ.get("RANK", "0") != "0"):
        return
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    _GROUP_WARNED = True
    how = " and ".join(([] if not restarts else ["morse-run --rank-restarts cannot take a "
                                                 "restarted rank back into it"])
                       + ([] if not elastic else ["an elastic job (min_workers) cannot go on "
                                                  "without a rank that left it (the group's next "
                                                  "collective fails)"]))
    warnings.warn(
        "morse: torch.distributed's default group is up in this job (started by the script, by "
        f"Trainer or Accelerate, or for fp16 loss scaling), and {how}: a lost rank will stop the "
        "job; to recover, restart the whole job from its checkpoints (or leave torch.distributed "
        "and GradScaler out of a script whose lost ranks Morse should ride out)",
        RuntimeWarning, stacklevel=3)


_GROUP_WARNED = False

# What a GradScaler job does when a rank is lost (_step_overflowed, _job_max).
_CANNOT_TAKE_BACK = "cannot take back a rank restarted by --rank-restarts"
_RESTART_WHOLE = ("restart the whole job from its checkpoints instead (each rank's "
                  "opt.state_dict() and scaler.state_dict(), as a DDP script resumes), or train "
                  "in bf16 (no GradScaler), whose jobs take a restarted rank back")


def _told(error):
    """An exception as a node's rank tells it to the others: a MorseError's
    message (which begins with its status code), else the type's name and
    the message."""
    return str(error) if isinstance(error, MorseError) else f"{type(error).__name__}: {error}"


def _digest_of(params):
    """A 64-bit hash of the parameters' bits, one after another (the same
    in every process, unlike hash())."""
    host = torch.cat([p.detach().reshape(-1) for p in params]).cpu().numpy()
    return int.from_bytes(hashlib.blake2b(memoryview(host).cast("B"), digest_size=8).digest(),
                          "little")


def _hyper_of(group):
    """A param group's (lr, weight_decay) as floats (torch 2 allows a tensor lr)."""
    return float(group["lr"]), float(group["weight_decay"])


def _shown_hyper(hyper):
    """(lr, weight_decay) pairs, one per segment, in words."""
    shown = ", ".join(f"({lr:.7g}, {wd:.7g})" for lr, wd in hyper)
    return shown if len(hyper) == 1 else f"[{shown}] (one per parameter group)"


def _scale_between(was, now):
    """The float32 factor c that a parameter's gradient `was` became `now`
    by, element by element in float32, or None where there is none: 1 for
    the same bits, 0 where now is all zero, c where now = c * was (a mul_,
    a div_ by a power of 2), and float32(1 / d) where now = was / d (a
    div_ by another d, which c applies to float rounding). Where several
    float32 values give those bits, the one of fewest significant bits (so
    that every rank names the script's factor)."""
    if _same_bits(now, was):
        return 1.0
    if not bool(now.any()):
        return 0.0
    j = int(torch.argmax(was.abs()))
    if float(was[j]) == 0.0 or float(now[j]) == 0.0 or not bool(torch.isfinite(now).all()):
        return None
    # The ratio of the largest element is within an ulp or two of the
    # factor (or of the divisor). Every candidate that gives the bits is
    # ranked by the significant bits of the script's number (the factor, or
    # the divisor), a factor first where they tie, so that a rank whose
    # values a nearby number also fits names the script's.
    # A candidate is tried on a sample of the elements (the largest among
    # them) before all of them.
    sample = torch.cat([torch.tensor([j]), torch.arange(0, was.numel(), max(1, was.numel() // 255))])
    was_sample, now_sample = was[sample], now[sample]

    def gives(c, divides, a, b):
        return torch.equal(a / c if divides else a * c, b)

    found = []
    for divides in (False, True):
        ratio = float(was[j]) / float(now[j]) if divides else float(now[j]) / float(was[j])
        estimate = torch.tensor(ratio, dtype=torch.float32)
        for step in (0, 1, -1, 2, -2):
            c = estimate
            for _ in range(abs(step)):
                c = torch.nextafter(c, torch.tensor(math.inf if step > 0 else -math.inf))
            c = float(c)
            if (math.isfinite(c) and c != 0.0 and gives(c, divides, was_sample, now_sample)
                    and gives(c, divides, was, now)):
                found.append((len(c.hex().split("p")[0].rstrip("0")), divides, abs(c), c))
    if not found:
        return None
    _, divides, _, c = min(found)
    return _float32(1.0 / c) if divides else c


def _float32(value):
    """`value` rounded to float32 (a clip factor as every replica applies it)."""
    return float(torch.tensor(value, dtype=torch.float32))


def _check_own_state_loaded(opt, what, why):
    """MorseError for a step() of `opt` while it holds another rank's state
    (`what` of step N: "optimizer state of step"), set aside by
    _await_own_state, and not yet this rank's own (`why` it must be)."""
    if opt._awaiting_own_state is None:
        return
    rank, step = opt._awaiting_own_state
    raise MorseError(
        f"FAILED_PRECONDITION: this rank (rank {opt.rank}) was given rank {rank}'s {what} {step} "
        f"and not yet its own: {why}. Load this rank's state_dict (saved by this rank) with "
        "load_state_dict before step(); under Hugging Face Trainer, "
        "morse.torch.hf.MorseCallback saves each rank's beside the checkpoint and loads it")


def _clip_pieces(ranges, factors, dim):
    """A step's clip of part of the model as pieces of the flat buffer of
    `dim` elements, [(end, scale), ...] (design.md 2.6): each parameter's
    (`ranges`) factor rounded to float32, 1 between parameters, runs of
    one scale merged."""
    pieces, at = [], 0

    def add(end, scale):
        if pieces and pieces[-1][1] == scale:
            pieces[-1] = (end, scale)
        else:
            pieces.append((end, scale))
    for (lo, hi), factor in sorted(zip(ranges, factors)):
        if lo > at:
            add(lo, 1.0)
        add(hi, _float32(factor))
        at = hi
    if dim > at:
        add(dim, 1.0)
    return pieces


def _sample_layout(partitions, ranges, device, per_partition=64):
    """The flat gradient's elements whose bits a step compares with what its
    pushes read (_sampled_edit): every parameter's first and last element,
    and one in len/per_partition of each partition. Returns the sorted
    indices (an int64 tensor on `device`) and each partition's [i0, i1) of
    them."""
    chosen = set()
    for lo, hi in ranges:
        if hi > lo:
            chosen.update((lo, hi - 1))
    for b, e in partitions:
        chosen.update(range(b, e, max(1, (e - b) // per_partition)))
    index = sorted(chosen)
    bounds = [(bisect.bisect_left(index, b), bisect.bisect_left(index, e)) for b, e in partitions]
    return torch.tensor(index, dtype=torch.int64, device=device), bounds


def _same_bits(a, b):
    """Whether two float32 tensors hold the same bits (-0.0 is not +0.0);
    compared where `b` lies (a CUDA tensor against a region of the node's
    shared memory: copied to the host)."""
    if a.device != b.device:
        a = a.to(b.device)
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _same_pieces(parts, kept):
    """Whether float32 tensors `parts`, one after another, hold the bits of
    the tensors `kept`, one after another (no part straddles two of
    `kept`)."""
    k, at = 0, 0
    for part in parts:
        n = part.numel()
        while k < len(kept) and at == kept[k].numel() and n > 0:
            k, at = k + 1, 0
        if k == len(kept) or at + n > kept[k].numel():
            return False
        if not _same_bits(part.detach().reshape(-1).contiguous(), kept[k][at:at + n]):
            return False
        at += n
    return k == len(kept) or (k == len(kept) - 1 and at == kept[k].numel())


def _norm_of_norms(norms, order):
    """torch's clip_grad_norm_ of order `order` from its parameters' norms
    (in double); 0 for none."""
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float64), order))


def _clip_scale(sum_of_squares, max_norm):
    """compress::ClipScale: the clip factor of a gradient whose sum of
    squares is `sum_of_squares`, in float32, computed as the session does
    (1 for max_norm 0)."""
    limit = _float32(max_norm)
    if not limit > 0.0:
        return 1.0
    coefficient = limit / (math.sqrt(sum_of_squares) + 1e-6)
    return _float32(coefficient) if coefficient < 1.0 else 1.0


def _clip_factor(norm, max_norm):
    """torch's clip_grad_norm_ factor, min(1, max_norm / (norm + 1e-6)); 1
    for max_norm 0 (no clip) or inf."""
    if not 0.0 < max_norm < math.inf:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def _moments_of(group):
    """A param group's (beta1, beta2, eps) as floats."""
    betas = group["betas"]
    return float(betas[0]), float(betas[1]), float(group["eps"])


def _shown_value(value):
    """betas or eps in words, as floats."""
    if isinstance(value, (tuple, list)):
        return repr(tuple(float(v) for v in value))
    return repr(float(value))


def _refuse_variants(algorithm, counterpart, *, amsgrad=False, maximize=False,
                     differentiable=False, eps_inside_sqrt=False, max_grad_norm=0.0,
                     decoupled_weight_decay=True, weight_decay=0.0):
    """Refuses, with ValueError, the variants of the update that the
    optimizer this one stands in for (`counterpart`: torch.optim's AdamW or
    Adam, DeepSpeed's OnebitAdam, ZeroOneAdam or OnebitLamb) offers and
    Morse does not; the arguments that only choose how torch computes its
    step (foreach, fused, capturable) or how DeepSpeed communicates
    (cuda_aware, comm_backend_name) are not passed here: they are accepted
    and change nothing."""
    if amsgrad:
        raise ValueError(f"{algorithm} does not support the AMSGrad variant (amsgrad=True)")
    if maximize:
        raise ValueError(f"maximize=True is not supported: {algorithm} minimizes; negate the loss")
    if differentiable:
        raise ValueError("differentiable=True is not supported: the step leaves the process "
                         "(its update comes from the shards), so autograd cannot follow it")
    if eps_inside_sqrt:
        raise ValueError("eps_inside_sqrt=True is not supported: Morse adds eps outside the "
                         "square root, as torch.optim.Adam")
    if max_grad_norm:
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: {counterpart} ignores it; "
                         "clip with clip_grad_norm=")
    if not decoupled_weight_decay and weight_decay:
        raise ValueError(f"decoupled_weight_decay=False with weight_decay={weight_decay!r}: "
                         "Morse's weight decay is decoupled, as AdamW's (torch.optim.Adam's "
                         "default adds it to the gradient instead); for an L2 term, add it to "
                         "the loss")


class OneBitAdam(_MorseOptimizer):
    """1-bit Adam (Tang et al. 2021): full-precision Adam for freeze_step steps
    (at least 1), then sign-compressed momentum with error feedback on
    workers and servers, variance frozen. bias_correction (default True, as
    torch.optim.Adam; False is DeepSpeed's OnebitAdam) corrects m and v, v's
    factor freezing with v; mask_zero_variance (default True) keeps elements
    whose frozen v is exactly 0 (dead units, unused rows) at m = 0 instead of
    sending them +-scale, which would blow the model up at the default eps;
    bound_update (default True) clamps each element's m̂/(sqrt(v̂)+eps) to
    Adam's own largest step, max(1, (1-b1)/sqrt(1-b2)), so elements whose
    frozen v is tiny but not zero cannot take huge steps either.
    clip_grad_norm (default None: off) clips by the global L2 norm as
    torch.nn.utils.clip_grad_norm_ would on the global batch: in warmup the
    averaged gradient, in the compression phase (which has no averaged
    gradient) each rank's own gradient before its momentum, as DeepSpeed
    does; there the pushes wait for the whole backward pass."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 freeze_step=100, *, bias_correction=True, mask_zero_variance=True, bound_update=True,
                 config=None,
                 rank=None, world_size=None, servers=None,
                 overlap=True, accumulation_steps=None, schedule="constant", steps=0,
                 block_elems=None, partition_elems=None, security=None, missing_grads="raise",
                 broadcast_buffers=True, buffers=None, apply_at_step=True, clip_grad_norm=None,
                 eps_inside_sqrt=False, max_grad_norm=0.0, amsgrad=False, cuda_aware=False,
                 comm_backend_name=None):
        del cuda_aware, comm_backend_name  # DeepSpeed's transport settings
        _refuse_variants("1-bit Adam", "DeepSpeed's OnebitAdam", amsgrad=amsgrad,
                         eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm)
        if freeze_step < 1:
            raise ValueError(f"freeze_step={freeze_step}: OneBitAdam needs at least one warmup "
                             "step (with none there is no variance to freeze)")
        super().__init__(params, optimizer="onebit_adam", lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, freeze_step=freeze_step, codec="sign1",
                         down_codec=None, feedback="ef", feedback_beta=None,
                         bias_correction=bias_correction, mask_zero_variance=mask_zero_variance,
                         bound_update=bound_update,
                         schedule=schedule, steps=steps, config=config,
                         rank=rank, world_size=world_size, servers=servers, overlap=overlap,
                         block_elems=block_elems, partition_elems=partition_elems,
                         security=security, accumulation_steps=accumulation_steps,
                         missing_grads=missing_grads, broadcast_buffers=broadcast_buffers,
                         buffers=buffers, apply_at_step=apply_at_step,
                         clip_grad_norm=clip_grad_norm)


class Adam(_MorseOptimizer):
    """Adam on the servers' average of compressed gradients (DESIGN 2.2). The
    defaults (fp32, no feedback, bias correction) are exact synchronous Adam;
    LoCo is codec="int4", feedback="ema" (feedback_beta, the moving average's
    weight of the newest error, defaults to 0.5 for ema; docs/config.md).
    clip_grad_norm (default None: off) clips the averaged gradient by its
    global L2 norm, as torch.nn.utils.clip_grad_norm_ on the global batch.

    weight_decay is decoupled, as torch.optim.AdamW's (AdamW below has
    AdamW's default of 0.01). torch.optim.Adam's other arguments are
    taken where they mean what Morse does: foreach, fused and capturable
    choose how torch computes its step and change nothing here (Morse's step
    is its own, and cannot be captured in a CUDA graph); amsgrad, maximize,
    differentiable and decoupled_weight_decay=False with a weight decay
    raise ValueError."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, codec="fp32", down_codec=None, feedback="none",
                 feedback_beta=None, bias_correction=True, config=None, rank=None,
                 world_size=None, servers=None, overlap=True, accumulation_steps=None,
                 schedule="constant", steps=0, block_elems=None, partition_elems=None,
                 security=None, missing_grads="raise", broadcast_buffers=True, buffers=None,
                 apply_at_step=True, clip_grad_norm=None, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=True):
        del foreach, capturable, fused  # how torch computes its step
        _refuse_variants("Adam", "torch.optim.Adam", amsgrad=amsgrad, maximize=maximize,
                         differentiable=differentiable,
                         decoupled_weight_decay=decoupled_weight_decay, weight_decay=weight_decay)
        super().__init__(params, optimizer="adam", lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, freeze_step=0, codec=codec,
                         down_codec=down_codec, feedback=feedback, feedback_beta=feedback_beta,
                         bias_correction=bias_correction, mask_zero_variance=False, bound_update=False,
                         schedule=schedule, steps=steps,
                         config=config, rank=rank, world_size=world_size, servers=servers,
                         overlap=overlap, block_elems=block_elems, partition_elems=partition_elems,
                         security=security, accumulation_steps=accumulation_steps,
                         missing_grads=missing_grads, broadcast_buffers=broadcast_buffers,
                         buffers=buffers, apply_at_step=apply_at_step,
                         clip_grad_norm=clip_grad_norm)


class AdamW(Adam):
    """Adam under torch.optim.AdamW's name, arguments and defaults
    (weight_decay 0.01, decoupled), so that a script's
    torch.optim.AdamW(...) becomes morse.torch.AdamW(...) with the same
    arguments; Adam's keyword-only ones (codec, clip_grad_norm, ...) too."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **kwargs):
        if "decoupled_weight_decay" in kwargs:
            raise TypeError("AdamW takes no decoupled_weight_decay: its weight decay is decoupled")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class ZeroOneAdam(_MorseOptimizer):
    """0/1 Adam (Lu et al. 2022; docs/design.md 2.7) with DeepSpeed's
    ZeroOneAdam parameter names and defaults: v is updated at full precision
    at var_update_scaler steps with interval 1, then as many with interval 2,
    4, ... up to step var_freeze_step (counted from 1), with 1-bit compressed
    momentum (error feedback on both sides) in between; after it every rank
    takes local steps on its own and the ranks sync every I steps, I doubling
    every local_step_scaler steps up to local_step_clipper. Between syncs each
    rank's parameters are its own, as in DeepSpeed. CPU and CUDA tensors.

    DeepSpeed's cuda_aware and comm_backend_name are accepted and ignored
    (Morse's transport is gRPC to its shards); amsgrad and eps_inside_sqrt
    must stay False and max_grad_norm 0, as DeepSpeed's ZeroOneAdam ignores
    it (clip with clip_grad_norm=). bias_correction (default True) corrects
    m and v, v by the number of its updates; False is DeepSpeed's update.
    mask_zero_variance and bound_update are OneBitAdam's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 bias_correction=True, var_freeze_step=100000, var_update_scaler=16,
                 local_step_scaler=32678, local_step_clipper=16, amsgrad=False, eps_inside_sqrt=False,
                 max_grad_norm=0.0, cuda_aware=False, comm_backend_name=None,
                 mask_zero_variance=True, bound_update=True, config=None,
                 rank=None, world_size=None, servers=None,
                 overlap=True, accumulation_steps=None, schedule="constant", steps=0,
                 block_elems=None, partition_elems=None, security=None, missing_grads="raise",
                 broadcast_buffers=True, buffers=None, apply_at_step=True, clip_grad_norm=None):
        del cuda_aware, comm_backend_name  # DeepSpeed's transport settings
        _refuse_variants("0/1 Adam", "DeepSpeed's ZeroOneAdam", amsgrad=amsgrad,
                         eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm)
        zero_one = dict(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                        local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)
        for name, value in zero_one.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2 ** 40:
                raise ValueError(f"{name}={value!r}: an integer in [1, 2**40]")
        super().__init__(params, optimizer="zero_one_adam", lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, freeze_step=0, codec="sign1",
                         down_codec=None, feedback="ef", feedback_beta=None,
                         bias_correction=bias_correction, mask_zero_variance=mask_zero_variance,
                         bound_update=bound_update,
                         schedule=schedule, steps=steps, config=config,
                         rank=rank, world_size=world_size, servers=servers, overlap=overlap,
                         block_elems=block_elems, partition_elems=partition_elems,
                         security=security, accumulation_steps=accumulation_steps,
                         missing_grads=missing_grads, broadcast_buffers=broadcast_buffers,
                         buffers=buffers, apply_at_step=apply_at_step,
                         clip_grad_norm=clip_grad_norm, zero_one=zero_one)


class OneBitLamb(_MorseOptimizer):
    """1-bit LAMB (Li et al. 2021; docs/design.md 2.8) with DeepSpeed's
    OnebitLamb parameter names and defaults. For freeze_step steps it is
    LAMB on the averaged gradient: each parameter tensor (a "layer") steps
    by lr * c * u, u = m̂/(sqrt(v̂)+eps) + weight_decay * x and c =
    ||x|| / ||u|| clamped to [min_coeff, max_coeff], whose moving average
    (coeff_beta) is kept. Then v freezes and the ranks exchange 1-bit
    momentum with error feedback on both sides, as OneBitAdam; a layer's
    coefficient is that average times a factor from a fresh variance
    reconstructed from the momenta, clamped to [factor_min, factor_max] and
    to within factor_threshold of the last step's. CPU and CUDA tensors;
    state_dict() carries v', the layers' state and the last commit.

    DeepSpeed's cuda_aware and comm_backend_name are accepted and ignored;
    amsgrad and eps_inside_sqrt must stay False and max_grad_norm 0 (DeepSpeed's
    OnebitLamb ignores it). Clip with clip_grad_norm= or the script's
    torch.nn.utils.clip_grad_norm_ after backward(), as OneBitAdam: the
    averaged gradient in the warmup, each rank's own after the freeze
    (docs/design.md 2.6). bias_correction (default True) corrects m and v;
    False is DeepSpeed's update. mask_zero_variance and bound_update are
    OneBitAdam's, after the freeze."""

    def __init__(self, params, lr=1e-3, freeze_step=100000, bias_correction=True,
                 betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0.0,
                 max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False, cuda_aware=False,
                 comm_backend_name=None, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, *, mask_zero_variance=True, bound_update=True, config=None,
                 rank=None, world_size=None, servers=None,
                 overlap=True, accumulation_steps=None, schedule="constant", steps=0,
                 block_elems=None, partition_elems=None, security=None, missing_grads="raise",
                 broadcast_buffers=True, buffers=None, apply_at_step=True, clip_grad_norm=None):
        del cuda_aware, comm_backend_name  # DeepSpeed's transport settings
        _refuse_variants("1-bit LAMB", "DeepSpeed's OnebitLamb", amsgrad=amsgrad,
                         eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm)
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step={freeze_step!r}: OneBitLamb needs at least one warmup step")
        lamb = dict(max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
                    factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold)
        for name, value in lamb.items():
            try:
                ok = float(value) == float(value) and abs(float(value)) != float("inf")
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{name}={value!r}: a finite number")
        if not 0 < min_coeff <= max_coeff:
            raise ValueError(f"min_coeff={min_coeff!r}, max_coeff={max_coeff!r}: 0 < min_coeff <= max_coeff")
        if not 0 <= coeff_beta < 1:
            raise ValueError(f"coeff_beta={coeff_beta!r}: in [0, 1)")
        if not 0 < factor_min <= factor_max:
            raise ValueError(f"factor_min={factor_min!r}, factor_max={factor_max!r}: "
                             "0 < factor_min <= factor_max")
        if not 0 <= factor_threshold < 1:
            raise ValueError(f"factor_threshold={factor_threshold!r}: in [0, 1)")
        super().__init__(params, optimizer="onebit_lamb", lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, freeze_step=freeze_step, codec="sign1",
                         down_codec=None, feedback="ef", feedback_beta=None,
                         bias_correction=bias_correction, mask_zero_variance=mask_zero_variance,
                         bound_update=bound_update,
                         schedule=schedule, steps=steps, config=config,
                         rank=rank, world_size=world_size, servers=servers, overlap=overlap,
                         block_elems=block_elems, partition_elems=partition_elems,
                         security=security, accumulation_steps=accumulation_steps,
                         missing_grads=missing_grads, broadcast_buffers=broadcast_buffers,
                         buffers=buffers, apply_at_step=apply_at_step,
                         clip_grad_norm=clip_grad_norm, lamb=lamb)


from .diloco import DiLoCo  # noqa: E402 (uses the helpers above)
from .deepspeed import from_deepspeed  # noqa: E402 (builds the classes above)
