"""add_param_group mid-run (progressive unfreezing, issue 41) under
morse-run: 2 ranks (rank 0 overlapping, rank 1 pushing at step()), 2 shards.

- "adam": morse.torch.Adam built over part of a model, the rest added as a
  group with its own lr at step 3 and another at step 6, against
  torch.optim.AdamW fed the averaged gradient with the same calls: within
  1e-5 after every step (the two evaluate Adam in different orders), the
  added parameters untouched before their step, and bias-corrected from it
  as torch's per-parameter step (design.md 2.1, "A group that starts
  later"); both ranks bit-identical.
- "onebit": OneBitAdam, a group added at step 2 of a 5-step warmup: AdamW's
  values through the warmup, both ranks bit-identical through the
  compression phase, and refused past freeze_step.
- "lamb": OneBitLamb, the same group added at step 2 of a 6-step warmup:
  through the warmup within 1e-5 of 1-bit LAMB's rule (design.md 2.8)
  written out in torch below, the added layers' bias corrections and
  coefficient averages counting from their step; both ranks bit-identical
  and the shards' mirrors the workers' x through the compression phase;
  refused past freeze_step.
- "adam@cuda", "onebit@cuda", "lamb@cuda": those on CUDA tensors, the
  same checks (skipped, saying so, without a GPU).
- "node": "adam"'s calls under --node-aggregation, 2 nodes of 2 ranks (the
  leaders push for their nodes): within 1e-5 of AdamW fed the 4 ranks'
  average, every rank bit-identical; a call between backward() and step()
  refused on every rank. "node_zero_one": "zero_one" on those nodes, every
  rank bit for bit "node_zero_one_built"'s. "node_sharded": "node" under
  --node-aggregation=sharded, the slices cut anew at each call (a.bias
  moving from slice 1 to slice 0 at the first), the state moving with its
  parameters between the node's ranks: bit for bit "node"'s run, every
  rank alike; "shard_zero_one" bit for bit "shard_zero_one_built";
  "shard_lamb": "lamb" on sharded nodes (a.bias and its layer's state
  moving to slice 0), within 1e-5 of LambWarmup fed the 4 ranks' average
  through the warmup, every rank alike.
- "module": built from a module (its BatchNorm's running statistics, which
  rank 0 broadcasts), a parameter beside it added at step 3: AdamW's
  values, the running statistics equal on both ranks, the names kept.
- "resume": each rank's state_dict() saved after the added group's step,
  loaded in a second job into an optimizer built with every group: the
  continued run ends bit-identical to the first job's. The same for the
  "lamb" run saved right after its call at step 2 and resumed across the
  freeze (its layer state grown, its last commit dropped, with the layout).
- "zero_one": ZeroOneAdam with a group added before its first step trains
  bit for bit as one built with it ("zero_one_built"), and a group added at
  the 1-bit step 2 as the same group added at the variance step 3 (held,
  unmoved, until its first variance step: design.md 2.7), through every
  phase; the shards' mirrors the workers' x after every exchange.
- refusals: ZeroOneAdam's with no variance step left before
  var_freeze_step, and a call between backward() and
  step() with the pushes under way; each a ValueError saying why, the run
  going on unchanged. And "mismatch": rank 0 alone adds a group: the job stops
  within the (shortened) connect timeout, rank 0's error saying that every
  rank must call it at the same step.
- "restart:7", "restart:6": "adam"'s calls under --rank-restarts 1, rank 1
  killed after both (back from its checkpoint of the second call, adding
  both groups again before its first step) and between them (back from
  step 4, adding the first, then the second with the others): within 1e-5
  of AdamW in either life, both ranks ending bit for bit as "adam"'s
  undisturbed run; before the groups are back, a step() and a group of
  other shapes refused, saying what to do. "restart:-7": shard 1 killed
  after the second call's step, restarted by morse-run from the checkpoint
  it wrote once rank 0 had restored the new layout: the same bits.
  "node_restart:7", "shard_restart:7": the same on 2 nodes of 2 ranks
  (the leader's, and sharded), rank 3 killed after both calls: node 1
  restarts, every rank of it adding both groups again, its leader (each
  owner) back from its checkpoint of step 6; every rank ends bit for bit
  as "node"'s (and "node_sharded"'s) undisturbed run.
- "elastic": morse-run --min-workers 2 of 3 ranks; rank 2 leaves (killed,
  not restarted) before step 3, ranks 0 and 1 add a group at step 5: the
  new layout is made without rank 2 (its steps leave it out from the start,
  the membership [0, 1] through to the end), within 1e-5 of AdamW fed the
  members' average, ranks 0 and 1 bit-identical.

`test_add_param_group.py surfaces` runs "adam", "onebit", "lamb", "module",
"zero_one", the refusals and the resumes alone: what meets torch's own code
(its torch2_ twin, under torch 2.x; tests/python/CMakeLists.txt)."""
import json
import os
import sys
import tempfile

