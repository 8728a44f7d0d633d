"""A DeepSpeed config's optimizer, clipping and learning-rate schedule as
Morse's: morse.torch.from_deepspeed(params, "ds_config.json").

DeepSpeed removed its OneBitAdam, ZeroOneAdam and OneBitLamb in September
2026; a script that trained with them names them in its JSON config and
hands the model to deepspeed.initialize(). Here the same config gives the
Morse optimizer with the same arguments and the same learning rate at every
step:

    opt, scheduler = morse.torch.from_deepspeed(model.parameters(), "ds_config.json")
    ...
    loss.backward()          # was: model_engine.backward(loss)
    opt.step()               # was: model_engine.step(), which also steps
    scheduler.step()         #      the config's scheduler
    opt.zero_grad()

What it reads, and nothing else silently:
- "optimizer": {"type", "params"} for OneBitAdam, ZeroOneAdam, OneBitLamb
  (their params as DeepSpeed's tutorials give them) and Adam / AdamW
  (DeepSpeed's FusedAdam arguments: adam_w_mode, default true, is the
  decoupled weight decay Morse has; torch_adam and set_grad_none choose
  DeepSpeed's implementation and change nothing), with DeepSpeed's
  defaults where the Morse class's differ (OnebitAdam's freeze_step
  100000, FusedAdam's weight_decay 0);
- "gradient_clipping": the optimizer's clip_grad_norm (the global L2 norm of
  the averaged gradient, as DeepSpeed's engine clips before its step; each
  rank's own in a compressing step, as DeepSpeed's 1-bit optimizers did);
- "scheduler": WarmupLR and WarmupDecayLR (log or linear warmup), as
  DeepSpeedWarmup below, stepped after each opt.step() as DeepSpeed's
  engine steps it; other schedulers raise ValueError naming torch's own;
- "gradient_accumulation_steps": the optimizer's accumulation_steps (then
  step() after every k-th backward(), the loss divided by k: DeepSpeed's
  engine did both itself).

"fp16" or "bf16" enabled is the script's autocast (and GradScaler for fp16)
with Morse, and "zero_optimization" at a stage above 0 is --node-aggregation
=sharded within a node: both warn, saying so. The batch sizes, logging and
the rest are the script's. A value "auto" (filled in by Hugging Face's
DeepSpeed integration) raises ValueError: give the number.
"""
import json
import math
import warnings

__all__ = ["from_deepspeed", "DeepSpeedWarmup"]

# DeepSpeed's optimizer types (its names are case-insensitive) and the
# Morse class of each.
_TYPES = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb",
          "adam": "Adam", "adamw": "AdamW"}
# The one default of DeepSpeed's optimizer that the Morse class does not
# share, by class.
_DEEPSPEED_DEFAULTS = {"OneBitAdam": ("freeze_step", 100000), "Adam": ("weight_decay", 0.0),
                       "AdamW": ("weight_decay", 0.0)}
# DeepSpeed's FusedAdam arguments that choose its implementation.
_IMPLEMENTATION = ("torch_adam", "set_grad_none")


def _config(ds_config):
    """The config as a dict: a dict, or the path of a JSON file."""
    if isinstance(ds_config, dict):
        return ds_config
    with open(ds_config) as f:
        loaded = json.load(f)
    if not isinstance(loaded, dict):
        raise ValueError(f"{ds_config}: a DeepSpeed config is a JSON object, got {type(loaded).__name__}")
    return loaded


def _no_auto(section, values):
    for key, value in values.items():
        if value == "auto":
            raise ValueError(f"{section}.{key} is \"auto\", which Hugging Face's DeepSpeed "
                             "integration fills in from TrainingArguments: give the value")


