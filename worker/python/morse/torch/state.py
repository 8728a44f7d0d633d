"""Saving and restoring a morse.torch optimizer's run: state_dict() and
load_state_dict() (the _StateDict methods of every Morse optimizer but
DiLoCo, which keeps its own), the way in from torch.optim's state, saved
parameter by parameter (_from_per_parameter), and the way back to it
(torch_optim_state_dict).

Morse's state is one flat array per name over the model (exp_avg,
exp_avg_sq, this rank's worker error buffer, on rank 0 the shards' error
buffers, an optimizer's own arrays), with where each parameter lies in
them; a run resumed from every rank's own state goes on bit for bit."""
import itertools
import os
import warnings

import torch

# state_dict's keys of the optimizers' own arrays (Morse's names, design.md
# 5's optimizer seam): torch's spelling where torch has one.
_STATE_DICT_KEYS = {"v_fresh": "exp_avg_sq_fresh"}
# The key of the last step's commit, for the optimizers that commit.
_COMMIT_KEYS = {"onebit_lamb": "lamb_commit"}


def _as_list(value):
    """betas (a tuple) or eps (a number) as a list of floats, for comparing
    (torch 2 allows tensors)."""
    return [float(v) for v in value] if isinstance(value, (tuple, list)) else [float(value)]


# A state saved inside a ZeroOneAdam local interval: its interval arrays
# (the session's names: anchor, u, lr_sum) under these keys, and the rank's
# own parameters (each rank moves on its own there; the model's checkpoint
# is rank 0's), its last local step and, on rank 0, the shards' m at the
# interval's last sync.
_INTERVAL_PREFIX = "interval_"
_INTERVAL_X, _INTERVAL_LAST, _INTERVAL_SHARDS_M = ("interval_x", "interval_last_local_step",
                                                   "interval_shards_exp_avg")
_INTERVAL_OTHERS = "interval_others"  # a sharded node's other slices' parameters


def _flat_of(params, device):
    """`params`' values, one after another, in a new flat tensor."""
    if not params:
        return torch.zeros(0, device=device)
    return torch.cat([p.detach().reshape(-1) for p in params]).to(device)


def _inside_interval_words(inside, period):
    """What a state saved inside a ZeroOneAdam local interval without its
    interval's arrays (by a version before 2026-12-07) is, in words:
    `inside` its [step, step after the last sync]; `period` the longest
    interval (local_step_clipper), or None."""
    step, synced = inside
    where = (f", as Trainer's save_steps a multiple of {period}, local_step_clipper" if period
             else "")
    return (f"this state is of step {step}, inside one of ZeroOneAdam's local intervals (its last "
            f"sync completed step {synced}), and does not hold that interval's state (saved by a "
            f"version before 2026-12-07), so it cannot be resumed. A state saved right after a "
            f"sync (at a step count that is a multiple of the interval{where}) can be")