import torch

from harness import check, has_cuda, morse_run, nodes


class Model(torch.nn.Module):
    def __init__(self, t_rows=2):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.t = torch.nn.Parameter(torch.randn(t_rows, 3, 4) * 0.1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.t.sum(dim=(0, 2))


class Normed(torch.nn.Module):
    """A body with a BatchNorm, whose running statistics rank 0 broadcasts,
    and a parameter beside it."""
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 5),
                                        torch.nn.ReLU(), torch.nn.Linear(5, 3))
        self.t = torch.nn.Parameter(torch.randn(2, 3, 4) * 0.1)

    def forward(self, x):
        return self.body(x) + self.t.sum(dim=(0, 2))


def data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def loss_of(model, rank, step):
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in data(rank, step))
    return torch.nn.functional.cross_entropy(model(x), y)


# ZeroOneAdam's schedule (1-based s): variance steps 1, 2 and 4, a 1-bit
# step 3, syncs at 6, 7, 8 and 12, local steps 9 to 11 (design.md 2.7).
ZERO_ONE = dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)

# (step, the group added before it) for each mode's optimizer and torch's.
ADDED = {"adam": [(3, lambda m: {"params": [m.t], "lr": 0.02}),
                  (6, lambda m: {"params": [m.b.bias], "weight_decay": 0.1})],
         "onebit": [(2, lambda m: {"params": [m.t, m.b.bias], "lr": 0.005})],
         # LAMB's layer step |x| u/|u| undoes a scaling of u: a weight decay
         # as large as this one's keeps the bias corrections in sight.
         "lamb": [(2, lambda m: {"params": [m.t, m.b.bias], "lr": 0.05, "weight_decay": 0.5})],
         # Built from the body module (its buffers broadcast); t added (the
         # buffers still broadcast, the names kept).
         "module": [(3, lambda m: {"params": [m.t]})]}


class LambWarmup:
    """1-bit LAMB's warmup rule (design.md 2.8) in torch, each parameter
    tensor a layer: Adam's moments of the averaged gradient with bias
    corrections counting from the step its group was added, and each
    layer's step lr * c with c = clamp(|x| / |u|, min_coeff, max_coeff)
    (its average c̄ from 0 at that step; c = 1 where a norm is 0)."""
    def __init__(self, groups, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8,
                 max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9):
        self.defaults = dict(lr=lr, weight_decay=weight_decay)
        self.betas, self.eps = betas, eps
        self.bounds, self.coeff_beta = (min_coeff, max_coeff), coeff_beta
        self.step_index, self.groups, self.state = 0, [], {}
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group):
        self.groups.append(dict(self.defaults, **group, first=self.step_index))

    @torch.no_grad()
    def step(self):
        (b1, b2), t = self.betas, self.step_index
        for group in self.groups:
            n = t + 1 - group["first"]
            bc1, bc2 = 1 - b1 ** n, 1 - b2 ** n
            for x in group["params"]:
                m, v, c_bar = self.state.get(x, (torch.zeros_like(x), torch.zeros_like(x), 0.0))
                m = b1 * m + (1 - b1) * x.grad
                v = b2 * v + (1 - b2) * (x.grad * x.grad)
                u = (m / bc1) / (torch.sqrt(v / bc2) + self.eps) + group["weight_decay"] * x
                norm_x, norm_u = x.double().norm().item(), u.double().norm().item()
                c = 1.0
                if norm_x > 0 and norm_u > 0:
                    c = min(max(norm_x / norm_u, self.bounds[0]), self.bounds[1])
                    c_bar = self.coeff_beta * c_bar + (1 - self.coeff_beta) * c
                x -= (group["lr"] * c) * u
                self.state[x] = (m, v, c_bar)
        self.step_index += 1


def layer_states(opt):
    """A sharded node's rank: {index in the node's parameters: its layer's
    1-bit LAMB state} over its slice, from its state_dict()."""
    state = opt.state_dict()["state"]
    of, count = opt._layers()
    by_layer = state["lamb_layers"].reshape(count, -1)
    first = opt._slices[opt._node.local_rank][0]
    return {first + i: by_layer[layer].tolist() for i, layer in enumerate(of)}


