"""morse.torch.pipeline: pipeline-parallel training over gRPC, with
compressed activations and gradients between the stages.

The user splits a model into K stages, one nn.Module each; each stage runs
in its own process (`morse-run --stages K --workers R -- python3 train.py`
starts K x R of them, R data-parallel replicas per stage, each stage with
its own Morse shards). Every process runs the same script:

    from morse.torch import pipeline
    stage = pipeline.Stage(parts[stage_index()], forward="int8", backward="fp32")
    schedule = pipeline.GPipe(stage, microbatches=4, loss_fn=F.cross_entropy)
    optimizer = morse.torch.OneBitAdam(stage.module.parameters(), lr=1e-3,
                                       accumulation_steps=4)  # a backward per micro-batch
    for x, y in loader:
        optimizer.zero_grad()
        loss = schedule.step(x, target=y)   # stages > 0 may pass nothing
        optimizer.step()
    schedule.close()

Micro-batches flow forward from stage 0 (which loads the data) to the last
stage (which computes the loss); their gradients flow back. The targets ride
with the activations, unchanged. Each boundary is one long-lived gRPC stream
(TLS and tokens as for the shards; worker/stage_link.h). Each direction of
each boundary has a spec (compress/boundary.h): a codec (fp32, fp16, bf16,
int8, int4 with an optional /BLOCK, topk:RATIO) and a feedback (none, +ef,
or +aq: AQ-SGD, activations only, which needs the samples' dataset indices:
step(x, target=y, samples=idx)). GPipe runs every micro-batch's forward,
then every backward; OneFOneB interleaves them (less activation memory);
both run the backwards in micro-batch order, so they give the same bits.

A stage that fails sends its error to its neighbours, which fail with it
("ABORTED: stage 1 failed: ..."); a stage whose process dies makes its
neighbours fail with UNAVAILABLE within seconds; a silent one, with
DEADLINE_EXCEEDED after `timeout`. Nothing hangs.
"""
import json
import os

import numpy as np
import torch

from .. import _native
from .._native import MorseError

