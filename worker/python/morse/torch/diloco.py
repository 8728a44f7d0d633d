"""DiLoCo (Douillard et al. 2023) through a Morse job: the outer optimizer
runs on the shards (docs/design.md 2.11).

Each rank trains its own copy of the model with any torch optimizer (the
inner optimizer) for `sync_every` steps, then pushes its pseudo-gradient,
the outer parameters minus its own, through the job's codec (fp32 by
default; bf16, fp16, int8, int4 or sign1 with error feedback). The shards
average the ranks' pseudo-gradients, compress the average back (with their
own error feedback) and every replica, the ranks and the shards' mirrors,
takes one outer step of SGD with Nesterov momentum on it; each rank then
restarts its inner steps from the new outer parameters. The outer
parameters and momentum stay on the host, whatever device the model is on:
a sync costs one copy of the model each way, once per sync_every steps.

Streaming DiLoCo (Douillard et al. 2025): with fragments=F the shards'
partitions form F strided fragments (partition q in fragment q mod F), and
every sync_every / F inner steps one fragment syncs, in turn; each fragment
thus syncs every sync_every steps, and the traffic is spread evenly instead
of in bursts. With overlap_steps=tau the sync's exchange runs while tau more
inner steps do, and the fragment's parameters then become
mixing * local + (1 - mixing) * outer (mixing 0.5 by default with an
overlap, 0, the outer parameters, without).
"""
import copy
import os
import re
import weakref

import torch

from .. import _native
from . import (MorseError, _amp_of, _base_config, _check_own_state_loaded, _codec_lines, _env,
               _external_model, _grad_scaler_refused, _MorseOptimizer, _overflow_of,
               _rank_checkpoint, _security, _unscale, _warn_if_group_cannot_take_back)
from .state import _await_own_state, _warn_resized


def _float(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: a number") from None
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"{name}={value!r}: a finite number")
    return value