def built(model, mode, every=False):
    """The optimizer's first groups (every=True: as after every addition)."""
    first = [model.a.weight, model.a.bias, model.b.weight]
    groups = [{"params": first}]
    if every:
        groups += [add(model) for _, add in ADDED["adam" if mode == "resume" else mode]]
    return groups


def worker(mode, out):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    torch.manual_seed(1)
    tag, mode, where = mode, *mode.partition("@")[::2]  # "MODE@cuda": on the GPU
    # "node", "node_MODE": under --node-aggregation; "shard_MODE": =sharded.
    on_node = mode.startswith(("node", "shard_"))
    if mode.startswith(("node_", "shard_")):
        mode = mode.partition("_")[2]
    device = torch.device(where or "cpu")
    model = (Normed() if mode == "module" else Model()).to(device)
    reference = (Normed() if mode == "module" else Model()).to(device)
    reference.load_state_dict(model.state_dict())
    world = int(os.environ["MORSE_WORLD_SIZE"])
    kind = "adam" if mode in ("adam", "resume", "refused", "node", "sharded") else mode
    # (A node's ranks gather during backward() alike: every one overlaps.)
    options = dict(lr=0.01, block_elems=16, partition_elems=32,
                   overlap=rank == 0 or on_node)
    if mode == "mismatch":  # rank 0 alone adds a group: the job stops, saying why
        opt = morse.torch.Adam(built(model, "adam"), **options)
        for step in range(4):
            if step == 2 and rank == 0:
                opt.add_param_group({"params": [model.t]})
            model.zero_grad()
            loss_of(model, rank, step).backward()
            opt.step()
        return
    if mode == "elastic":
        elastic(model, reference, opt_options=options, out=out)
        return
    if mode.startswith("restart:"):
        restarted(out, int(mode.partition(":")[2]), tag.replace(":", "-"), options)
        return
    if mode in ("zero_one", "zero_one_built"):
        # A group added before the first step, as scripts that build their
        # optimizer group by group do, is one it was built with. One added
        # at the 1-bit step 2 is held until the variance step 3 (its v is 0
        # until then: design.md 2.7), so it is one added at step 3.
        # t of 48 elements fills its last block of 16, so the group added
        # after it pads nothing (a padded block's 1-bit scale is over 16).
        model = Model(t_rows=4)
        added = {"params": [model.t], "lr": 0.02}
        opt = morse.torch.ZeroOneAdam(built(model, "adam") + [added] * (mode != "zero_one"),
                                      **ZERO_ONE, **options)
        if mode == "zero_one":
            opt.add_param_group(added)
        said, bias = "", [model.b.bias.detach().clone()]
        for step in range(12):  # variance, 1-bit and local steps, syncs
            if step == (2 if mode == "zero_one" else 3):
                opt.add_param_group({"params": [model.b.bias], "lr": 0.03})
            model.zero_grad()
            loss_of(model, rank, step).backward()
            opt.step()
            bias.append(model.b.bias.detach().clone())
            if step not in (8, 9, 10):  # local steps: each rank's x its own
                check(opt._session is None or opt._session.holds_shards_model(),
                      f"rank {rank} step {step}: the shards' mirrors differ from the workers' x")
            if step == 3 and mode == "zero_one":
                try:  # no variance step left before var_freeze_step
                    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device))]})
                except ValueError as e:
                    said = str(e)
        check(all(torch.equal(b, bias[0]) for b in bias[:4]) and not torch.equal(bias[4], bias[3]),
              f"rank {rank}: the bias added at step {2 if mode == 'zero_one' else 3} moved "
              "before step 3 or not at step 3")
        json.dump({"said": said, "checksum": opt.checksum(),
                   "x": [p.detach().tolist() for p in model.parameters()]},
                  open(f"{out}/{tag}-rank-{rank}.json", "w"))
        return
    if kind == "onebit":
        opt = morse.torch.OneBitAdam(built(model, kind), freeze_step=5, **options)
    elif kind == "lamb":
        opt = morse.torch.OneBitLamb(built(model, kind), freeze_step=6, weight_decay=0.01,
                                     **options)
    elif kind == "module":
        opt = morse.torch.Adam(model.body, **options)
    else:
        opt = morse.torch.Adam(built(model, kind), **options)
    if kind == "lamb":
        ref_opt = LambWarmup(built(reference, kind), lr=0.01, weight_decay=0.01)
    else:
        ref_opt = torch.optim.AdamW(
            list(reference.body.parameters()) if kind == "module"
            else built(reference, kind), lr=0.01, weight_decay=0.0)
    steps = 12 if kind in ("onebit", "lamb") else 9
    said = {}
    worst = 0.0
    for step in range(steps):
        for at, add in ADDED[kind]:
            if step == at:
                for p, q in zip(add(model)["params"], add(reference)["params"]):
                    check(torch.equal(p, q), f"step {step}: an added parameter moved before")
                layers = kind == "lamb" and opt._slices is not None  # (a sharded node's)
                before = layer_states(opt) if layers else None
                opt.add_param_group(add(model))
                ref_opt.add_param_group(add(reference))
                if layers:
                    said["layers"] = [before, layer_states(opt)]
        if (tag, step) in SAVED.values():
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       f"{out}/saved-{tag}-{rank}.pt")
        model.zero_grad()
        loss_of(model, rank, step).backward()
        if mode in ("node", "sharded") and step == 4:  # every rank of the node: the gathers under way
            try:
                opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device))]})
            except ValueError as e:
                said["mid_step"] = str(e)
        if mode == "refused" and step == 4 and rank == 0:  # pushes under way (overlap)
            try:
                opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device))]})
            except ValueError as e:
                said["mid_step"] = str(e)
            # The C ABI's check (morse_session_check_first_step) on bad input.
            said["negative"] = opt._session.first_step_refusal(-1)
            said["later"] = opt._session.first_step_refusal(9)
        opt.step()
        check(opt._session is None or opt._session.holds_shards_model(),  # a node's leader
              f"rank {rank} step {step}: the shards' mirrors differ from the workers' x")
        reference.zero_grad()
        (sum(loss_of(reference, r, step) for r in range(world)) / world).backward()
        ref_opt.step()
        if kind in ("onebit", "lamb") and step >= opt._freeze_step:
            continue  # compressed: no torch counterpart
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            worst = max(worst, diff)
            check(diff < 1e-5, f"rank {rank} step {step}: {name} differs from "
                  f"{type(ref_opt).__name__}'s by {diff}")
    if kind in ("onebit", "lamb"):
        try:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device))]})
        except ValueError as e:
            said["frozen"] = str(e)
    if kind == "module":
        check(opt._names[:2] == ["0.weight", "0.bias"], f"the names kept: {opt._names}")
        said["buffers"] = [b.tolist() for b in model.buffers()]
    print(f"rank {rank}: largest difference from {type(ref_opt).__name__} {worst:.3g}")
    json.dump({"checksum": opt.checksum(), "step": opt.step_index, "said": said,
               "x": [p.detach().tolist() for p in model.parameters()]},
              open(f"{out}/{tag}-rank-{rank}.json", "w"))