class _StateDict:
    """state_dict() and load_state_dict() of _MorseOptimizer, over its
    session, flat buffer and parameter groups."""

    def state_dict(self):
        """The run's state: step, m (exp_avg), v (exp_avg_sq) and this rank's
        worker error buffer (OneBitLamb: also v' as exp_avg_sq_fresh, the
        layers' coefficient state as lamb_layers and the last step's commit
        as lamb_commit); on rank 0 also the shards' error buffers
        (server_error), so that rank 0's state_dict and each rank's own
        restore the whole run with load_state_dict in a fresh job (exactly:
        the continued run is bit-identical to an uninterrupted one). A
        node's rank other than its leader (node aggregation) holds no
        optimizer state: its state_dict has the step alone (and in
        ZeroOneAdam's local phase its parameters, below).

        Inside one of ZeroOneAdam's local intervals each rank has moved on
        its own since the interval's last sync, which the shards hold: each
        rank's state_dict() then also holds its own parameters (which
        load_state_dict() writes back over the model's: a checkpoint's
        model is rank 0's) and the interval's arrays, and rank 0's the
        shards' m and error buffers at that sync (under --node-aggregation
        the leader's, each other rank's its parameters; =sharded each
        slice's owner its slice's interval and every slice's parameters as
        it holds them)."""
        self._check_not_awaiting("state_dict()")
        return self._state_dict(server_error=True)

    def _interval_period(self):
        """ZeroOneAdam's local_step_clipper where every interval divides it
        (a power of two: a step count that is a multiple of it ends a sync),
        else None."""
        clipper = int((getattr(self, "_zero_one", None) or {}).get("local_step_clipper", 0))
        return clipper if clipper > 0 and clipper & (clipper - 1) == 0 else None

    def _saved_groups(self):
        """param_groups as torch saves them: each group's settings and its
        trained parameters' indices, counted across the groups."""
        groups, index = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            count = sum(1 for p in group["params"] if p.requires_grad)
            saved["params"] = list(range(index, index + count))
            index += count
            groups.append(saved)
        return groups

    def _load_groups(self, state_dict):
        """lr and weight_decay of the saved groups back into param_groups
        (one saved group sets every group), and betas and eps where the
        steps follow param_groups' (schedule "constant"), as torch's
        load_state_dict does; with schedule "cosine" load_state_dict has
        refused saved ones that differ."""
        saved = state_dict.get("param_groups", [{}])
        keys = ("lr", "weight_decay") + (("betas", "eps") if self._follows_moments else ())
        for i, group in enumerate(self.param_groups):
            source = saved[i] if len(saved) == len(self.param_groups) else saved[0]
            for key in keys:
                if key in source:
                    group[key] = tuple(source[key]) if key == "betas" else source[key]

    def _state_dict(self, server_error, on_host=False):
        """state_dict()'s, its per-element arrays on the parameters' device
        (on_host: on the CPU)."""
        groups = self._saved_groups()
        device = torch.device("cpu") if on_host else self._flat.device
        if self._session is None:
            state = {"step": self.step_index, "rank": self._rank, "node_member": True}
            if self._zero_one and self.step_index > int(self._zero_one["var_freeze_step"]):
                # ZeroOneAdam's local phase: the node may be inside a local
                # interval, on parameters of its own, which its leader's
                # state holds too; this rank, resumed, takes its copy (the
                # checkpoint's model is rank 0's).
                state[_INTERVAL_X] = self._flat.detach().to(device, copy=True)
            return {"state": state, "param_groups": groups}
        step, m, v, error = self._session.get_state()
        state = {"step": step, "rank": self._rank, "workers": self._workers,
                 "taken": f"{self._nonce}:{self.step_index}",
                 "exp_avg": torch.from_numpy(m).to(device),
                 "exp_avg_sq": torch.from_numpy(v).to(device),
                 "worker_error": torch.from_numpy(error).to(device)}
        state.update(self._own_state(device))
        # Where each trained parameter lies in the arrays above (its index
        # as torch.optim numbers the groups' parameters, frozen ones
        # included; its range and shape), and each group's indices, for
        # torch_optim_state_dict.
        listed = [g["params"] for g in self.param_groups]  # (lists: torch makes them so)
        starts = list(itertools.accumulate([0] + [len(g) for g in listed]))
        index = {id(p): starts[g] + i for g, params in enumerate(listed)
                 for i, p in enumerate(params)}
        state["parameters"] = [[index[id(p)], lo, hi, list(p.shape)]
                               for p, (lo, hi) in zip(self._params, self._ranges)]
        state["torch_groups"] = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
        if self._slices is not None:
            state["node_slice"] = [self._node.local_rank, len(self._slices)]
        synced = self._session.exchanged_step
        if synced != step:
            state["inside_interval"] = [step, synced]  # ZeroOneAdam's: state_dict()
            state.update(self._interval_state(server_error and self._worker == 0, device))
        elif self._worker == 0 and server_error:
            state["server_error"] = torch.from_numpy(self._session.server_error()).to(device)
        if any(self._first_steps):
            state["first_steps"] = list(self._first_steps)  # groups added mid-run
        return {"state": state, "param_groups": groups}

    def _interval_state(self, with_shards, device):
        """Inside a ZeroOneAdam local interval: this rank's parameters, the
        interval's arrays and last local step, and with_shards the shards'
        m and error buffers at its last sync, by state_dict() key."""
        arrays, last, shards_m, server_error = self._session.get_interval(with_shards)
        state = {_INTERVAL_X: self._flat.detach().to(device, copy=True),
                 _INTERVAL_LAST: last}
        for name, _, per_element in self._session.interval_arrays():
            value = torch.from_numpy(arrays[name])
            state[_INTERVAL_PREFIX + name] = value.to(device) if per_element else value
        if with_shards:
            state[_INTERVAL_SHARDS_M] = torch.from_numpy(shards_m).to(device)
            state["server_error"] = torch.from_numpy(server_error).to(device)
        if self._slices is not None:  # a sharded node's other slices, as this rank holds them
            state[_INTERVAL_OTHERS] = _flat_of(self._others, device)
        return state

    def _own_state(self, device):
        """The optimizer's own state (1-bit LAMB: v', each layer's
        coefficient state and the last step's commit, design.md 2.8), by
        state_dict() key: per-element arrays on `device`, the others on the
        CPU; {} for an optimizer without any."""
        own = self._session.state_arrays()
        if not own:
            return {}
        arrays, commit = self._session.get_own_state()
        state = {}
        for name, _, per_element in own:
            value = torch.from_numpy(arrays[name])
            state[_STATE_DICT_KEYS.get(name, name)] = value.to(device) if per_element else value
        state[self._commit_key] = torch.from_numpy(commit)
        return state

    def _is_current(self, state):
        """Whether `state` is what state_dict() gives now, bit for bit."""
        if state.get("taken") != f"{self._nonce}:{self.step_index}" or self._awaiting_own_state:
            return False
        # The shards' part (server_error) is left out: it is restored only
        # against fresh shards, and fetching it is a pull of the whole model.
        now = self._state_dict(server_error=False)["state"]
        for key, value in now.items():
            if torch.is_tensor(value):
                saved = state.get(key)
                if not torch.is_tensor(saved) or saved.shape != value.shape or not torch.equal(
                        saved.detach().cpu(), value.detach().cpu()):
                    return False
            elif state.get(key) != value:
                return False
        return True

    def load_state_dict(self, state_dict):
        """Restores a run saved with state_dict(), before the first step():
        build the model, load its weights (before this call; before the
        optimizer is built, or after it as Trainer does), build the
        optimizer, then call this on every rank with that rank's saved state
        (rank 0's must hold server_error). Against fresh shards, rank 0 restores them (x from the
        model, m, v, the server error and the step) and the other ranks wait
        for it; against shards that already hold that step (they survived,
        or resumed from their own checkpoints) nothing is sent. A state saved
        by another rank is refused when its worker error buffer matters
        (feedback other than 'none'), since loading it would silently change
        the run. A torch.optim Adam or AdamW state_dict (parameter by
        parameter) is taken too: _from_per_parameter."""
        self._check_not_awaiting("load_state_dict()")
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            raise ValueError(f"load_state_dict takes what this optimizer's state_dict() returned "
                             f"(a dict with 'state' and 'param_groups'), got {type(state_dict).__name__}"
                             f"{'' if not isinstance(state_dict, dict) else ' without a state dict'}")
        state = state_dict["state"]
        if state.get("inside_interval") is not None and _INTERVAL_X not in state:
            raise ValueError(_inside_interval_words(state["inside_interval"], self._interval_period())
                             + "; to go on from this one, load its weights and start a fresh "
                             "optimizer")
        if _per_parameter(state_dict):
            state_dict = self._from_per_parameter(state_dict)
            state = state_dict["state"]
            if state.get("fresh"):  # saved before its first step: no moments, the groups
                self._load_groups(state_dict)
                return
        dim = self._flat.numel()
        if self._session is None:
            # A node's other rank: its leader restores the node's worker; the
            # parameters come from the model's weights, as on the leader, or
            # inside a ZeroOneAdam local interval from this rank's own state.
            if not self._load_node_member(state):
                return
            self._node_first_step = int(state.get("step", 0)) - self._node.steps
            self._load_groups(state_dict)
            self._awaiting_own_state = None
            return
        if self._is_current(state):
            # This optimizer's own state_dict() of this very step, given back
            # (Accelerate's optimizer wrapper does that when it is built, to
            # move it to the device): nothing to restore, and the shards may
            # be ahead of it already (rank 0 resumed them).
            return
        mine = None if self._slices is None else [self._node.local_rank, len(self._slices)]
        if list(state.get("node_slice") or []) != list(mine or []):
            saved = state.get("node_slice")
            raise ValueError(
                f"this state_dict holds {f'slice {saved[0]} of {saved[1]}' if saved else 'the whole model'}"
                f"'s optimizer state, this rank trains "
                f"{f'slice {mine[0]} of {mine[1]}' if mine else 'the whole model'} "
                "(--node-aggregation=sharded: each local rank holds its slice's state): load "
                "each rank's own state_dict, saved under the same morse-run flags")
        for key in ("exp_avg", "exp_avg_sq", "worker_error"):
            if key not in state or state[key].numel() != dim:
                raise ValueError(f"state_dict['state']['{key}'] must hold {dim} values")
        saved_rank = state.get("rank", self._rank)
        inside = _INTERVAL_X in state  # each rank's own parameters and interval
        if inside and state.get("workers", self._workers) != self._workers:
            raise ValueError(
                f"this state_dict was saved inside one of ZeroOneAdam's local intervals by a job "
                f"of {state['workers']} workers, where each rank had moved on on its own: a job "
                f"of {self._workers} cannot go on from it. Resume it with {state['workers']} "
                "workers, or from a state saved right after a sync")
        if saved_rank != self._rank and (inside or bool(state["worker_error"].abs().max() > 0)):
            if self._finds_own_state:
                _await_own_state(self, saved_rank, int(state["step"]), self._flat.device)
                return
            raise ValueError(
                f"this state_dict is rank {saved_rank}'s, this is rank {self._rank}: its "
                f"{'parameters inside a local interval' if inside else 'worker error buffer'} "
                f"{'are' if inside else 'is'} rank {saved_rank}'s own, and loading "
                f"{'them' if inside else 'it'} here would change the run. Save "
                "every rank's optimizer.state_dict() (e.g. to f'opt-{rank}.pt') and load each "
                "rank's own")
        if self._awaiting_own_state is not None and int(state["step"]) != self._awaiting_own_state[1]:
            raise ValueError(
                f"this state_dict is of step {int(state['step'])}, but the checkpoint being resumed "
                f"(rank {self._awaiting_own_state[0]}'s state) is of step "
                f"{self._awaiting_own_state[1]}: load this rank's state of the same checkpoint")
        # Groups added mid-run (add_param_group): their first steps, checked
        # before anything is restored.
        firsts = list(state.get("first_steps") or [])
        if firsts and len(firsts) != len(self.param_groups):
            raise ValueError(f"this state_dict's run had {len(firsts)} parameter groups, this "
                             f"optimizer {len(self.param_groups)}: build it with the same groups "
                             "(or add them with add_param_group) before loading")
        if "server_error" in state and state["server_error"].numel() != dim:
            raise ValueError(f"state_dict['state']['server_error'] must hold {dim} values")
        group = state_dict.get("param_groups", [{}])[0]
        for key in () if self._follows_moments else ("betas", "eps"):
            if key in group and _as_list(group[key]) != _as_list(self.param_groups[0][key]):
                raise ValueError(f"the saved {key} {group[key]} differ from this optimizer's "
                                 f"{self.param_groups[0][key]}; build the optimizer with the saved "
                                 "values (the job's algorithm fixes them)")

        _warn_resized(self._worker, self._workers, state.get("workers"),
                      state["worker_error"], "x, m and v")

        def host(t):
            return t.detach().to("cpu", torch.float32).contiguous().numpy()
        server_error = host(state["server_error"]) if "server_error" in state else None
        moments = [host(state[k]) for k in ("exp_avg", "exp_avg_sq", "worker_error")]
        own = self._session.state_arrays()
        if own:
            keys = [_STATE_DICT_KEYS.get(name, name) for name, _, _ in own]
            missing = [k for k in keys + [self._commit_key] if k not in state]
            if missing:
                kind = type(self).__name__
                raise ValueError(f"this state_dict has no {', '.join(missing)}: a {kind} state "
                                 f"is saved by {kind}.state_dict()")
            for (_, values, _), key in zip(own, keys):
                if state[key].numel() != values:
                    raise ValueError(f"state_dict['state']['{key}'] must hold {values} values")
            self._session.set_own_state(
                int(state["step"]), *moments, server_error, [host(state[k]) for k in keys],
                state[self._commit_key].detach().to("cpu", torch.float64).contiguous().numpy())
        elif _INTERVAL_X in state:
            self._load_interval(state, moments, server_error, host)
        else:
            self._session.set_state(int(state["step"]), *moments, server_error)
        self._awaiting_own_state = None
        self._first_steps = firsts or [0] * len(self.param_groups)
        # The run restored is the model's weights as they are now (loaded
        # before this call, e.g. by Trainer after the optimizer was built)
        # with this state: later in-place changes are refused again.
        self._x_versions = [p._version for p in self._params]
        # lr and weight_decay follow param_groups every step, as in torch.
        self._load_groups(state_dict)

    def _load_node_member(self, state):
        """load_state_dict() on a node's rank that is not its leader (no
        session): the parameters of its own state inside a local interval
        over the model's. False where it now awaits its own state (Trainer
        gave it rank 0's, which is of another node's interval)."""
        x, saved_rank = state.get(_INTERVAL_X), state.get("rank", self._rank)
        if saved_rank != self._rank and (x is not None or "inside_interval" in state):
            if self._finds_own_state:
                _await_own_state(self, saved_rank, int(state["step"]), self._flat.device)
                return False
            raise ValueError(
                f"this state_dict is rank {saved_rank}'s, saved inside one of ZeroOneAdam's local "
                f"intervals, where each node has parameters of its own; this is rank {self._rank}: "
                "save every rank's optimizer.state_dict() (e.g. to f'opt-{rank}.pt') and load each "
                "rank's own")
        if x is not None:
            if x.numel() != self._flat.numel():
                raise ValueError(f"state_dict['state']['{_INTERVAL_X}'] must hold "
                                 f"{self._flat.numel()} values")
            with torch.no_grad():
                self._flat.copy_(x.to(self._flat.device, torch.float32))
            self._x_versions = [p._version for p in self._params]
        return True

    def _load_interval(self, state, moments, server_error, host):
        """load_state_dict() of a state saved inside a ZeroOneAdam local
        interval (_interval_state's): this rank's own parameters over the
        model's, then the session (rank 0 brings fresh shards to the
        interval's last sync)."""
        expected = self._session.interval_arrays()
        keys = [_INTERVAL_PREFIX + name for name, _, _ in expected]
        missing = [k for k in keys + [_INTERVAL_LAST] if k not in state]
        if missing:
            raise ValueError(f"this state_dict of a local interval has no {', '.join(missing)}: "
                             "load a state saved by ZeroOneAdam.state_dict() with the same job")
        for (name, values, _), key in zip(expected, keys):
            if state[key].numel() != values:
                raise ValueError(f"state_dict['state']['{key}'] must hold {values} values")
        x, others = state[_INTERVAL_X], state.get(_INTERVAL_OTHERS)
        if x.numel() != self._flat.numel():
            raise ValueError(f"state_dict['state']['{_INTERVAL_X}'] must hold "
                             f"{self._flat.numel()} values")
        held = sum(p.numel() for p in self._others)
        if self._slices is not None and (others is None or others.numel() != held):
            raise ValueError(f"state_dict['state']['{_INTERVAL_OTHERS}'] must hold the other "
                             f"slices' {held} values (a sharded node's state inside a local "
                             "interval)")
        shards_m = state.get(_INTERVAL_SHARDS_M)
        if shards_m is not None and shards_m.numel() != self._flat.numel():
            raise ValueError(f"state_dict['state']['{_INTERVAL_SHARDS_M}'] must hold "
                             f"{self._flat.numel()} values")
        # This rank's parameters inside the interval are its own; the model
        # loaded (rank 0's, from a checkpoint) is not, except on rank 0.
        before = self._flat.detach().clone()
        with torch.no_grad():
            self._flat.copy_(x.to(self._flat.device, torch.float32))
        try:
            self._session.set_interval(
                int(state["step"]), *moments, server_error,
                None if shards_m is None else host(shards_m),
                [host(state[k]) for k in keys], int(state[_INTERVAL_LAST]))
        except BaseException:
            with torch.no_grad():
                self._flat.copy_(before)  # nothing changed
            raise
        if self._slices is not None:
            # The other slices' parameters, which their owners restore, as
            # this rank held them (the node's).
            with torch.no_grad():
                offset = 0
                for p in self._others:
                    n = p.numel()
                    p.copy_(others[offset:offset + n].view_as(p).to(p.device, p.dtype))
                    offset += n
            self._other_versions = {id(p): p._version for p in self._others}

    def _from_per_parameter(self, state_dict):
        """A state_dict saved parameter by parameter (torch.optim's Adam or
        AdamW; DeepSpeed's OnebitAdam, ZeroOneAdam) as this optimizer's
        own: the moments (exp_avg, exp_avg_sq) laid out in the flat buffer,
        the step the parameters share, the error buffers at zero (a torch
        run has none; DeepSpeed's are laid out for its ranks' chunks, and
        its own load resets them too), the saved groups' lr and weight
        decay. ValueError, before anything is restored, for what Morse
        cannot continue exactly: a parameter without state, steps that
        differ, AMSGrad or maximize, moments of another shape, an optimizer
        with state of its own (OneBitLamb's v' and layer state)."""
        kind = type(self).__name__
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            count = len(saved_groups) if isinstance(saved_groups, list) else 0
            raise ValueError(f"this state_dict has {count} parameter groups, the optimizer "
                             f"{len(self.param_groups)}: build it with the groups of the run "
                             "that saved it")
        saved_state = state_dict["state"]
        held = []  # (name, parameter, its saved state or None), the trained ones
        trained, labels = ((self._params, self._names) if self._node is None
                           else (self._node_params, self._node_names))
        names = {id(p): n for p, n in zip(trained, labels)}
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            params = group["params"]
            indices = saved.get("params") if isinstance(saved, dict) else None
            if not isinstance(indices, list) or len(indices) != len(params):
                raise ValueError(
                    f"this state_dict's parameter group {g} has "
                    f"{len(indices) if isinstance(indices, list) else 'no list of'} parameters, "
                    f"the optimizer's {len(params)}: build it with the parameters, in the "
                    "order, of the run that saved it")
            for option in ("amsgrad", "maximize"):
                if saved.get(option):
                    raise ValueError(f"this state_dict's group {g} was trained with "
                                     f"{option}=True, which {kind} does not do")
            for index, p in zip(indices, params):
                if p.requires_grad:
                    held.append((names.get(id(p), f"parameter {index}"), p,
                                 saved_state.get(index)))
        if all(s is None for _, _, s in held):
            return {"state": {"step": 0, "fresh": True}, "param_groups": saved_groups}
        if self._lamb:  # (on a node's every rank alike, the leader's session or not)
            raise ValueError(
                f"this state_dict holds Adam's state parameter by parameter, which {kind} "
                "cannot continue: its own state (v' and each layer's coefficient state) has no "
                "counterpart there. Load a state_dict saved by a morse.torch "
                f"{kind}, or start {kind} after loading the model's weights")
        steps = {}
        for name, p, s in held:
            if s is None or "exp_avg" not in s or "exp_avg_sq" not in s:
                what = ("no state (it had no gradient in the run that saved it)" if s is None
                        else f"no exp_avg and exp_avg_sq (its state holds {sorted(s)})")
                raise ValueError(
                    f"{name} has {what}: {kind} continues Adam's moments, and counts one step "
                    "for the whole model. Load the state of an Adam or AdamW run in which every "
                    "parameter it trains had a gradient")
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(s[key].shape) != tuple(p.shape):
                    raise ValueError(f"{name}'s saved {key} has shape {tuple(s[key].shape)}, the "
                                     f"parameter {tuple(p.shape)}: load the state of the same model")
            step = s.get("step", 0)
            steps.setdefault(int(step.item() if torch.is_tensor(step) else step), []).append(name)
        if len(steps) > 1:
            shown = "; ".join(f"step {k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}"
                              for k, v in sorted(steps.items()))
            raise ValueError(
                f"this state_dict's parameters are at different steps ({shown}): {kind} counts "
                "one step for the whole model. Load a state in which every parameter took each "
                "step")
        step = next(iter(steps))
        if any("worker_error" in s or "server_error" in s for _, _, s in held):
            warnings.warn(
                "morse: this state_dict's compression error buffers (DeepSpeed's, laid out for "
                f"its ranks) are not {kind}'s: they start at zero here, as DeepSpeed's own "
                "load_state_dict resets them", RuntimeWarning, stacklevel=3)
        # torch 2's Adam says when its weight decay was an L2 term in the
        # gradient; Morse's is decoupled, as AdamW's.
        coupled = [g for g, saved in enumerate(saved_groups)
                   if saved.get("decoupled_weight_decay") is False and saved.get("weight_decay")]
        if coupled:
            warnings.warn(
                f"morse: this state_dict's group(s) {coupled} were trained by torch.optim.Adam "
                f"with weight_decay (an L2 term in the gradient); {kind}'s weight decay is "
                "decoupled, as AdamW's, and takes the same value: set param_groups' "
                "weight_decay after loading for another", RuntimeWarning, stacklevel=3)
        state = {"step": step}
        if self._session is not None:
            dim = self._flat.numel()
            m, v = torch.zeros(dim), torch.zeros(dim)
            by_id = {id(p): s for _, p, s in held}
            for p, (lo, hi) in zip(self._params, self._ranges):
                s = by_id[id(p)]
                m[lo:hi] = s["exp_avg"].detach().to("cpu", torch.float32).reshape(-1)
                v[lo:hi] = s["exp_avg_sq"].detach().to("cpu", torch.float32).reshape(-1)
            state.update(exp_avg=m, exp_avg_sq=v, worker_error=torch.zeros(dim))
            if self._worker == 0:
                state["server_error"] = torch.zeros(dim)
            if self._slices is not None:
                state["node_slice"] = [self._node.local_rank, len(self._slices)]
        return {"state": state, "param_groups": saved_groups}