__all__ = ["Stage", "GPipe", "OneFOneB", "split_microbatches", "stage_index", "stage_count"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def stage_index():
    """This process's stage (MORSE_STAGE, set by morse-run --stages)."""
    return int(_need_env("MORSE_STAGE"))


def stage_count():
    return int(_need_env("MORSE_STAGES"))


def _need_env(name):
    if name not in os.environ:
        raise MorseError(f"FAILED_PRECONDITION: {name} is not set; run the script under "
                         f"morse-run --stages K, or pass stage=, stages=, listen= and next= to Stage")
    return os.environ[name]


def split_microbatches(tensor, microbatches):
    """The micro-batches a schedule cuts a batch into (torch.tensor_split
    along dimension 0): what a single-process reference must use to get the
    same bits."""
    if tensor is None:
        return [None] * microbatches
    if tensor.shape[0] < microbatches:
        raise ValueError(f"a batch of {tensor.shape[0]} rows cannot make {microbatches} micro-batches")
    return list(torch.tensor_split(tensor, microbatches))


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _dtype(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise MorseError(f"INVALID_ARGUMENT: unknown dtype '{name}' from the previous stage")
    return dtype


def _raw(tensor):
    """A tensor's bytes, any dtype."""
    t = tensor.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _from_raw(data, dtype, shape):
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _per_boundary(spec, boundaries, what):
    specs = [spec] * boundaries if isinstance(spec, str) else list(spec)
    if len(specs) != boundaries:
        raise ValueError(f"{what}: {len(specs)} specs for {boundaries} boundaries")
    return specs


class Stage:
    """One stage of a pipeline: `module` runs here; the previous stage
    connects to `listen` (host:port; default MORSE_STAGE_LISTEN), this one
    connects to the next stage at `next_stage` (default MORSE_STAGE_NEXT).

    forward / backward: the boundary specs of the activations and of their
    gradients, one string for every boundary or a list of K - 1 (boundary
    b is between stages b and b + 1). Every stage must be given the same
    specs, and the two ends of a boundary check that they were. security:
    a dict as for the optimizers (tls_ca, tls_cert, tls_key, token_file,
    insecure), else MORSE_* from the environment. timeout: seconds to wait
    for a neighbour's next frame (and to connect). job: a name both ends
    check (default MORSE_JOB, else "pipeline")."""

    def __init__(self, module, stage=None, stages=None, *, forward="fp32", backward="fp32",
                 listen=None, next_stage=None, security=None, timeout=300.0, job=None, device=None):
        from . import _security
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, not {type(module).__name__}")
        self.module = module
        self.index = stage_index() if stage is None else int(stage)
        self.stages = stage_count() if stages is None else int(stages)
        if self.stages < 1 or not 0 <= self.index < self.stages:
            raise ValueError(f"stage {self.index} of {self.stages}: need 0 <= stage < stages")
        self.timeout = float(timeout)
        if self.timeout <= 0:
            raise ValueError("timeout must be positive")
        self.job = job or os.environ.get("MORSE_JOB", "pipeline")
        self.forward_specs = _per_boundary(forward, self.stages - 1, "forward")
        self.backward_specs = _per_boundary(backward, self.stages - 1, "backward")
        for b, spec in enumerate(self.backward_specs):
            if spec.endswith("+aq"):
                raise ValueError(f"backward spec '{spec}' of boundary {b}: AQ-SGD is for activations "
                                 f"(per-sample buffers); gradients take none or +ef")
        for spec in self.forward_specs + self.backward_specs:
            try:
                _native.Boundary(spec)
            except MorseError as e:
                raise ValueError(str(e)) from None
        if device is None:
            param = next(iter(module.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.step_count = 0
        self.last_bytes = {"forward": 0, "backward": 0}
        self._security = _security(security)
        self._prev = self._next = None
        self._failed = False
        # Codecs: what this stage sends and receives on each side.
        self._send_forward = self._recv_backward = self._recv_forward = self._send_backward = None
        if self.index < self.stages - 1:
            self._send_forward = _native.Boundary(self.forward_specs[self.index])
            self._recv_backward = _native.Boundary(self.backward_specs[self.index])
        if self.index > 0:
            self._recv_forward = _native.Boundary(self.forward_specs[self.index - 1])
            self._send_backward = _native.Boundary(self.backward_specs[self.index - 1])
        try:
            self._open(listen, next_stage)
        except BaseException:
            self._close_links()
            raise

    # ------------------------------------------------------------ set-up

    def _hello(self):
        return json.dumps({"job": self.job, "stage": self.index, "stages": self.stages,
                           "forward": self.forward_specs, "backward": self.backward_specs})

    def _open(self, listen, next_address):
        if self.index > 0:
            listen = listen or _need_env("MORSE_STAGE_LISTEN")
            self._prev = _native.Link.listen(listen, self._security)
        if self.index < self.stages - 1:
            next_address = next_address or _need_env("MORSE_STAGE_NEXT")
            self._next = _native.Link.connect(next_address, self._security, self.timeout)
            self._next.send(_native.Link.HELLO, self._hello())
        if self._prev is not None:
            self._prev.accept(self.timeout)
            kind, meta, _, _, error = self._prev.receive(self.timeout)
            problem = self._check_hello(kind, meta, error, self.index - 1)
            if problem:
                self._prev.send(_native.Link.ERROR, error=problem)
                raise MorseError(problem)
            self._prev.send(_native.Link.HELLO, self._hello())
        if self._next is not None:
            kind, meta, _, _, error = self._next.receive(self.timeout)
            if kind == _native.Link.ERROR:
                raise MorseError(f"FAILED_PRECONDITION: stage {self.index + 1} refused this stage: {error}")
            problem = self._check_hello(kind, meta, error, self.index + 1)
            if problem:
                raise MorseError(problem)

    def _check_hello(self, kind, meta, error, want_stage):
        if kind == _native.Link.ERROR:
            return f"FAILED_PRECONDITION: stage {want_stage} failed: {error}"
        if kind != _native.Link.HELLO:
            return f"FAILED_PRECONDITION: expected stage {want_stage}'s hello, got a frame of kind {kind}"
        peer = json.loads(meta)
        mine = json.loads(self._hello())
        for key in ("job", "stages", "forward", "backward"):
            if peer.get(key) != mine[key]:
                return (f"FAILED_PRECONDITION: stage {peer.get('stage')} has {key} {peer.get(key)!r} where "
                        f"stage {self.index} has {mine[key]!r}; every stage must be started with the same")
        if peer.get("stage") != want_stage:
            return (f"FAILED_PRECONDITION: stage {self.index} expected stage {want_stage} as its neighbour, "
                    f"got stage {peer.get('stage')}")
        return None

    @property
    def is_first(self):
        return self.index == 0

    @property
    def is_last(self):
        return self.index == self.stages - 1

    # ------------------------------------------------------------ frames

    def _receive(self, link, want_kind, step, micro, side):
        try:
            kind, meta, payload, extra, error = link.receive(self.timeout)
        except MorseError as e:
            raise MorseError(f"{e.code}: stage {self.index}: {str(e).split(': ', 1)[-1]}") from None
        neighbour = self.index - 1 if side == "prev" else self.index + 1
        if kind == _native.Link.ERROR:
            raise MorseError(f"ABORTED: stage {neighbour} failed: {error}")
        if kind == _native.Link.END:
            return None
        if kind != want_kind:
            raise MorseError(f"INTERNAL: stage {self.index} expected a frame of kind {want_kind} from "
                             f"stage {neighbour}, got kind {kind}")
        meta = json.loads(meta)
        if meta.get("step") != step or (micro is not None and meta.get("micro") != micro):
            raise MorseError(
                f"FAILED_PRECONDITION: stage {self.index} is at step {step} micro-batch {micro} and stage "
                f"{neighbour} sent step {meta.get('step')} micro-batch {meta.get('micro')}; every stage must "
                f"run the same loop, and a restart must restore every stage from the same step's checkpoint")
        return meta, payload, extra

    def _encode(self, codec, tensor, samples, slot, mode):
        flat = tensor.detach().to(torch.float32).cpu().contiguous()
        rows = flat.shape[0] if flat.dim() > 0 else 1
        return codec.encode(flat.numpy().reshape(-1), rows, samples, slot, mode)

    def _decode(self, codec, payload, meta, mode, requires_grad):
        shape = meta["shape"]
        out = np.empty(int(np.prod(shape)) if shape else 1, dtype=np.float32)
        rows = shape[0] if shape else 1
        codec.decode(payload, out, rows, meta.get("samples"), mode)
        t = torch.from_numpy(out).reshape(shape).to(device=self.device, dtype=_dtype(meta["dtype"]))
        if requires_grad:
            t.requires_grad_(True)
        return t

    def _abort(self, error):
        """Tells both neighbours why this stage stopped (best effort)."""
        if self._failed:
            return
        self._failed = True
        message = f"{type(error).__name__}: {error}" if not isinstance(error, MorseError) else str(error)
        for link in (self._prev, self._next):
            if link is None:
                continue
            try:
                link.send(_native.Link.ERROR, error=message)
            except MorseError:
                pass

    def traffic(self):
        """Bytes sent and received on each side since the start:
        {"next": (sent, received), "prev": (sent, received)}."""
        out = {}
        if self._next is not None:
            out["next"] = self._next.traffic()
        if self._prev is not None:
            out["prev"] = self._prev.traffic()
        return out

    # ------------------------------------------------------------ state

    def state_dict(self):
        """The boundaries' feedback state (ef's error buffers, AQ-SGD's
        per-sample buffers) and the step: save it with the stage's module and
        optimizer, and restore every stage from the same step."""
        boundaries = {}
        for name in ("_send_forward", "_recv_forward", "_send_backward", "_recv_backward"):
            codec = getattr(self, name)
            if codec is not None:
                boundaries[name.lstrip("_")] = {"spec": codec.spec, "state": codec.state()}
        return {"stage": self.index, "stages": self.stages, "step": self.step_count, "boundaries": boundaries}

    def load_state_dict(self, state):
        if state.get("stage") != self.index or state.get("stages") != self.stages:
            raise ValueError(f"a state of stage {state.get('stage')} of {state.get('stages')} cannot be "
                             f"loaded into stage {self.index} of {self.stages}")
        mine = self.state_dict()["boundaries"]
        if set(state["boundaries"]) != set(mine):
            raise ValueError(f"the state has boundaries {sorted(state['boundaries'])}, this stage "
                             f"{sorted(mine)}")
        for name, saved in state["boundaries"].items():
            if saved["spec"] != mine[name]["spec"]:
                raise ValueError(f"{name} was saved with spec '{saved['spec']}', this stage has "
                                 f"'{mine[name]['spec']}'")
        for name, saved in state["boundaries"].items():
            getattr(self, "_" + name).load(saved["state"])
        self.step_count = int(state["step"])

    def samples_seen(self):
        """AQ-SGD: how many samples the incoming activations' buffers hold."""
        return self._recv_forward.samples_seen() if self._recv_forward is not None else 0

    # ------------------------------------------------------------ end

    def _close_links(self):
        for link in (self._prev, self._next):
            if link is not None:
                link.close()
        self._prev = self._next = None

    def close(self):
        """Tells the next stage the run is over (its step() returns None)
        and closes both boundaries."""
        if self._next is not None and not self._failed:
            try:
                self._next.send(_native.Link.END, json.dumps({"step": self.step_count}))
            except MorseError:
                pass
        self._close_links()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Schedule:
    """Runs one training step of a Stage over micro-batches."""

    def __init__(self, stage, microbatches, loss_fn=None):
        if not isinstance(stage, Stage):
            raise TypeError("stage must be a morse.torch.pipeline.Stage")
        if int(microbatches) < 1:
            raise ValueError("microbatches must be at least 1")
        if stage.is_last and loss_fn is None:
            raise ValueError("the last stage needs loss_fn(output, target)")
        self.stage = stage
        self.microbatches = int(microbatches)
        self.loss_fn = loss_fn
        self._aq = any(spec.endswith("+aq") for spec in stage.forward_specs)

    def close(self):
        self.stage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self, x=None, target=None, samples=None):
        """One training step: forward and backward of every micro-batch;
        the gradients accumulate into the stage's parameters (mean over the
        batch: each micro-batch's loss is divided by their number). Stage 0
        passes the batch x (and target, and with AQ-SGD samples: each row's
        index in the dataset); the last stage may pass target instead; the
        others pass nothing. Returns the batch's mean loss on every stage, or
        None on a stage > 0 once the previous stage has closed (the run is
        over)."""
        try:
            return self._train_step(x, target, samples)
        except BaseException as e:
            self.stage._abort(e)
            raise

    def evaluate(self, x=None, target=None, compress=True, metric_fn=None):
        """Inference on a batch, no gradients: compress=True sends the
        boundaries' codecs without feedback state (C(x)); False sends fp32.
        The last stage computes loss_fn and metric_fn(output, target), the
        latter a sum over the micro-batch's rows (e.g. correct
        predictions). Returns {"loss": mean loss, "metric": metric per row}
        on every stage, or None on a stage > 0 once the run is over."""
        try:
            with torch.no_grad():
                return self._eval_step(x, target, compress, metric_fn)
        except BaseException as e:
            self.stage._abort(e)
            raise

    # ---------------------------------------------------------------- pieces

    def _inputs(self, x, target, samples, training=True):
        st, m = self.stage, self.microbatches
        if st.is_first:
            if x is None:
                raise ValueError("stage 0 needs the batch: step(x, target=...)")
            if training and self._aq and samples is None:
                raise ValueError("AQ-SGD boundaries need each row's dataset index: step(x, target=y, samples=idx)")
            if samples is not None and len(samples) != x.shape[0]:
                raise ValueError(f"{len(samples)} sample indices for a batch of {x.shape[0]}")
            xs = split_microbatches(x, m)
            ss = split_microbatches(torch.as_tensor(samples), m) if samples is not None else [None] * m
        else:
            xs, ss = [None] * m, [None] * m
        ts = split_microbatches(target, m) if target is not None else [None] * m
        return xs, ts, ss

    def _forward(self, i, x_i, t_i, s_i, mode, step):
        """Returns (input, output, target, samples) of micro-batch i, or
        None when the previous stage ended the run before micro-batch 0
        (an end in the middle of a step is an error)."""
        st = self.stage
        train = mode == 0
        if st.is_first:
            inp = x_i.to(st.device)
            samples = s_i.tolist() if s_i is not None else None
            target, target_meta, extra = t_i, None, b""
        else:
            got = st._receive(st._prev, _native.Link.FORWARD, step, i, "prev")
            if got is None:
                if i == 0:
                    return None
                self._need(None, st.index - 1)
            meta, payload, extra = got
            if meta.get("train") != train:
                raise MorseError(f"FAILED_PRECONDITION: stage {st.index} runs {'step' if train else 'evaluate'} "
                                 f"and stage {st.index - 1} the other; every stage must run the same loop")
            inp = st._decode(st._recv_forward, payload, meta, mode, requires_grad=train)
            samples = meta.get("samples")
            target_meta = meta.get("target")
            target = t_i
            if target is None and target_meta is not None:
                target = _from_raw(extra, _dtype(target_meta["dtype"]), target_meta["shape"])
        out = st.module(inp)
        if st.is_last:
            return inp, out, target, samples
        if not isinstance(out, torch.Tensor) or out.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"stage {st.index}'s module must return one floating-point tensor to pass on, "
                            f"not {type(out).__name__}")
        if target is not None and target_meta is None:
            target_meta = {"dtype": _dtype_name(target.dtype), "shape": list(target.shape)}
            extra = _raw(target)
        meta = {"step": step, "micro": i, "train": train, "shape": list(out.shape),
                "dtype": _dtype_name(out.dtype), "samples": samples, "target": target_meta}
        payload = st._encode(st._send_forward, out, samples, i, mode)
        st._next.send(_native.Link.FORWARD, json.dumps(meta), payload, extra)
        return inp, out, target, samples

    def _backward(self, i, saved, step, losses):
        st = self.stage
        inp, out, target, _ = saved
        if st.is_last:
            if target is None:
                raise ValueError("the last stage has no target: pass target= to step() on stage 0 or here")
            loss = self.loss_fn(out, target.to(out.device) if isinstance(target, torch.Tensor) else target)
            (loss / self.microbatches).backward()
            value = float(loss.detach())
        else:
            meta, payload, _ = self._need(st._receive(st._next, _native.Link.BACKWARD, step, i, "next"))
            grad = st._decode(st._recv_backward, payload, meta, 0, requires_grad=False)
            out.backward(grad.to(out.dtype))
            value = meta["loss"]
        losses.append(value)
        if not st.is_first:
            if inp.grad is None:
                raise MorseError(f"INTERNAL: stage {st.index}'s input got no gradient; its module must use its input")
            payload = st._encode(st._send_backward, inp.grad, None, i, 0)
            meta = {"step": step, "micro": i, "shape": list(inp.grad.shape),
                    "dtype": _dtype_name(inp.grad.dtype), "loss": value}
            st._prev.send(_native.Link.BACKWARD, json.dumps(meta), payload)

    def _need(self, got, neighbour=None):
        if got is None:
            neighbour = self.stage.index + 1 if neighbour is None else neighbour
            raise MorseError(f"FAILED_PRECONDITION: stage {neighbour} ended the run in the middle "
                             f"of step {self.stage.step_count}")
        return got

    def _bytes(self):
        st = self.stage
        return (st._next.traffic()[0] if st._next is not None else 0,
                st._prev.traffic()[0] if st._prev is not None else 0)

    def _train_step(self, x, target, samples):
        st = self.stage
        xs, ts, ss = self._inputs(x, target, samples)
        step = st.step_count
        before = self._bytes()
        losses = []
        ended = self._run(xs, ts, ss, step, losses)
        if ended:
            return None
        after = self._bytes()
        st.last_bytes = {"forward": after[0] - before[0], "backward": after[1] - before[1]}
        st.step_count += 1
        return sum(losses) / len(losses)

    def _eval_step(self, x, target, compress, metric_fn):
        st = self.stage
        xs, ts, ss = self._inputs(x, target, None, training=False)
        mode = 1 if compress else 2
        step = st.step_count
        loss_sum, metric_sum, rows = 0.0, 0.0, 0
        for i in range(self.microbatches):
            saved = self._forward(i, xs[i], ts[i], None, mode, step)
            if saved is None:
                return None
            if st.is_last:
                inp, out, target_i, _ = saved
                if target_i is None:
                    raise ValueError("the last stage has no target to evaluate against")
                n = out.shape[0]
                loss = float(self.loss_fn(out, target_i.to(out.device)))
                metric = float(metric_fn(out, target_i.to(out.device))) if metric_fn is not None else 0.0
                result = {"step": step, "micro": i, "loss": loss, "metric": metric, "rows": n}
            else:
                meta, _, _ = self._need(st._receive(st._next, _native.Link.BACKWARD, step, i, "next"))
                result = meta
            loss_sum += result["loss"] * result["rows"]
            metric_sum += result["metric"]
            rows += result["rows"]
            if not st.is_first:
                st._prev.send(_native.Link.BACKWARD, json.dumps(result))
        return {"loss": loss_sum / rows, "metric": metric_sum / rows}


class GPipe(_Schedule):
    """Every micro-batch's forward, then every backward (in micro-batch
    order). Keeps all micro-batches' activations until the backward."""

    def _run(self, xs, ts, ss, step, losses):
        saved = []
        for i in range(self.microbatches):
            s = self._forward(i, xs[i], ts[i], ss[i], 0, step)
            if s is None:
                return True
            saved.append(s)
        for i in range(self.microbatches):
            self._backward(i, saved[i], step, losses)
            saved[i] = None
        return False


class OneFOneB(_Schedule):
    """1F1B: stage s runs K - s - 1 forwards ahead, then alternates one
    forward and one backward, then drains the backwards; at most K - s
    micro-batches' activations are alive at once. The backwards run in
    micro-batch order, so the gradients are GPipe's, bit for bit."""

    def _run(self, xs, ts, ss, step, losses):
        st, m = self.stage, self.microbatches
        warmup = min(st.stages - st.index - 1, m)
        saved = {}
        done_forward = done_backward = 0
        while done_backward < m:
            ahead = done_forward - done_backward
            if done_forward < m and (ahead <= warmup):
                s = self._forward(done_forward, xs[done_forward], ts[done_forward], ss[done_forward], 0, step)
                if s is None:
                    return True
                saved[done_forward] = s
                done_forward += 1
                if ahead < warmup:
                    continue
            self._backward(done_backward, saved.pop(done_backward), step, losses)
            done_backward += 1
        return False