def elastic(model, reference, opt_options, out):
    """An elastic job's ranks 0 and 1 add a group at step ELASTIC_ADD after
    rank 2 left at step ELASTIC_LEFT (killed, not restarted): the call lays
    the model out anew without rank 2, and the group trains as AdamW's fed
    the members' average."""
    import signal
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    opt = morse.torch.Adam(built(model, "adam"), **opt_options)
    ref_opt = torch.optim.AdamW(built(reference, "adam"), lr=0.01, weight_decay=0.0)
    worst, members = 0.0, []
    for step in range(9):
        if step == ELASTIC_ADD:
            opt.add_param_group({"params": [model.t], "lr": 0.02})
            ref_opt.add_param_group({"params": [reference.t], "lr": 0.02})
        if rank == 2 and step == ELASTIC_LEFT:
            print(f"rank 2 leaves in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        model.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        members.append(opt.membership())
        check(opt._session.holds_shards_model(),
              f"rank {rank} step {step}: the shards' mirrors differ from the workers' x")
        ranks = [0, 1, 2] if step < ELASTIC_LEFT else [0, 1]
        reference.zero_grad()
        (sum(loss_of(reference, r, step) for r in ranks) / len(ranks)).backward()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            worst = max(worst, diff)
            check(diff < 1e-5, f"rank {rank} step {step}: {name} differs from AdamW's by {diff}")
    print(f"rank {rank}: largest difference from AdamW {worst:.3g}")
    json.dump({"checksum": opt.checksum(), "members": members,
               "x": [p.detach().tolist() for p in model.parameters()]},
              open(f"{out}/elastic-rank-{rank}.json", "w"))


def restarted(out, kill, tag, options):
    """"adam"'s two calls under morse-run --rank-restarts 1 (checkpoints
    every 4 steps, and each call's own): the last rank kills itself at the
    top of step `kill` in its first life (under --node-aggregation, node
    1's second: its node restarts). Restarted, it goes on from its newest
    checkpoint, adding the groups the run had added by then (the idiom for
    scripts that may be restarted), and the later ones as the others do.
    After every step, in either life, AdamW's values fed the average.
    A negative `kill`: rank 0 kills shard 1 at the top of step -kill."""
    import signal
    import morse.torch
    from harness import shard_pid
    rank = int(os.environ["MORSE_RANK"])
    world = int(os.environ["MORSE_WORLD_SIZE"])
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    torch.manual_seed(1)
    model, reference = Model(), Model()
    reference.load_state_dict(model.state_dict())
    opt = morse.torch.Adam(built(model, "adam"), **options)
    ref_opt = torch.optim.AdamW(built(reference, "adam"), lr=0.01, weight_decay=0.0)
    start = opt.step_index
    print(f"rank {rank} life {life} starts at step {start}", flush=True)
    said = {}
    if life == 1:  # before the groups are back: refused, saying what to do
        try:
            opt.step()
        except morse.torch.MorseError as e:
            said["step"] = str(e)
        try:
            opt.state_dict()
        except morse.torch.MorseError as e:
            said["state_dict"] = str(e)
        try:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        except ValueError as e:
            said["shape"] = str(e)
    worst = 0.0
    for step in range(9):
        if rank == world - 1 and life == 0 and step == kill:
            print(f"rank {rank} kills itself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        for i, (at, add) in enumerate(ADDED["adam"]):
            if step >= at and len(ref_opt.param_groups) == 1 + i:
                ref_opt.add_param_group(add(reference))
            if step >= max(at, start) and len(opt.param_groups) == 1 + i:
                opt.add_param_group(add(model))
        if kill < 0 and rank == 0 and step == -kill:  # a shard, before backward()
            pid = shard_pid(os.environ["MORSE_CONFIG"], 1)
            check(pid is not None, "shard 1's process not found")
            os.kill(pid, signal.SIGKILL)
            print(f"killed shard 1 at step {step}", flush=True)
        reference.zero_grad()
        (sum(loss_of(reference, r, step) for r in range(world)) / world).backward()
        ref_opt.step()
        if step < start:
            continue  # (the reference alone, up to where this life starts)
        model.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        # (A restarted rank's replayed steps are behind the shards'.)
        check(life == 1 and step < kill or opt._session is None
              or opt._session.holds_shards_model(),
              f"rank {rank} step {step}: the shards' mirrors differ from the workers' x")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            worst = max(worst, diff)
            check(diff < 1e-5, f"rank {rank} life {life} step {step}: {name} differs from "
                  f"AdamW's by {diff}")
    print(f"rank {rank}: largest difference from AdamW {worst:.3g}")
    json.dump({"checksum": opt.checksum(), "said": said,
               "x": [p.detach().tolist() for p in model.parameters()]},
              open(f"{out}/{tag}-rank-{rank}.json", "w"))


# "elastic": rank 2 leaves before this step; ranks 0 and 1 add a group.
ELASTIC_LEFT, ELASTIC_ADD = 3, 5

# A resumed mode: (the run it continues, the step whose state it loads).
SAVED = {"resumed": ("resume", 7), "resumed_lamb": ("lamb", 2)}


def resumed(out, mode):
    """The second job: every group built at once, the saved state loaded."""
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    model = Model()
    source, first = SAVED[mode]
    saved = torch.load(f"{out}/saved-{source}-{rank}.pt")
    model.load_state_dict(saved["model"])
    options = dict(lr=0.01, block_elems=16, partition_elems=32, overlap=rank == 0)
    if source == "lamb":
        opt = morse.torch.OneBitLamb(built(model, source, every=True), freeze_step=6,
                                     weight_decay=0.01, **options)
    else:
        opt = morse.torch.Adam(built(model, source, every=True), **options)
    opt.load_state_dict(saved["opt"])
    for step in range(first, 12 if source == "lamb" else 9):
        model.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
    json.dump({"checksum": opt.checksum(), "step": opt.step_index,
               "x": [p.detach().tolist() for p in model.parameters()]},
              open(f"{out}/{mode}-rank-{rank}.json", "w"))


def results(out, mode):
    return [json.load(open(f"{out}/{mode}-rank-{r}.json")) for r in range(2)]


def on_nodes(out, mode, how="--node-aggregation", extra=()):
    """`mode` on 2 nodes of 2 ranks (`how`: the leaders stepping, or
    =sharded), every node's ranks passing: each node's output, and the 4
    ranks' results."""
    texts = []
    for node, (code, text) in enumerate(nodes(__file__, 2, 2, out, mode,
                                              extra=("--servers", "2", how, *extra))):
        print(text)
        check(code == 0, f"{mode}: node {node}'s ranks failed")
        texts.append(text)
    tag = mode.replace(":", "-")
    return texts, [json.load(open(f"{out}/{tag}-rank-{r}.json")) for r in range(4)]


def run(out, mode):
    code, text = morse_run(__file__, 2, 2, mode, out)
    print(text)
    check(code == 0, f"the job failed ({mode})")
    return text


def resume_checks(out):
    """"resume" and each of SAVED's runs: the resumed run ends bit-identical
    to the whole one."""
    run(out, "resume")
    for mode, (source, _) in SAVED.items():
        run(out, mode)
        whole, again = results(out, source), results(out, mode)
        for r in range(2):
            check(again[r]["x"] == whole[r]["x"] and again[r]["checksum"] == whole[r]["checksum"],
                  f"rank {r}: the resumed run differs from the whole one ({source})")
        print(f"PASS {mode}: a state saved after add_param_group resumes bit-identically")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        mode, out = sys.argv[-2], sys.argv[-1]
        if os.path.isdir(mode):  # harness.nodes gives them the other way round
            mode, out = out, mode
        resumed(out, mode) if mode in SAVED else worker(mode, out)
        sys.exit(0)
    out = tempfile.mkdtemp()
    # `cuda` (the GPU script, tests/bench/step_bench_gpu.sh): those alone.
    alone = sys.argv[1:] == ["cuda"]
    # `surfaces` (the torch2_ twin, tests/python/CMakeLists.txt): the calls
    # torch's own code is on the path of (Optimizer.add_param_group, its
    # param_groups, a module's buffers, state_dict), without the nodes,
    # the elastic job and the restarts, which check Morse's machinery alone.
    surfaces = sys.argv[1:] == ["surfaces"]
    modes = [] if alone else ["adam", "onebit", "lamb", "module"]
    # On CUDA tensors (where there is a GPU): the same calls and checks.
    if has_cuda("add_param_group on CUDA tensors (adam@cuda, onebit@cuda, lamb@cuda)"):
        modes += ["adam@cuda", "onebit@cuda", "lamb@cuda"]
    for mode in modes:
        text = run(out, mode)
        check(text.count("largest difference from ") == 2, "both ranks report")
        got = results(out, mode)
        check(got[0]["checksum"] == got[1]["checksum"] and got[0]["x"] == got[1]["x"],
              f"{mode}: the ranks differ")
        print(f"PASS {mode}: within 1e-5 of {'LambWarmup' if mode.startswith('lamb') else 'AdamW'} with "
              "its groups added alike; ranks identical")
    for mode in modes:
        freeze = {"onebit": 5, "lamb": 6}.get(mode.partition("@")[0])
        if freeze:
            said = results(out, mode)[0]["said"]
            check(f"since step 12, at or after freeze_step {freeze}" in said.get("frozen", ""),
                  f"{mode}: refused past the freeze: {said}")
    if alone:
        sys.exit(0)
    normed = results(out, "module")
    check(normed[0]["said"]["buffers"] == normed[1]["said"]["buffers"],
          "module: rank 0's buffers broadcast after the call too")
    run(out, "zero_one")
    run(out, "zero_one_built")
    added, built_with = results(out, "zero_one"), results(out, "zero_one_built")
    for r in range(2):
        check(added[r]["x"] == built_with[r]["x"] and added[r]["checksum"] == built_with[r]["checksum"],
              f"rank {r}: ZeroOneAdam with a group added before step 0 differs from one built "
              "with it")
    said = added[0]["said"]
    check("ZeroOneAdam cannot train a group from step 4" in said
          and "after zero_one_adam's last variance step before var_freeze_step 5" in said,
          f"ZeroOneAdam: {said}")
    print("PASS zero_one: a group added before the first step trains bit for bit as one built "
          "with it, and one added at a 1-bit step as one added at the next variance step, "
          "through every phase; with no variance step left refused, saying why")
    run(out, "refused")
    said = results(out, "refused")[0]["said"]
    check("between step() and the next backward()" in said.get("mid_step", ""),
          f"refused mid-step: {said}")
    check("first_step -1 must not be negative" in (said.get("negative") or "")
          and said.get("later") is None, f"the C ABI's first-step check: {said}")
    check(results(out, "refused")[0]["x"] == results(out, "adam")[0]["x"],
          "the refused calls changed nothing")
    print("PASS refused: mid-step, saying why; the run unchanged; the C ABI's check")
    if surfaces:
        resume_checks(out)
        sys.exit(0)
    config = os.path.join(out, "short.textproto")
    with open(config, "w") as f:
        f.write("timeouts { connect_seconds: 5 step_seconds: 5 recovery_seconds: 10 }\n")
    code, text = morse_run(__file__, 2, 2, "mismatch", out, config=config)
    check(code != 0, "a job where rank 0 alone adds a group went on")
    check("only 1 of 2 workers joined" in text
          and "every rank must call it between the same two steps" in text,
          f"the job did not say why it stopped:\n{text}")
    print("PASS mismatch: rank 0 alone adding a group stops the job, saying why")
    # Under --node-aggregation: 2 nodes of 2 ranks, each leader pushing for
    # its node; every rank of every node calls it.
    _, got = on_nodes(out, "node")
    check(all(g["x"] == got[0]["x"] for g in got), "node: the ranks differ")
    check(all("between step() and the next backward()" in g["said"].get("mid_step", "")
              for g in got), f"node: a call mid-step refused on every rank: {got}")
    # ZeroOneAdam's group held from a 1-bit step to the next variance step,
    # on the leaders' nodes, as without nodes.
    added, built_with = (on_nodes(out, m)[1] for m in ("node_zero_one", "node_zero_one_built"))
    check(all(a["x"] == b["x"] == added[0]["x"] for a, b in zip(added, built_with)),
          "node_zero_one: the group added at the 1-bit step differs from one added at the "
          "variance step, or the ranks differ")
    print("PASS node: under --node-aggregation (2 nodes of 2 ranks) within 1e-5 of AdamW with its "
          "groups added alike; every rank identical; ZeroOneAdam's held group as without nodes")
    # --node-aggregation=sharded: the slices are cut anew over the grown
    # model (a.bias moves from slice 1 to slice 0 at the first call), the
    # state moving with its parameters.
    sharded = "--node-aggregation=sharded"
    _, got = on_nodes(out, "node_sharded", sharded)
    check(all(g["x"] == got[0]["x"] for g in got), "node_sharded: the ranks differ")
    check(got[0]["x"] == json.load(open(f"{out}/node-rank-0.json"))["x"],
          "node_sharded: the sharded nodes' run differs from the leaders' (fp32 Adam, elementwise)")
    check(all("between step() and the next backward()" in g["said"].get("mid_step", "")
              for g in got), f"node_sharded: a call mid-step refused on every rank: {got}")
    # ZeroOneAdam's held group on sharded nodes: its slice's error buffers
    # (nonzero by then) carried through both calls.
    added, built_with = (on_nodes(out, m, sharded)[1]
                         for m in ("shard_zero_one", "shard_zero_one_built"))
    check(all(a["x"] == b["x"] == added[0]["x"] for a, b in zip(added, built_with)),
          "shard_zero_one: the group added at the 1-bit step differs from one added at the "
          "variance step, or the ranks differ")
    # OneBitLamb on sharded nodes: a.bias moves from slice 1 to slice 0
    # with its layer's coefficient state.
    _, got = on_nodes(out, "shard_lamb", sharded)
    check(all(g["x"] == got[0]["x"] for g in got), "shard_lamb: the ranks differ")
    check(all("since step 12, at or after freeze_step 6" in g["said"].get("frozen", "")
              for g in got), f"shard_lamb: refused past the freeze on every rank: {got[0]['said']}")
    # Node 0's layers' state before and after the call: a.bias's (node
    # parameter 1) moved from local rank 1 to local rank 0 with it.
    before, after = ({k: v for g in got[:2] for k, v in g["said"]["layers"][i].items()}
                     for i in (0, 1))
    moved = got[1]["said"]["layers"][0].keys() & got[0]["said"]["layers"][1].keys()
    check(moved == {"1"} and all(after[k] == before[k] for k in before),
          f"shard_lamb: the layers' state did not move with them: {before} then {after}")
    print("PASS node_sharded: under --node-aggregation=sharded the slices cut anew at each call, "
          "bit for bit the leaders' run, within 1e-5 of AdamW; ZeroOneAdam's held group as "
          "without nodes; OneBitLamb within 1e-5 of its rule through the warmup, its layers' "
          "state moving with them")
    # An elastic job (--min-workers 2 of 3): rank 2 leaves, the others add
    # a group without it.
    with open(config, "w") as f:
        f.write("timeouts { step_seconds: 3 recovery_seconds: 30 }\n")
    code, text = morse_run(__file__, 3, 2, "elastic", out, config=config,
                           extra=["--min-workers", "2"])
    print(text)
    check(code == 0 and "rank 2 leaves in step 3" in text, "elastic: the job failed")
    # The old layout's step 3 waited for rank 2 (on each shard); the new
    # layout's steps did not: they left it out from the start.
    check(text.count("completed without rank(s) 2") == 2,
          "elastic: a step of the new layout waited for rank 2")
    got = [json.load(open(f"{out}/elastic-rank-{r}.json")) for r in range(2)]
    check(got[0]["x"] == got[1]["x"] and got[0]["checksum"] == got[1]["checksum"],
          "elastic: ranks 0 and 1 differ")
    expected = [[0, 1, 2]] * ELASTIC_LEFT + [[0, 1]] * (9 - ELASTIC_LEFT)
    check(got[0]["members"] == expected == got[1]["members"],
          f"elastic: the memberships {got[0]['members']}, {got[1]['members']}")
    print("PASS elastic: a group added after rank 2 left trains without it, within 1e-5 of AdamW "
          "fed the members' average; the new layout's steps leave rank 2 out from the start")
    # --rank-restarts: rank 1 killed after both calls (at step 7: its
    # checkpoint of the second call's step 6 has both groups) and between
    # them (at step 6 before the call: back from its checkpoint of step 4,
    # it adds the first group, then the second with the others).
    for kill, back in ((7, 6), (6, 4)):
        with open(config, "w") as f:
            f.write("checkpoint { every_steps: 4 }\ntimeouts { recovery_seconds: 60 }\n")
        code, text = morse_run(__file__, 2, 2, f"restart:{kill}", out, config=config,
                               extra=["--rank-restarts", "1"])
        print(text)
        check(code == 0 and f"rank 1 kills itself at step {kill}" in text
              and f"rank 1 life 1 starts at step {back}" in text,
              f"restart:{kill}: the job failed, or rank 1 did not come back from step {back}")
        got = [json.load(open(f"{out}/restart-{kill}-rank-{r}.json")) for r in range(2)]
        undisturbed = results(out, "adam")[0]
        check(all(g["x"] == undisturbed["x"] and g["checksum"] == undisturbed["checksum"]
                  for g in got), f"restart:{kill}: a rank differs from the undisturbed run (adam)")
        said = got[1]["said"]
        check("call add_param_group with the others before the first backward()"
              in said.get("step", "") and "state_dict() on rank 1" in said.get("state_dict", "")
              and "add the groups the run added, in its order"
              in said.get("shape", ""), f"restart:{kill}: before the groups were back: {said}")
    # A shard killed after the step of the second call (at the top of step
    # 7): morse-run restarts it from the checkpoint it wrote once rank 0 had
    # restored the new layout at step 6 (its periodic one of step 4 is of
    # the old layout), and the workers replay step 6 to it.
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 4 }\ntimeouts { recovery_seconds: 60 }\n")
    code, text = morse_run(__file__, 2, 2, "restart:-7", out, config=config)
    print(text)
    check(code == 0 and "killed shard 1 at step 7" in text
          and "(a saved run restored at step 6)" in text
          and "resumed from" in text and "shard-1.ckpt at step 6" in text,
          "restart:-7: the job failed, or shard 1 did not resume from the new layout's step 6")
    got = [json.load(open(f"{out}/restart--7-rank-{r}.json")) for r in range(2)]
    check(all(g["x"] == undisturbed["x"] and g["checksum"] == undisturbed["checksum"]
              for g in got), "restart:-7: a rank differs from the undisturbed run (adam)")
    # Node 1 restarted (rank 3 killed after both calls): its leader (or,
    # sharded, each owner) back from its checkpoint of the second call,
    # every rank of the node adding the groups again.
    for mode, how, undisturbed in (("node_restart:7", "--node-aggregation", "node"),
                                   ("shard_restart:7", "--node-aggregation=sharded",
                                    "node_sharded")):
        with open(config, "w") as f:
            f.write("checkpoint { every_steps: 4 }\ntimeouts { recovery_seconds: 60 }\n")
        texts, got = on_nodes(out, mode, how, ("--rank-restarts", "1", "--config", config))
        check("rank 3 kills itself at step 7" in texts[1]
              and "rank 3 life 1 starts at step 6" in texts[1]
              and "rank 2 life 1 starts at step 6" in texts[1],
              f"{mode}: node 1 did not come back from step 6")
        whole = json.load(open(f"{out}/{undisturbed}-rank-0.json"))
        check(all(g["x"] == whole["x"] for g in got),
              f"{mode}: a rank differs from the undisturbed run ({undisturbed})")
    print("PASS restart: a rank restarted after add_param_group (from its checkpoint of the "
          "call's layout, the groups added again) and between two calls ends bit for bit as the "
          "undisturbed run, within 1e-5 of AdamW after every step; a step or a wrong group "
          "before the groups are back refused, saying what to do; a shard restarted after a "
          "call; a node restarted after the calls (leader's and sharded)")
    resume_checks(out)