def _per_parameter(state_dict):
    """Whether `state_dict` holds its state parameter by parameter (as
    torch.optim's optimizers save it: state by parameter index, each group
    listing its indices) rather than Morse's flat arrays."""
    state = state_dict["state"]
    if state:
        return all(isinstance(k, int) and isinstance(v, dict) for k, v in state.items())
    groups = state_dict.get("param_groups")  # (torch's, saved before its first step)
    return (isinstance(groups, list) and bool(groups)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups))


def _warn_resized(worker, workers, saved, worker_error, taken):
    """On worker 0 of a job of `workers`: a warning where the state it
    loads was saved by a job of `saved` workers (None: not recorded) while
    the error buffers mattered (its own, `worker_error`, is not zero): the
    run goes on, but not as the saved job would have. `taken`: what a
    worker without a saved state takes from the shards."""
    if worker != 0 or saved is None or int(saved) == workers or not bool(worker_error.abs().max() > 0):
        return
    saved = int(saved)
    if saved > workers:
        what = (f"the worker error buffers of workers {workers}..{saved - 1} are not loaded: "
                "their residue of the compression is dropped")
    else:
        what = (f"workers {saved}..{workers - 1} have no saved state: they load none (they take "
                f"{taken} from the shards) and start with zero error buffers")
    warnings.warn(f"morse: this state was saved by a job of {saved} workers, and this job has "
                  f"{workers}: {what}. The run goes on from the saved step, not bit for bit as the "
                  "saved job would have (with the same number of workers it would)",
                  RuntimeWarning, stacklevel=3)