def from_deepspeed(params, ds_config, **overrides):
    """The Morse optimizer a DeepSpeed config names, and its learning-rate
    scheduler (None where the config has none): (optimizer, scheduler).
    `ds_config` is the config's dict or the path of its JSON file;
    `overrides` are the optimizer's own keyword arguments (servers, config,
    overlap, ...), which win over the DeepSpeed config's."""
    import morse.torch
    ds = _config(ds_config)
    section = ds.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError("the DeepSpeed config has no \"optimizer\": {\"type\": ..., \"params\": "
                         f"{{...}}}} section; Morse builds one of {sorted(set(_TYPES.values()))}")
    kind = _TYPES.get(str(section["type"]).lower())
    if kind is None:
        raise ValueError(f"optimizer type {section['type']!r}: Morse has "
                         f"{', '.join(sorted(set(_TYPES.values())))} (DeepSpeed's names for them)")
    kwargs = dict(section.get("params") or {})
    _no_auto("optimizer.params", kwargs)
    # DeepSpeed's defaults where Morse's class has another: OnebitAdam
    # freezes at step 100000 (morse.torch.OneBitAdam at 100), and FusedAdam
    # (its Adam and AdamW) decays by 0 (torch.optim.AdamW's, and so
    # morse.torch.AdamW's, is 0.01).
    if kind in _DEEPSPEED_DEFAULTS:
        kwargs.setdefault(*_DEEPSPEED_DEFAULTS[kind])
    if kind in ("Adam", "AdamW"):
        # FusedAdam's adam_w_mode (in params, or beside them as some configs
        # put it): True, its default, is AdamW's decoupled weight decay.
        adam_w_mode = kwargs.pop("adam_w_mode", section.get("adam_w_mode", True))
        for key in _IMPLEMENTATION:
            kwargs.pop(key, None)
        if kind == "Adam":
            kwargs["decoupled_weight_decay"] = bool(adam_w_mode)
    _no_auto("config", {key: ds.get(key)
                        for key in ("gradient_clipping", "gradient_accumulation_steps")})
    clip = float(ds.get("gradient_clipping") or 0.0)
    if clip > 0:
        kwargs["clip_grad_norm"] = clip
    accumulation = int(ds.get("gradient_accumulation_steps") or 1)
    if accumulation > 1:
        kwargs["accumulation_steps"] = accumulation
    scheduler_section = ds.get("scheduler")
    if scheduler_section is not None:
        # DeepSpeed sets the optimizer's lr from the schedule when it builds
        # it, and so does DeepSpeedWarmup: the steps follow param_groups'
        # lr (often 0 at first, which a job's base lr may not be).
        schedule = _schedule(scheduler_section)
        kwargs["lr"] = schedule.max_lr
    for precision in ("fp16", "bf16"):
        if (ds.get(precision) or {}).get("enabled") in (True, "auto"):
            warnings.warn(
                f"morse: the DeepSpeed config enables {precision}: with Morse the parameters stay "
                f"float32 and the script runs its forward under torch.autocast(dtype=torch."
                f"{'float16' if precision == 'fp16' else 'bfloat16'})"
                f"{' with a torch.amp.GradScaler' if precision == 'fp16' else ''} (docs/python.md)",
                RuntimeWarning, stacklevel=2)
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, None):
        warnings.warn(
            f"morse: the DeepSpeed config asks for ZeRO stage {stage}: every Morse worker holds "
            "the whole optimizer state, or, launched with morse-run --node-aggregation=sharded, "
            "each rank of a node the state of its slice of the parameters", RuntimeWarning,
            stacklevel=2)
    kwargs.update(overrides)
    optimizer = getattr(morse.torch, kind)(params, **kwargs)
    scheduler = None
    if scheduler_section is not None:
        scheduler = DeepSpeedWarmup(optimizer, schedule)
    return optimizer, scheduler