class DiLoCo(torch.optim.Optimizer):
    """Wraps `inner_optimizer` (built over `params`, a model or its
    parameters) so that every `sync_every` calls of step() end with an outer
    step through the Morse job that morse-run (or rank=, world_size=,
    servers=) names:

        inner = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
        opt = morse.torch.DiLoCo(model, inner, sync_every=500)
        for batch in data:
            opt.zero_grad()
            loss(model, batch).backward()
            opt.step()

    outer_lr (0.7), outer_momentum (0.9) and nesterov (True) are the
    paper's defaults; outer_momentum=0 and outer_lr=1 average the ranks'
    models (federated averaging). fragments=F (dividing sync_every and the
    job's partitions) syncs one of F fragments every sync_every / F steps
    (Streaming DiLoCo); overlap_steps=tau (less than sync_every / F) applies
    each sync tau inner steps after it began, mixing the fragment's local
    parameters with the new outer ones by `mixing` (flush() after the last
    step() applies the sync still in flight). warmup_steps=K makes the
    first K syncs come after warmup_sync_every (1) inner steps each, then
    every sync_every / fragments (a synchronous start: design.md 2.11).
    Learning-rate schedulers take the inner optimizer. Rank 0's initial
    parameters become every rank's. Every rank holds bit-identical outer
    parameters after each sync, as do the shards' mirrors and the simulator
    fed the same pseudo-gradients.

    state_dict() holds the inner optimizer's state, this rank's parameters,
    the outer parameters, the outer momentum, this rank's worker error
    buffer and, on rank 0, the shards' error buffers: save every rank's,
    and load each into a fresh job to continue the run exactly.

    It is a torch.optim.Optimizer whose param_groups, state and defaults
    are the inner optimizer's (torch.optim.Optimizer.__init__ is not run:
    nothing of it is its own), so that what takes an Optimizer (a
    scheduler, Hugging Face Trainer, Accelerate's prepare) takes it, and a
    scheduler built over it schedules the inner steps.

    Under fp16 loss scaling (torch.amp.GradScaler, a script's or Trainer's
    and Accelerate's) each rank's inner steps are its own, as they would be
    training alone: a step whose gradients overflowed on this rank is
    skipped by this rank alone (its inner optimizer does not step), but it
    counts as an inner step, so that every rank reaches each sync at the
    same step() (design.md 2.11). Under --node-aggregation the node's
    ranks skip together, as DDP's inside the node: where any of them
    overflowed (the node's average holds an Inf or NaN)."""

    # torch.amp.GradScaler hands the steps it drives to step() (torch 2's
    # grad_scale and found_inf attributes; torch 1.13's grad_scaler
    # argument), which counts a skipped one.
    _step_supports_amp_scaling = True

    def __init__(self, params, inner_optimizer, *, sync_every=500, outer_lr=0.7,
                 outer_momentum=0.9, nesterov=True, fragments=1, overlap_steps=0, mixing=None,
                 warmup_steps=0, warmup_sync_every=1, codec="fp32", down_codec=None,
                 feedback=None, feedback_beta=None, steps=0, config=None, rank=None,
                 world_size=None, servers=None, block_elems=None, partition_elems=None,
                 security=None):
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer is a {type(inner_optimizer).__name__}; DiLoCo wraps "
                            "a torch.optim.Optimizer over the model's parameters")
        if isinstance(inner_optimizer, (_MorseOptimizer, DiLoCo)):
            raise ValueError(f"inner_optimizer is a Morse {type(inner_optimizer).__name__}, which "
                             "exchanges every step itself; DiLoCo's inner steps are each rank's "
                             "own: give it a torch optimizer (e.g. torch.optim.AdamW)")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}: a whole number of inner steps, at least 1")
        for name, value in (("fragments", fragments), ("overlap_steps", overlap_steps),
                            ("warmup_steps", warmup_steps),
                            ("warmup_sync_every", warmup_sync_every)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: a whole number")
        if fragments < 1 or sync_every % fragments:
            raise ValueError(f"fragments={fragments}: at least 1, and dividing "
                             f"sync_every={sync_every} (each fragment syncs every sync_every "
                             "steps, one every sync_every / fragments)")
        period = sync_every // fragments
        if not 0 <= overlap_steps < period:
            raise ValueError(f"overlap_steps={overlap_steps}: in [0, {period}) (a sync must be "
                             f"applied before the next begins, sync_every / fragments = {period} "
                             "steps later)")
        if warmup_steps < 0 or warmup_sync_every < 1:
            raise ValueError(f"warmup_steps={warmup_steps}, warmup_sync_every={warmup_sync_every}: "
                             "at least 0 outer steps of at least 1 inner step each")
        if warmup_steps and overlap_steps >= warmup_sync_every:
            raise ValueError(f"overlap_steps={overlap_steps}: below warmup_sync_every="
                             f"{warmup_sync_every} with warmup_steps (a sync must be applied "
                             "before the next begins)")
        mixing = (0.5 if overlap_steps else 0.0) if mixing is None else _float("mixing", mixing)
        if not 0 <= mixing < 1:
            raise ValueError(f"mixing={mixing!r}: in [0, 1)")
        outer_lr = _float("outer_lr", outer_lr)
        outer_momentum = _float("outer_momentum", outer_momentum)
        if not outer_lr > 0:
            raise ValueError(f"outer_lr={outer_lr!r}: positive")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum={outer_momentum!r}: in [0, 1)")
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        params = [p[1] if isinstance(p, tuple) else p for p in params]
        self._params = [p for p in params if p.requires_grad]
        if not self._params:
            raise ValueError("DiLoCo got no trainable parameters")
        inner = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        for i, p in enumerate(self._params):
            if id(p) not in inner:
                raise ValueError(f"parameter {i} {tuple(p.shape)} is not the inner optimizer's; "
                                 "build the inner optimizer over the same parameters")
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {i} ({tuple(p.shape)}) is {p.dtype}; Morse trains "
                                "float32 parameters")
        self.inner = inner_optimizer
        self.sync_every = sync_every
        self.fragments, self.overlap_steps, self.mixing = fragments, overlap_steps, mixing
        self.warmup_steps, self.warmup_sync_every = warmup_steps, warmup_sync_every
        self._in_flight = None  # (the sync's step, the inner step that applies it)
        if feedback is None:
            feedback = "none" if codec in ("fp32", "fp16", "bf16") else "ef"
        codecs = _codec_lines(codec, down_codec, feedback, feedback_beta)
        aggregation = os.environ.get("MORSE_NODE_AGGREGATION")
        if aggregation == "sharded":
            raise MorseError("FAILED_PRECONDITION: DiLoCo under --node-aggregation=sharded: a "
                             "DiLoCo node syncs its one model through its leader; use "
                             "--node-aggregation (the node's ranks take their inner steps "
                             "together, as DDP, and the leader syncs for the node)")
        self._rank = _env("MORSE_RANK", rank, int, torchrun="RANK")
        world = _env("MORSE_WORLD_SIZE", world_size, int, torchrun="WORLD_SIZE")
        servers = _env("MORSE_SERVERS", servers)
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        # morse-run --node-aggregation: a node is one DiLoCo worker. Its
        # ranks average their gradients at every inner step (DDP inside the
        # node, node.py's gather and broadcast), so they hold one model;
        # the leader syncs it and the node takes the merged parameters.
        self._node = None
        worker, workers = self._rank, world
        if aggregation:
            from .node import node_of_job
            self._node = node_of_job(self._rank, world)
            worker, workers = self._node.node, self._node.nnodes
        self._worker, self._workers = worker, workers
        base = _base_config(config, workers, servers)
        self._elastic = re.search(r"^\s*min_workers\s*:", base, re.M) is not None
        dim, external = _external_model(self._params)
        lines = [
            external,
            'optimizer: "diloco"',
            f"diloco {{ sync_every: {sync_every} outer_lr: {outer_lr!r} "
            f"outer_momentum: {outer_momentum!r} nesterov: {'true' if nesterov else 'false'}"
            + (f" fragments: {fragments}" if fragments > 1 else "")
            + (f" overlap_steps: {overlap_steps}" if overlap_steps else "")
            + (f" warmup_steps: {warmup_steps} warmup_sync_every: {warmup_sync_every}"
               if warmup_steps else "")
            + f" mixing: {mixing!r} }}",
            f"lr {{ lr: {outer_lr!r} }}",
            f"steps: {steps}",
        ] + codecs
        if block_elems:
            lines.append(f"block_elems: {block_elems}")
        if partition_elems:
            lines.append(f"partition_elems: {partition_elems}")
        self.job_overrides = "\n".join(lines)
        # The outer parameters and the pseudo-gradient, on the host.
        self._ranges, offset = [], 0
        for p in self._params:
            self._ranges.append((offset, offset + p.numel()))
            offset += p.numel()
        self._x = self._local()
        self._grad = torch.zeros(dim, dtype=torch.float32)
        self._inner_steps = 0
        self._starts_at = 0  # the shards' sync when this rank joined them without a state of its own
        self._skipped_last = False  # whether the last step() skipped (morse.torch.hf reads it)
        self._due = 1  # the outer step whose sync is due next (by inner steps)
        self.last_sync = {}
        self._session = None  # a node's other ranks have none
        self._led = None  # a node's other rank: (step_index, checksum, members) of the last merge
        if self._node is None or self._node.is_leader:
            self._session = _native.Session(base, self.job_overrides, worker, servers,
                                            self._x.numpy(), _security(security))
            # A rank that morse-run --rank-restarts may restart saves the
            # session's whole state every checkpoint.every_steps syncs to
            # MORSE_CHECKPOINT_DIR, with the inner optimizer's state beside
            # it, and restarted (MORSE_REJOIN=1) starts from both.
            self._checkpoint, self._checkpoint_every = _rank_checkpoint(self._session, worker)
            self._partitions = self._session.partitions()
            if os.environ.get("MORSE_REJOIN") == "1":
                self._rejoin()
            else:
                self._session.start(False)  # rank 0 uploads; the others receive rank 0's values
                self._to_params()
                # Shards that rank 0 restored to sync k (a resumed job, this
                # rank loading its own state next, or a rank the saved job
                # did not have, which loads none): the inner steps go on
                # from that sync's, with the shards' outer parameters.
                self._starts_at = self._session.step_index
                if self._starts_at > 0:
                    self._inner_steps = self._session.inner_steps_before(self._starts_at)
                    self._due = self._starts_at + 1
        self._averaged = None  # a node's step: whether it merges, once averaged (at a clip)
        self._scaler = None  # a node's rank: the GradScaler whose scale() told it last
        # Under morse.torch.hf (Trainer's and Accelerate's resume load rank
        # 0's state on every rank), as for the other Morse optimizers:
        # another rank's state is set aside (rank, step) until this rank's
        # own is loaded, from the file the load hook names if it does.
        self._finds_own_state = False
        self._awaiting_own_state = None
        self._own_state_file = None
        # Tells this optimizer's own state_dict() of now apart (Accelerate's
        # wrapper gives it straight back: nothing to restore).
        self._nonce = os.urandom(8).hex()
        if self._node is not None:
            # Through shared memory where the host lets it (node.py): the
            # node's average comes back with one flag more than the model.
            self._node.use_shared_memory(max(dim, sum(p.numel() for p in self._params)) + 1)
            self._node_start()
            # The script's clip_grad_norm_ clips the node's average, as DDP
            # inside the node would (_clip_grad_norm).
            # torch.amp.GradScaler's scale() tells it which scaler's record
            # of the step's overflow to set to the node's (_loss_scaled_by).
            from . import _OPTIMIZERS, _install_clip_grad_norm, _install_grad_scaler_hook
            _OPTIMIZERS.append(weakref.ref(self))
            _install_clip_grad_norm()
            _install_grad_scaler_hook()

    def _node_start(self):
        """The node takes its leader's parameters, inner steps and (a
        restarted node) inner optimizer state."""
        node = self._node
        local = self._local()
        node.share(local)
        if not node.is_leader:
            self._set_local(local)
        rejoin = os.environ.get("MORSE_REJOIN") == "1"
        state = node.objects((self._inner_steps, self.inner.state_dict() if rejoin else None,
                              self._leads()) if node.is_leader else None)[0]
        if not node.is_leader:
            self._inner_steps, inner, self._led = state
            if inner is not None:
                self.inner.load_state_dict(inner)

    def _leads(self):
        """What a node's other ranks report as theirs: the leader's step,
        checksum and membership."""
        return self._session.step_index, self._session.checksum(), self._session.members()

    def _merges_after(self, inner_steps):
        """On a node's leader: whether the step that brings the inner steps
        to `inner_steps` merges an outer step into the parameters (applies
        the sync in flight, or syncs without overlap_steps)."""
        applies = self._in_flight is not None and inner_steps == self._in_flight[1]
        syncs = self._session.inner_steps_before(self._due) == inner_steps
        return applies or (syncs and not self.overlap_steps)

    @torch.no_grad()
    def _node_average(self):
        """The node's inner step is one: every rank's gradient goes to the
        leader, which sums them in local-rank order ((g0 + g1) + ...) / L
        and sends the average back with whether this step merges, into
        every rank's .grad (zero where a rank had none). Returns that."""
        from .node import flat_grads
        node = self._node
        grads = flat_grads(self._params, node.staging(0, sum(p.numel() for p in self._params)))
        average, _, _ = node.average(grads, ())
        back = torch.empty(grads.numel() + 1)
        if node.is_leader:
            back[:-1] = average
            back[-1] = float(self._merges_after(self._inner_steps + 1))
        node.share(back)
        for p, (lo, hi) in zip(self._params, self._ranges):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(back[lo:hi].view_as(p))
        return bool(back[-1] == 1)

    def _node_merged(self):
        """After a merge on the leader: every rank of the node takes its
        parameters (and its step, checksum and membership)."""
        node = self._node
        local = self._local()
        node.share(local)
        led = node.objects(self._leads() if node.is_leader else None)[0]
        if not node.is_leader:
            self._set_local(local)
            self._led = led

    def _inner_path(self):
        return self._checkpoint + ".inner"

    def _rejoin(self):
        """Starts from this rank's checkpoint (the outer parameters, momentum
        and error buffer of a sync) and the inner optimizer's state saved
        beside it; the steps the shards completed since are replayed with the
        replies they kept. Without a checkpoint: the shards' outer
        parameters, zero error buffer and a fresh inner optimizer."""
        path = self._checkpoint or ""
        has_inner = bool(path) and os.path.exists(self._inner_path())
        step = self._session.start(True, path if has_inner else "")
        if has_inner:
            saved = torch.load(self._inner_path())
            if saved.get("step") != step or saved.get("rank") != self._rank:
                # The session's checkpoint was written and the inner state's
                # was not (killed between the two): the run cannot continue
                # exactly from either.
                raise MorseError(
                    f"FAILED_PRECONDITION: {self._inner_path()} holds rank {saved.get('rank')}'s "
                    f"inner optimizer state of sync {saved.get('step')}, but this rank starts at "
                    f"sync {step}; resume the whole job from every rank's state_dict()")
            self.inner.load_state_dict(saved["inner"])
        else:
            print(f"morse: rank {self._rank} rejoins at sync {step} without a checkpoint: the "
                  "shards' outer parameters, a zero error buffer and a fresh inner optimizer",
                  flush=True)
        self._inner_steps = self._session.inner_steps_before(step)
        self._due = step + 1
        if has_inner:
            # Its own parameters (fragments not yet synced keep their local
            # progress) and step count (an overlapped sync is saved when it
            # is applied).
            self._inner_steps = saved.get("inner_steps", self._inner_steps)
            if "params" in saved:
                self._set_local(saved["params"])
                return
        self._to_params()

    def _save_checkpoint(self):
        """The inner optimizer's state beside the session's checkpoint, both
        of this sync (the inner one renamed into place last)."""
        step = self._session.step_index
        torch.save({"step": step, "rank": self._rank, "inner": self.inner.state_dict(),
                    "inner_steps": self._inner_steps, "params": self._local()},
                   self._inner_path() + ".tmp")
        self._session.save_checkpoint(self._checkpoint)
        os.replace(self._inner_path() + ".tmp", self._inner_path())

    def _local(self):
        """This rank's parameters, flat, on the host (a copy)."""
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32)
                              for p in self._params])

    @torch.no_grad()
    def _to_params(self):
        self._set_local(self._x)

    @torch.no_grad()
    def _set_local(self, flat):
        for p, (lo, hi) in zip(self._params, self._ranges):
            p.copy_(flat[lo:hi].view_as(p))

    @property
    def param_groups(self):
        return self.inner.param_groups

    def add_param_group(self, param_group):
        raise ValueError("DiLoCo's outer parameters are fixed at construction: add_param_group is "
                         "not supported; build the inner optimizer and DiLoCo over every "
                         "parameter")

    @property
    def state(self):
        """The inner optimizer's per-parameter state (what wrappers such as
        Accelerate's read as torch.optim.Optimizer.state)."""
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    @property
    def device(self):
        """The device of the model's parameters (the inner state's)."""
        return self._params[0].device

    def _taken(self):
        """What tells this optimizer's state_dict() of now apart."""
        return f"{self._nonce}:{self._inner_steps}"

    @property
    def rank(self):
        return self._rank

    @property
    def inner_steps(self):
        """Inner steps taken (step() calls) since the start of the run."""
        return self._inner_steps

    @property
    def step_index(self):
        """Outer steps (syncs) the job has taken (a node's rank: its
        leader's, as of the last merge)."""
        return self._led[0] if self._session is None else self._session.step_index

    def membership(self):
        """The ranks whose pseudo-gradients the last sync averaged (all of
        them except after a sync of an elastic job that completed without
        some; min_workers). Under --node-aggregation: every rank of the
        nodes it averaged."""
        nodes = self._led[2] if self._session is None else self._session.members()
        return nodes if self._node is None else self._node.member_ranks(nodes)

    def _owned(self, parameters):
        """For clip_grad_norm_ (a node's ranks only): None if none of
        `parameters` is this optimizer's; else how many they are.
        ValueError for part of them or a mix."""
        if self._node is None:
            return None  # each rank's own gradient: torch's clip as it is
        mine = {id(p) for p in self._params}
        ours = {id(p) for p in parameters if id(p) in mine}
        if not ours:
            return None
        if len(ours) != len(mine) or any(id(p) not in mine for p in parameters):
            raise ValueError("clip_grad_norm_ under --node-aggregation with DiLoCo: pass all of "
                             "the model's trainable parameters and nothing else (the node "
                             "averages the whole gradient, then clips it as DDP would)")
        return len(ours)

    def _clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite, owned):
        """clip_grad_norm_ on a node's rank: the node's average gradient
        first (the step takes it; every rank of the node calls this), then
        torch's clip of it, the same on every rank, as DDP inside the node."""
        from . import _TORCH_CLIP_GRAD_NORM
        if self._averaged is None:
            self._averaged = self._node_average()
        return _TORCH_CLIP_GRAD_NORM(self._params, max_norm, norm_type=norm_type,
                                     error_if_nonfinite=error_if_nonfinite)

    def zero_grad(self, set_to_none=None):
        if set_to_none is None:
            self.inner.zero_grad()
        else:
            self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None, **amp):
        """The inner optimizer's step; every sync_every-th also syncs: pushes
        this rank's pseudo-gradient, waits for the outer step and sets the
        parameters to the new outer parameters."""
        # (**amp: torch 1.13's GradScaler passes grad_scaler=; torch 2's,
        # given no such parameter, sets attributes instead.)
        grad_scaler = amp.pop("grad_scaler", None)
        if amp:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(amp)}")
        _check_own_state_loaded(self, "DiLoCo state of outer step",
                                "its inner optimizer's state, parameters and error buffer are its "
                                "own")
        if self._starts_at:
            print(f"morse: rank {self._rank} has no saved state and starts at sync "
                  f"{self._starts_at} of the shards (inner step {self._inner_steps}): their outer "
                  "parameters, a zero error buffer and a fresh inner optimizer", flush=True)
            self._starts_at = 0
        self._skipped_last = self._scaled_step_overflowed(grad_scaler)
        _warn_if_group_cannot_take_back(self._elastic)
        if self._skipped_last:
            # This rank's inner step is skipped (a node's: every rank of it),
            # and counted: the schedule of syncs is every rank's, and a
            # merge due at this step is taken by the node's ranks together.
            self._inner_steps += 1
            merges, self._averaged = self._averaged, None
            if self._session is not None:
                self._after_inner_step()
            if merges:
                self._node_merged()
            return None
        merges = False
        if self._node is not None:
            if closure is not None:
                raise ValueError("step(closure) under --node-aggregation: the node averages the "
                                 "gradients of one backward() before the inner step; call "
                                 "backward() and then step()")
            merges = self._node_average() if self._averaged is None else self._averaged
            self._averaged = None
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self._inner_steps += 1
        if self._session is None:
            if merges:
                self._node_merged()
            return loss
        self._after_inner_step()
        if merges:
            self._node_merged()
        return loss

    def _scaled_step_overflowed(self, grad_scaler):
        """For a step that torch.amp.GradScaler drives (its found_inf and
        grad_scale attributes): whether this rank's gradients overflowed
        (the step is skipped); else .grad is unscaled where the script did
        not (scaler.unscale_); torch 1.13's GradScaler (step(grad_scaler=))
        through its unscale_. A node's rank: the node's verdict
        (_node_overflowed)."""
        found_inf, grad_scale = _amp_of(self)
        if grad_scaler is None and found_inf is None:
            return False
        if grad_scaler is not None and not hasattr(grad_scaler, "_per_optimizer_states"):
            raise _grad_scaler_refused(self, "this DiLoCo step", "not torch's GradScaler")
        if self._node is not None:
            return self._node_overflowed(grad_scaler, grad_scale)
        if grad_scaler is not None:
            # torch 1.13's contract (step(grad_scaler=)): .grad unscaled
            # through the scaler where the script did not (scaler.unscale_),
            # which records this rank's verdict where update() reads it.
            state = grad_scaler._per_optimizer_states[id(self)]
            if not state["found_inf_per_device"]:
                grad_scaler.unscale_(self)
            return sum(v.item() for v in state["found_inf_per_device"].values()) > 0
        if found_inf.item() > 0:
            return True
        if grad_scale is not None:  # as scaler.unscale_ would, had the script called it
            _unscale([p for group in self.inner.param_groups for p in group["params"]], grad_scale)
        return False

    def _node_overflowed(self, grad_scaler, grad_scale):
        """_scaled_step_overflowed on a node's rank. As DDP inside the node,
        whose scaler unscales the averaged gradient: the node's average is
        taken first (kept in self._averaged for step()), unscaled where the
        script did not, and the step overflowed where the average holds an
        Inf or NaN (where some rank's gradient did), the same verdict on
        every rank of the node. Each rank's scaler records that verdict,
        so that the node's loss scales move alike. (The scale is a power of
        two: averaging the unscaled gradients, where the script unscaled
        its own, gives the unscaled average's bits.)"""
        scaler = grad_scaler if grad_scaler is not None else self._scaler
        states = getattr(scaler, "_per_optimizer_states", None)
        if states is None or id(self) not in states:
            raise _grad_scaler_refused(
                self, "this DiLoCo step", "under --node-aggregation morse.torch writes the "
                "node's verdict into the GradScaler's record, and this one's scale() did not "
                "tell it (torch's GradScaler does, before backward())")
        if self._averaged is None:
            self._averaged = self._node_average()
        state = states[id(self)]
        if grad_scaler is not None:
            if not state["found_inf_per_device"]:
                grad_scaler.unscale_(self)  # the node's average, as DDP's scaler
            grad_scale = None
        overflowed = _overflow_of([p.grad for p in self._params if p.grad is not None]) > 0
        for t in state["found_inf_per_device"].values():
            t.fill_(1.0 if overflowed else 0.0)
        if not overflowed and grad_scale is not None:
            _unscale(self._params, grad_scale)  # as scaler.unscale_ would, had the script called it
        return overflowed

    def _loss_scaled_by(self, scaler):
        """A node's rank (listed among morse.torch's optimizers for
        clip_grad_norm_): torch.amp.GradScaler.scale names the scaler whose
        record of the step's overflow step() sets to the node's verdict."""
        self._scaler = scaler

    def _after_inner_step(self):
        """The job's part of an inner step just counted: the sync in flight
        applied at its step, and the sync due begun."""
        if self._in_flight is not None and self._inner_steps == self._in_flight[1]:
            self._apply()
        # The job's schedule by inner steps (compress::InnerStepsBefore: the
        # warmup's, then every sync_every / fragments); a sync() called
        # outside it does not move it. Each outer step takes at least one
        # inner step, and start, rejoin and load_state_dict set _due to the
        # step after the one the inner steps are in, so it is never passed.
        if self._session.inner_steps_before(self._due) == self._inner_steps:
            self._due += 1
            self._sync()

    @torch.no_grad()
    def sync(self):
        """An outer step now (step() calls it every sync_every / fragments
        steps): pushes this rank's pseudo-gradient (of the fragment due),
        and, without overlap_steps, waits for the outer step and sets the
        parameters (the fragment's) to the new outer parameters."""
        if self._node is not None:
            raise MorseError("FAILED_PRECONDITION: sync() outside step() under "
                             "--node-aggregation: the node's ranks merge together at the steps "
                             "the schedule gives")
        self._sync()

    def _sync(self):
        if self._in_flight is not None:
            raise MorseError(f"FAILED_PRECONDITION: the sync begun for outer step "
                             f"{self._in_flight[0]} is applied at inner step "
                             f"{self._in_flight[1]}; sync() cannot begin another before")
        step = self._session.step_index
        torch.sub(self._x, self._local(), out=self._grad)
        if not self.overlap_steps:
            self.last_sync = self._session.step(self._grad.numpy())
            self._merge(step)
            return
        # The exchange runs while the next overlap_steps inner steps do.
        self._session.begin(self._grad.numpy())
        self._session.send_partitions(list(range(len(self._partitions))))
        self._in_flight = (step, self._inner_steps + self.overlap_steps)

    def flush(self):
        """Applies the sync in flight (overlap_steps) now: waits for its
        outer step and merges it into the parameters, as step() does
        overlap_steps inner steps after the sync began. Call it after the
        last step() so that the model holds the last sync; nothing happens
        when no sync is in flight. Under --node-aggregation call it on every
        rank of the node."""
        if self._node is not None:
            leader = self._session is not None
            if self._node.objects(self._in_flight is not None if leader else None)[0]:
                if leader:
                    self._apply()
                self._node_merged()
            return
        if self._in_flight is not None:
            self._apply()

    @torch.no_grad()
    def _apply(self):
        """The sync in flight (overlap_steps): its outer step, then the merge."""
        step, _ = self._in_flight
        self._in_flight = None
        self.last_sync = self._session.finish()
        self._merge(step)

    @torch.no_grad()
    def _merge(self, step):
        """After outer step `step`: the synced partitions' parameters become
        the outer ones (mixing 0) or mixing * local + (1 - mixing) * outer;
        the other fragments' keep their local progress."""
        local = self._local()
        self._session.merge_outer(step, local.numpy())  # the job's rule, written once
        self._set_local(local)
        if self._checkpoint and self._session.step_index % self._checkpoint_every == 0:
            self._save_checkpoint()

    def outer_parameters(self):
        """A copy of the outer parameters (flat, on the host; a node's
        leader holds them)."""
        if self._session is None:
            raise MorseError("FAILED_PRECONDITION: under --node-aggregation the outer parameters "
                             "are the node's leader's (local rank 0); after a sync every rank's "
                             "model holds them")
        return self._x.clone()

    def checksum(self):
        """A checksum of the outer parameters and momentum (equal on every
        rank after each sync; a node's rank: its leader's)."""
        return self._led[1] if self._session is None else self._session.checksum()

    def state_dict(self):
        if self._in_flight is not None:
            raise MorseError(
                f"FAILED_PRECONDITION: a sync is in flight (outer step {self._in_flight[0]}, applied "
                f"at inner step {self._in_flight[1]}; now {self._inner_steps}): call state_dict() "
                f"after it is applied, overlap_steps={self.overlap_steps} inner steps after a "
                "sync begins")
        if self._session is None:
            # A node's other rank: the node's state is its leader's; this
            # rank's inner state and parameters are the same as its.
            return {"inner": self.inner.state_dict(), "inner_steps": self._inner_steps,
                    "sync_every": self.sync_every, "params": self._local(), "outer": None,
                    "node_member": True, "rank": self._rank}
        step, m, _, error = self._session.get_state()
        outer = {"step": step, "rank": self._rank, "workers": self._workers,
                 "taken": self._taken(), "params": self._x.clone(),
                 "momentum": torch.from_numpy(m), "worker_error": torch.from_numpy(error)}
        if self._worker == 0:
            outer["server_error"] = torch.from_numpy(self._session.server_error())
        return {"inner": self.inner.state_dict(), "inner_steps": self._inner_steps,
                "sync_every": self.sync_every, "fragments": self.fragments,
                "overlap_steps": self.overlap_steps, "warmup_steps": self.warmup_steps,
                "warmup_sync_every": self.warmup_sync_every, "params": self._local(),
                "outer": outer}

    def load_state_dict(self, state_dict):
        """Restores a run saved with state_dict() before the first step(), on
        every rank with its own state (rank 0's holds the shards' error
        buffers): against fresh shards rank 0 restores them and the others
        wait for it. The parameters become this rank's saved ones (between
        syncs they differ from the outer parameters)."""
        if not isinstance(state_dict, dict) or "outer" not in state_dict:
            raise ValueError(
                "DiLoCo.load_state_dict takes what DiLoCo.state_dict() returned (its inner "
                "optimizer's state, the outer momentum and error buffers, the parameters); this "
                f"is {'a dict without outer' if isinstance(state_dict, dict) else type(state_dict).__name__}"
                ". To go on from a torch.optim run, load the model's weights and the inner "
                "optimizer's state (DiLoCo(...).inner.load_state_dict) before the first step")
        outer = state_dict["outer"]
        dim = self._x.numel()
        if (outer is not None and outer.get("taken") == self._taken()
                and self._awaiting_own_state is None and torch.equal(
                    state_dict["params"].detach().reshape(-1).cpu(), self._local())):
            # This optimizer's own state_dict() of now, given back
            # (Accelerate's optimizer wrapper does that when it is built):
            # nothing to restore, and the shards may be ahead of it.
            return
        # Whose state it is: its inner optimizer's state and parameters are
        # that rank's own (and a node's, that node's).
        saved_rank = (state_dict.get("rank", self._rank) if outer is None
                      else outer.get("rank", self._rank))
        if saved_rank != self._rank:
            if self._finds_own_state:
                _await_own_state(self, saved_rank, int(outer["step"]) if outer else -1,
                                 self.device)
                return
            raise ValueError(f"this state_dict is rank {saved_rank}'s, this is rank {self._rank}: "
                             "its inner optimizer's state, parameters and worker error buffer are "
                             "that rank's own; load each rank's own")
        if self._session is None:
            # A node's other rank: its leader restores the node's worker.
            if "params" not in state_dict or state_dict["params"].numel() != dim:
                raise ValueError(f"state_dict['params'] must hold {dim} values")
            self.inner.load_state_dict(state_dict["inner"])
            self._inner_steps = int(state_dict["inner_steps"])
            self._set_local(state_dict["params"].detach().reshape(-1).to("cpu", torch.float32))
            self._awaiting_own_state = None
            return
        for key in ("params", "momentum", "worker_error"):
            if key not in outer or outer[key].numel() != dim:
                raise ValueError(f"state_dict['outer']['{key}'] must hold {dim} values")
        if "params" not in state_dict or state_dict["params"].numel() != dim:
            raise ValueError(f"state_dict['params'] must hold {dim} values")
        if state_dict.get("sync_every") != self.sync_every:
            raise ValueError(f"this state_dict was saved with sync_every="
                             f"{state_dict.get('sync_every')!r}, this optimizer has "
                             f"{self.sync_every}; build it with the saved value")
        for key, mine, default in (("fragments", self.fragments, 1),
                                   ("overlap_steps", self.overlap_steps, 0),
                                   ("warmup_steps", self.warmup_steps, 0),
                                   ("warmup_sync_every", self.warmup_sync_every, 1)):
            if state_dict.get(key, default) != mine:
                raise ValueError(f"this state_dict was saved with {key}={state_dict.get(key)!r}, "
                                 f"this optimizer has {mine}; build it with the saved value")
        if self._awaiting_own_state is not None and int(outer["step"]) != self._awaiting_own_state[1]:
            raise ValueError(
                f"this state_dict is of outer step {int(outer['step'])}, but the checkpoint being "
                f"resumed (rank {self._awaiting_own_state[0]}'s state) is of outer step "
                f"{self._awaiting_own_state[1]}: load this rank's state of the same checkpoint")
        if "server_error" in outer and outer["server_error"].numel() != dim:
            raise ValueError(f"state_dict['outer']['server_error'] must hold {dim} values")

        def host(t):
            return t.detach().to("cpu", torch.float32).contiguous().numpy()
        inner_steps = int(state_dict["inner_steps"])
        step = int(outer["step"])
        if step < 0 or not (self._session.inner_steps_before(step) <= inner_steps
                            < self._session.inner_steps_before(step + 1)):
            raise ValueError(f"this state_dict has {inner_steps} inner steps but {step} outer "
                             f"ones, which sync_every={self.sync_every}, "
                             f"fragments={self.fragments} and warmup_steps={self.warmup_steps} "
                             "do not give")
        # The inner optimizer's state first (torch checks it), put back if
        # the session refuses the rest: nothing changes on an error.
        saved_inner = copy.deepcopy(self.inner.state_dict())
        self.inner.load_state_dict(state_dict["inner"])
        saved_x = self._x.clone()
        self._x.copy_(outer["params"].detach().reshape(-1))
        server_error = host(outer["server_error"]) if "server_error" in outer else None
        _warn_resized(self._worker, self._workers, outer.get("workers"), outer["worker_error"],
                      "the outer parameters")
        try:
            self._session.set_state(step, host(outer["momentum"]), torch.zeros(dim).numpy(),
                                    host(outer["worker_error"]), server_error)
        except (MorseError, ValueError):
            self._x.copy_(saved_x)
            self.inner.load_state_dict(saved_inner)
            raise
        self._inner_steps = inner_steps
        self._due = step + 1
        self._awaiting_own_state = None
        self._starts_at = 0
        with torch.no_grad():
            local = state_dict["params"].detach().reshape(-1).to("cpu", torch.float32)
            for p, (lo, hi) in zip(self._params, self._ranges):
                p.copy_(local[lo:hi].view_as(p))