def _await_own_state(opt, saved_rank, step, device):
    """`opt` (a Morse optimizer, or DiLoCo) was given rank `saved_rank`'s
    state of step `step` under morse.torch.hf: Hugging Face Trainer and
    Accelerate's load_state load rank 0's file on every rank, so this
    rank's own is loaded from beside it (Accelerate: at once, the file the
    load hook named; Trainer: MorseCallback before the first step), and
    step() refuses to run without it."""
    opt._awaiting_own_state = (saved_rank, step)
    own, opt._own_state_file = opt._own_state_file, None
    if own is None:
        return
    if not os.path.isfile(own):
        raise FileNotFoundError(
            f"rank {opt.rank} was given rank {saved_rank}'s optimizer state (step {step}), and its "
            f"own, {own}, is not there: morse.torch.hf.prepare's save_state hook writes it on "
            "every rank into the folder that save_state writes; load a folder saved so, or copy "
            "the morse-rank-*.pt files of that checkpoint beside its optimizer.bin")
    opt.load_state_dict(torch.load(own, map_location=device, weights_only=True))


def torch_optim_state_dict(*state_dicts):
    """torch.optim.AdamW's state_dict() for the run that the morse.torch
    `state_dicts` saved: every trained parameter's exp_avg and exp_avg_sq
    (shaped as the parameter), the step, and the saved param_groups (lr,
    betas, eps, weight_decay), numbered as torch numbers an optimizer built
    over the same groups (a frozen parameter counts, without state). Give
    one rank's state_dict() (every rank holds the same moments), or under
    --node-aggregation=sharded every local rank's of one node (each holds
    its slice). The error buffers are left behind: torch's Adam has none.
    Load the result into a torch optimizer built over the same groups
    after the model's weights, on every rank."""
    if not state_dicts:
        raise ValueError("torch_optim_state_dict takes one morse.torch state_dict(), or every "
                         "slice's of a sharded node")
    slices = {}
    for saved in state_dicts:
        state = saved.get("state") if isinstance(saved, dict) else None
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("torch_optim_state_dict takes what a morse.torch optimizer's "
                             "state_dict() returned (DiLoCo's: its inner optimizer's is torch's)")
        if state.get("node_member"):
            raise ValueError("this state_dict is a node member's, which holds no optimizer state "
                             "(--node-aggregation: the node's leader steps for it): convert the "
                             "state of the node's local rank 0")
        if "parameters" not in state:
            raise ValueError("this state_dict does not say where each parameter lies (saved "
                             "before 2026-12-07): save it again with this version")
        where = tuple(state.get("node_slice") or (0, 1))
        if where in slices:
            raise ValueError(f"slice {where[0]} of {where[1]} given twice")
        slices[where] = state
    counts = {count for _, count in slices}
    if len(counts) != 1 or len(slices) != next(iter(counts)):
        have = sorted(k for k, _ in slices)
        raise ValueError(f"a sharded node's state is its {max(counts)} slices' together; given "
                         f"slices {have}: give every local rank's state_dict() of one step")
    steps = {int(s["step"]) for s in slices.values()}
    if len(steps) != 1:
        raise ValueError(f"the slices' states are of steps {sorted(steps)}: give one step's")
    step = steps.pop()
    out = {}
    for (_, _), state in sorted(slices.items()):
        m, v = state["exp_avg"], state["exp_avg_sq"]
        for index, lo, hi, shape in state["parameters"]:
            out[int(index)] = {
                "step": torch.tensor(float(step)),
                "exp_avg": m[lo:hi].detach().clone().reshape(shape),
                "exp_avg_sq": v[lo:hi].detach().clone().reshape(shape)}
    groups = []
    numbered = next(iter(slices.values()))["torch_groups"]
    for group, indices in zip(state_dicts[0]["param_groups"], numbered):
        # torch.optim.AdamW's own settings beside the saved ones (torch's
        # load_state_dict takes every key of a saved group), and torch's
        # numbering, in which frozen parameters count (without state).
        kept = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
        kept["betas"] = tuple(kept.get("betas", (0.9, 0.999)))
        groups.append(dict({"amsgrad": False, "maximize": False, "foreach": None,
                            "capturable": False, "differentiable": False, "fused": None},
                           **kept, params=list(indices)))
    listed = {i for g in groups for i in g["params"]}
    if not set(out) <= listed:
        raise ValueError(f"the states hold parameters {sorted(set(out) - listed)[:8]} that no "
                         "group lists: give the states of one run")
    return {"state": out, "param_groups": groups}