class _Schedule:
    """DeepSpeed's WarmupLR / WarmupDecayLR as a function of the scheduler's
    step count: lr(0) before its first step() (its min lr), lr(k) after k."""

    def __init__(self, min_lr, max_lr, warmup_steps, warmup_type, total_steps):
        self.min_lr, self.max_lr = float(min_lr), float(max_lr)
        if not 0 <= self.min_lr <= self.max_lr or self.max_lr <= 0:
            raise ValueError(f"scheduler warmup_min_lr {min_lr!r} and warmup_max_lr {max_lr!r}: "
                             "0 <= warmup_min_lr <= warmup_max_lr, warmup_max_lr above 0")
        self.warmup_steps = max(2, int(warmup_steps))  # as DeepSpeed's
        self.warmup_type = warmup_type
        self.total_steps = total_steps

    def lr(self, steps):
        iteration = steps - 1  # DeepSpeed's last_batch_iteration
        if iteration < 0:
            return self.min_lr
        if iteration < self.warmup_steps:
            if self.warmup_type == "log":
                gamma = math.log(iteration + 1) / math.log(self.warmup_steps)
            else:
                gamma = iteration / self.warmup_steps
        elif self.total_steps is None:
            gamma = 1.0
        else:
            gamma = max(0.0, (self.total_steps - iteration)
                        / max(1.0, self.total_steps - self.warmup_steps))
        return self.min_lr + (self.max_lr - self.min_lr) * gamma


def _schedule(section):
    kind = section.get("type")
    if kind not in ("WarmupLR", "WarmupDecayLR"):
        raise ValueError(f"scheduler type {kind!r}: from_deepspeed builds WarmupLR and "
                         "WarmupDecayLR; for another, drop the config's \"scheduler\" and step one "
                         "of torch.optim.lr_scheduler's (OneCycleLR, CosineAnnealingLR, LambdaLR) "
                         "over the optimizer, which follows param_groups' lr at every step")
    p = dict(section.get("params") or {})
    _no_auto("scheduler.params", p)
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
             "total_num_steps", "last_batch_iteration"}
    unknown = sorted(set(p) - known)
    if unknown:
        raise ValueError(f"scheduler {kind} has no parameter {', '.join(unknown)} (it takes "
                         f"{', '.join(sorted(known))})")
    if p.get("last_batch_iteration", -1) != -1:
        raise ValueError("scheduler.params.last_batch_iteration: a resumed schedule is the "
                         "scheduler's state_dict(), loaded with load_state_dict()")
    for key in ("warmup_min_lr", "warmup_max_lr"):
        if isinstance(p.get(key), (list, tuple)):
            raise ValueError(f"scheduler.params.{key} is a list (one per parameter group): "
                             "from_deepspeed takes one value for every group")
    warmup_type = p.get("warmup_type", "log")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type {warmup_type!r}: log or linear")
    total = None
    if kind == "WarmupDecayLR":
        if "total_num_steps" not in p:
            raise ValueError("scheduler WarmupDecayLR needs params.total_num_steps")
        total = int(p["total_num_steps"])
    elif "total_num_steps" in p:
        raise ValueError("scheduler WarmupLR has no total_num_steps (WarmupDecayLR has)")
    return _Schedule(p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", 0.001),
                     p.get("warmup_num_steps", 1000), warmup_type, total)


class DeepSpeedWarmup:
    """DeepSpeed's WarmupLR or WarmupDecayLR over a Morse optimizer: every
    parameter group's lr, set at each step() (after opt.step(), as
    DeepSpeed's engine steps its scheduler) to min + (max - min) * gamma,
    gamma rising over warmup_num_steps (log: ln(k+1)/ln(W); linear: k/W)
    and then 1 (WarmupLR) or falling linearly to 0 at total_num_steps
    (WarmupDecayLR). state_dict() / load_state_dict() as torch's
    schedulers, for checkpoints."""

    def __init__(self, optimizer, schedule):
        self.optimizer = optimizer
        self._schedule = schedule
        self.steps = 0
        self._apply()

    def _apply(self):
        lr = self._schedule.lr(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr] * len(self.optimizer.param_groups)

    def step(self):
        self.steps += 1
        self._apply()

    def get_last_lr(self):
        return list(self._last_lr)

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = int(state["steps"])
        self._apply()
