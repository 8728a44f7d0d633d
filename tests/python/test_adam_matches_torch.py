"""morse.torch.Adam with codec fp32, no feedback and bias correction, across
2 workers, gives the parameters torch.optim.Adam gives in one process fed the
averaged gradient, after every step, to 1e-5 absolute (the two evaluate the
same formula in different orders: Morse m/bc1 / (sqrt(v/bc2) + eps), torch
m / (sqrt(v)/sqrt(bc2) + eps) * lr/bc1). Several parameter shapes, several
partitions; built as a script swaps it in, morse.torch.AdamW given
torch.optim.AdamW's own arguments (its default weight decay, foreach,
capturable, under torch 2 a tensor lr). Then the same with torch's LambdaLR and StepLR schedulers and a
weight-decay change in param_groups mid-run, which Morse reads at every step
(against torch.optim.AdamW: Morse's weight decay is decoupled). And with
clip_grad_norm against torch.nn.utils.clip_grad_norm_ on the averaged
gradient; and the script's own torch.nn.utils.clip_grad_norm_ after
backward() (rank 0 overlapping and accumulating two backward() calls with
no argument, rank 1 with overlap=False), which clips the averaged gradient
and returns its norm, as under DDP, several times a step and with
norm_type inf and 1 too, and 3 and 0.5 (of the averaged gradient itself, which
the shards send no norm of), and over part of the parameters mixed with
clips of the whole (torch's factor per parameter; the shards' mirrors
checked after every step, as with OneBitAdam, ZeroOneAdam and OneBitLamb
through their phases); and .grad edited after backward() (a
row zeroed, everything halved, then clip_grad_norm_), which under DDP edits
the averaged gradient: linear edits give the same result on each rank's
gradient before the average, which Morse pushes at step() once the first
step showed the edits (also when made through .data, which moves no
version counter: the first step compares the bits). And DDP's no_sync() idiom: a step's batch in 1, 2 or
4 backward() calls, all but the last inside opt.no_sync() (every fifth
step all of them, so that step() pushes), rank 0 overlapping. And two
parameter groups with their own lr and weight_decay (Hugging Face's
decay / no-decay split, with a per-group LambdaLR and a group's lr changed
mid-run), against torch.optim.AdamW with the same groups. The modes that
read the averaged gradient (CUDA_MODES) run again with the models on the
GPU where there is one (`test_adam_matches_torch.py cuda`: those alone).
`test_adam_matches_torch.py surfaces` runs the modes that meet torch's own
code (SURFACES), as the torch2_ twin does."""
import contextlib
import os
import re
import sys
import warnings

import torch

from harness import check, has_cuda, morse_run


class Model(torch.nn.Module):
    def __init__(self, hidden=5):
        super().__init__()
        self.a = torch.nn.Linear(6, hidden)
        self.b = torch.nn.Linear(hidden, 3)
        self.t = torch.nn.Parameter(torch.randn(2, 3, 4) * 0.1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.t.sum(dim=(0, 2))


def data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


SURPRISE = 6  # the "late_*" modes' first step of the new idiom
TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def adopt(opt, reference, ref_opt):
    """Gives the torch reference Morse's parameters and Adam moments."""
    _, m, v, _ = opt._session.get_state()
    m, v = torch.from_numpy(m), torch.from_numpy(v)
    with torch.no_grad():
        for p, q, (lo, hi) in zip(reference.parameters(), opt._params, opt._ranges):
            p.copy_(q)
            state = ref_opt.state[p]
            state["exp_avg"].copy_(m[lo:hi].view_as(p))
            state["exp_avg_sq"].copy_(v[lo:hi].view_as(p))


# clip_twice's max_norms, in the order a step calls clip_grad_norm_ with them
# (norm_type 2); clip_orders's (max_norm, norm_type) pairs: the largest
# element logged, then clips by the largest element, the L1 and the L2 norm.
TWICE = tuple((m, 2.0) for m in (float("inf"), 0.25, 0.15, 0.3))
ORDERS = ((float("inf"), float("inf")), (0.08, float("inf")), (1.5, 1.0), (0.15, 2.0))
# clip_p's: norms of orders the shards send none of (the averaged gradient's,
# taken by the worker), the largest logged, then clips by each.
ORDERS_P = ((float("inf"), 3.0), (0.06, 3.0), (4.0, 0.5), (0.15, 2.0))
# clip_part's: clips of part of the model (max_norm, norm_type, which
# parameters), composed with clips of the whole as torch's.
PARTS = ((0.05, 2.0, "a"), (float("inf"), 2.0, "all"), (0.12, 2.0, "all"), (0.02, float("inf"), "t"),
         (0.1, 3.0, "a.weight b.bias"))


def chosen(model, which):
    """The parameters a PARTS call clips."""
    if which == "all":
        return list(model.parameters())
    if which == "a":
        return [model.a.weight, model.a.bias]
    if which == "t":
        return [model.t]
    return [model.get_parameter(name) for name in which.split()]


def edit_clipped(model, step):
    """edit_clip's and edit_part's edits of the clipped gradient, as a DDP
    script might make them after clip_grad_norm_: a layer's weight halved,
    a bias zeroed every other step, every third step a parameter scaled by
    0.3 through .data (no version counter moves), and in the other steps a
    weight divided by 3 (a div_ that no float32 factor gives bit for bit)
    and a bias doubled (a factor above 1)."""
    with torch.no_grad():
        model.a.weight.grad.mul_(0.5)
        if step % 2 == 0:
            model.b.bias.grad.zero_()
        else:
            model.b.weight.grad.div_(3)
            model.a.bias.grad.mul_(2.0)
        if step % 3 == 0:
            model.t.grad.data.mul_(0.3)


def edit_any(model, step):
    """edit_any's edits of the clipped gradient, as a DDP script might make
    them after clip_grad_norm_, which no factor per parameter gives: an add_
    and a clamp_, a row zeroed (part of a parameter) followed by a second
    clip, a whole weight halved (a factor) followed by a second clip, or
    nothing."""
    with torch.no_grad():
        if step % 4 == 0:
            model.a.weight.grad.add_(0.01)
            model.b.weight.grad.clamp_(-0.02, 0.02)
        elif step % 4 == 1:
            model.a.weight.grad[0].zero_()
        elif step % 4 == 2:
            model.a.weight.grad.mul_(0.5)
    if step % 4 in (1, 2):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)


def worker_part(kind, amend=False):
    """clip_grad_norm_ over the first layer, then the whole model, every
    step, with OneBitAdam, ZeroOneAdam or OneBitLamb through their warmup
    and compressing steps: the shards' mirrors hold the workers' x after
    every step (the averaging steps' clip pieces), the part's clip acts,
    and both ranks end with the same state. `amend`: a bias added to
    after the clips as well (the averaging steps amended, design.md 2.6;
    the compressing ones each rank's own, in torch's order)."""
    import morse.torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    kw = {"lr": 1e-3, "partition_elems": 256, "block_elems": 64}
    opt = {"onebit": lambda: morse.torch.OneBitAdam(model.parameters(), freeze_step=3, **kw),
           "zero_one": lambda: morse.torch.ZeroOneAdam(model.parameters(), var_freeze_step=3, **kw),
           "lamb": lambda: morse.torch.OneBitLamb(model.parameters(), freeze_step=3, **kw)}[kind]()
    rank = int(os.environ["MORSE_RANK"])
    acted = 0
    for step in range(10):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        acted += float(torch.nn.utils.clip_grad_norm_(list(model[0].parameters()), 0.05)) > 0.05
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        if amend:
            with torch.no_grad():
                model[2].bias.grad.add_(1e-3)
        opt.step()
        check(opt._session.holds_shards_model(),
              f"rank {rank} step {step} ({kind}): the shards' mirrors differ from the workers' x")
    check(acted >= 5, f"the part's clip acted in only {acted} of 10 steps")
    print(f"rank {rank}: {kind} with a clip of part of the model, 10 steps, mirrors equal, "
          f"checksum {opt.checksum()}")


def worker(mode):
    import morse.torch
    # "MODE@cuda": rank 0's and rank 1's models on the GPU (the reference
    # on the CPU), for the modes that read the averaged gradient.
    mode, _, where = mode.partition("@")
    device = torch.device(where or "cpu")
    if mode.startswith(("part_", "amend_")):
        worker_part(mode.split("_", 1)[1], amend=mode.startswith("amend_"))
        return
    if mode.startswith(("late_", "early_")):
        # "early_lr": the lr set between backward() and step() from step 0 on.
        early = mode.startswith("early_")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            worker_late(mode.split("_", 1)[1], 0 if early else SURPRISE)
        said = [str(w.message) for w in caught if str(w.message).startswith("morse:")]
        if early:
            check(not said, f"no warning: {said}")
            return
        check(len(said) == 1 and f"in step {SURPRISE} " in said[0],
              f"one warning naming step {SURPRISE}: {said}")
        print(f"warned: {said[0][:160]}...")
        return
    # "edit_learn": edit_any where .grad after the clip is first the rank's
    # own gradient, as on CUDA tensors (edit_any@cuda does the same there):
    # the step of the first edit trains without it, warning, and the steps
    # after it as DDP's (the reference leaves that edit out).
    learns = mode == "edit_learn" or (mode == "edit_any" and where == "cuda")
    if mode == "edit_learn":
        mode = "edit_any"
    schedules, accumulate, clip = mode == "schedules", mode == "accumulate", mode == "clip"
    # The script's own clip_grad_norm_ after backward(), as under DDP.
    clip_after = mode == "clip_after"
    # clip_grad_norm_ three times a step (the norm logged with inf, then two
    # clips), each as torch's on the gradient the earlier ones clipped.
    clip_twice = mode in ("clip_twice", "clip_orders", "clip_p", "clip_part")
    calls = PARTS if mode == "clip_part" else [
        (m, o, "all") for m, o in {"clip_orders": ORDERS, "clip_p": ORDERS_P}.get(mode, TWICE)]
    edit = mode in ("edit", "edit_data")  # .grad edited after backward(), then clipped
    # .grad scaled or zeroed after clip_grad_norm_ (of the whole model, or
    # of part of it), as DDP's clipped average would be.
    edit_after = mode in ("edit_clip", "edit_part", "edit_any")
    # Any edit after it ("edit_any": additions, clamps, rows, a second clip).
    edit_clipped_by = edit_any if mode == "edit_any" else edit_clipped
    clip_then_edit = mode in ("edit_clip", "edit_any")
    limit = 0.1 if edit else 0.2  # clips most steps
    torch.manual_seed(1)
    model = Model().to(device)
    rank = int(os.environ["MORSE_RANK"])
    # Rank 0 pushes from the backward pass, rank 1 at step(): the same bits.
    # "accumulate": each rank's batch in two backward() calls of half the
    # rows; rank 0 overlaps with no accumulation argument (the first step
    # teaches it 2) and torch 2's model.zero_grad(set_to_none=True), rank 1
    # passes accumulation_steps=2.
    groups = mode in ("groups", "group_betas")
    # "groups": the biases do not decay and learn faster, the rest decays
    # (the split Hugging Face's Trainer makes): 8 elements padded to a
    # block of 16, then 69, so shard 0 holds both groups.
    # "group_betas": the same groups, the biases with their own betas and
    # eps as well (Adam follows each group's).
    own = {"betas": (0.8, 0.99), "eps": 1e-4} if mode == "group_betas" else {}
    split = lambda m: [  # noqa: E731
        {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0, "lr": 0.02, **own},
        {"params": [m.a.weight, m.b.weight, m.t], "weight_decay": 0.1}]
    # "constant": the one-line swap, torch.optim.AdamW(...) ->
    # morse.torch.AdamW(...) with AdamW's own arguments: its default weight
    # decay (0.01), torch's choice of implementation and, under torch 2, a
    # tensor lr. The other modes: morse.torch.Adam against AdamW without
    # weight decay (the same update at 0).
    swap = mode == "constant"
    torch_args = dict(lr=0.01, weight_decay=0.0)
    if swap:
        torch_args = dict(lr=torch.tensor(0.01) if TORCH2 else 0.01, foreach=False, capturable=False)
    opt = (morse.torch.AdamW if swap else morse.torch.Adam)(
        split(model) if groups else model.parameters(), **torch_args,
        block_elems=16, partition_elems=32,
        overlap=rank == 0,
        accumulation_steps=2 if accumulate and rank == 1 else None,
        clip_grad_norm=0.2 if clip else None)
    if learns and where != "cuda":
        opt._shows_average = False  # as it starts on CUDA tensors
    # The warnings of the run, for edit_any's (learns: one; else none).
    recorder = warnings.catch_warnings(record=True)
    recorded = recorder.__enter__()
    warnings.simplefilter("always")
    world = int(os.environ["MORSE_WORLD_SIZE"])
    reference = Model()
    reference.load_state_dict(model.state_dict())  # rank 0's values, which everyone now has
    # Morse's weight decay is decoupled, as AdamW's (identical to Adam at 0).
    ref_opt = torch.optim.AdamW(split(reference) if groups else reference.parameters(),
                                **torch_args)
    schedulers = []
    if groups:
        for o in (opt, ref_opt):  # each group its own schedule
            schedulers.append(torch.optim.lr_scheduler.LambdaLR(
                o, [lambda t: min(1.0, (t + 1) / 4), lambda t: 0.9 ** t]))
    if mode == "one_cycle":
        # OneCycleLR as users build it: lr up and down, and betas[0] cycled
        # the other way (cycle_momentum=True, its default).
        for o in (opt, ref_opt):
            schedulers.append(torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=20))
    betas_seen = set()
    if schedules:
        # Linear warmup over 4 steps, then halving every 6, on both sides.
        for o in (opt, ref_opt):
            warm = torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 4))
            schedulers.append(warm)
            schedulers.append(torch.optim.lr_scheduler.StepLR(o, step_size=6, gamma=0.5))
    worst = 0.0
    clipped = clamped = 0
    for step in range(20):
        if schedules and step == 10:
            for o in (opt, ref_opt):  # a manual change of the weight decay
                o.param_groups[0]["weight_decay"] = 0.05
        if groups and step == 10:
            for o in (opt, ref_opt):  # one group's weight decay changed
                o.param_groups[1]["weight_decay"] = 0.05
        x, y = (t.to(device) for t in data(opt.rank, step))
        if mode == "no_sync":
            # k backward() calls of 16/k rows each, as DDP scripts do with
            # model.no_sync() around all but the last.
            k = (1, 2, 4)[step % 3]
            opt.zero_grad()
            for j in range(k):
                part = slice(j * 16 // k, (j + 1) * 16 // k)
                last = j == k - 1 and step % 5 != 4
                with (contextlib.nullcontext() if last else opt.no_sync()):
                    (torch.nn.functional.cross_entropy(model(x[part]), y[part]) / k).backward()
        elif accumulate or ((clip_after or clip_twice) and rank == 0):
            if rank == 0:
                model.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()
            for half in (slice(0, 8), slice(8, 16)):
                (torch.nn.functional.cross_entropy(model(x[half]), y[half]) / 2).backward()
        else:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if edit:
            with torch.no_grad():
                if mode == "edit_data":  # the old idiom, through .data: no version counter moves
                    model.a.weight.grad.data[0].zero_()
                    for p in model.parameters():
                        p.grad.data.mul_(0.5)
                else:
                    model.a.weight.grad[0].zero_()
                    for p in model.parameters():
                        p.grad.mul_(0.5)
        if clip_after or edit or clip_then_edit:
            returned = torch.nn.utils.clip_grad_norm_(model.parameters(), limit).item()
        if mode == "edit_part":
            returned = torch.nn.utils.clip_grad_norm_([model.a.weight, model.a.bias], 0.05).item()
        if edit_after:
            edit_clipped_by(model, step)
        if clip_twice:
            returned = [torch.nn.utils.clip_grad_norm_(chosen(model, w), m, norm_type=o).item()
                        for m, o, w in calls]
        opt.step()
        if mode in ("clip_part", "edit_clip", "edit_part", "edit_any"):
            # The shards' mirrors applied the step's clip pieces too: each
            # partition's hash of x equal to this rank's.
            check(opt._session.holds_shards_model(),
                  f"rank {rank} step {step}: the shards' mirrors differ from the workers' x")
        if accumulate:
            check(opt.accumulation_steps == 2, f"rank {rank}: accumulation_steps {opt.accumulation_steps} "
                                               "after a step of two backward() calls")
        grads = []
        for r in range(world):
            reference.zero_grad()
            xr, yr = data(r, step)
            torch.nn.functional.cross_entropy(reference(xr), yr).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for p, *gs in zip(reference.parameters(), *grads):
            total = torch.zeros_like(p)
            for g in gs:
                total += g
            p.grad = total / world
        if edit:  # DDP edits the averaged gradient
            with torch.no_grad():
                reference.a.weight.grad[0].zero_()
                for p in reference.parameters():
                    p.grad.mul_(0.5)
        if mode == "edit_part":
            norm = morse.torch._TORCH_CLIP_GRAD_NORM([reference.a.weight, reference.a.bias],
                                                     0.05).item()
            clipped += norm > 0.05
            check(abs(returned - norm) <= 1e-5 * norm, f"rank {opt.rank} step {step}: "
                  f"clip_grad_norm_ returned {returned}, torch's on the global batch {norm}")
        if clip or clip_after or edit or clip_then_edit:  # torch's clip on the global batch's gradient
            norm = morse.torch._TORCH_CLIP_GRAD_NORM(reference.parameters(), limit).item()
            clipped += norm > limit
            # last_step's grad_norm: the averaged gradient's, as torch's.
            got = opt.last_step.get("grad_norm")
            check(got is not None and abs(got - norm) <= 1e-5 * norm,
                  f"rank {opt.rank} step {step}: last_step grad_norm {got}, torch's {norm}")
            if clip_after or edit or clip_then_edit:  # what clip_grad_norm_ returned: DDP's, the average's
                check(abs(returned - norm) <= 1e-5 * norm,
                      f"rank {opt.rank} step {step}: clip_grad_norm_ returned {returned}, "
                      f"torch's on the global batch {norm}")
        if clip_twice:
            norms = [morse.torch._TORCH_CLIP_GRAD_NORM(chosen(reference, w), m, norm_type=o).item()
                     for m, o, w in calls]
            # the first finite one and a later one both clip
            first = 0 if mode == "clip_part" else 1
            clipped += norms[first] > calls[first][0] and any(
                n > m for n, (m, _, _) in zip(norms[first + 1:], calls[first + 1:]))
            for i, (got, want) in enumerate(zip(returned, norms)):
                check(abs(got - want) <= 1e-5 * want,
                      f"rank {opt.rank} step {step}: clip_grad_norm_ call {i} returned {got}, "
                      f"torch's {want}")
        if edit_after and not (learns and step == 0):  # DDP's edit of the clipped average
            edit_clipped_by(reference, step)
        betas_seen.add(tuple(opt.param_groups[0]["betas"]))
        ref_opt.step()
        for sched in schedulers:
            sched.step()
        if mode == "weights":
            # Weights changed after a step, as DDP scripts do: a WGAN critic's
            # clamp_ after every step, and halved weights loaded at step 10.
            with torch.no_grad():
                clamped += sum(int((p.abs() > 0.2).sum()) for p in model.parameters())
                for m_ in (model, reference):
                    if step == 10:
                        m_.load_state_dict({k: v * 0.5 for k, v in m_.state_dict().items()})
                    for p in m_.parameters():
                        p.clamp_(-0.2, 0.2)
        diff = max((a.detach().cpu() - b).abs().max().item()
                   for a, b in zip(model.parameters(), reference.parameters()))
        worst = max(worst, diff)
        check(diff <= 1e-5, f"rank {opt.rank} step {step}: max |morse - torch| = {diff}")
    recorder.__exit__(None, None, None)
    said = [str(w.message) for w in recorded if str(w.message).startswith("morse:")]
    if learns:
        check(len(said) == 1 and said[0].startswith("morse: in step 0 .grad was edited after "
                                                     "clip_grad_norm_"),
              f"rank {rank}: one warning, of step 0's edit: {said}")
    elif mode == "edit_any":
        check(not said, f"rank {rank}: no warning: {said}")
    if clip or clip_after or edit or edit_after:
        check(clipped >= 10, f"the clip acted in only {clipped} of 20 steps")
    if clip_twice:
        check(clipped >= 5, f"both clips acted in only {clipped} of 20 steps")
    if mode == "weights":
        check(clamped > 0, "the clamp never acted")
    if mode == "one_cycle":
        check(len(betas_seen) >= 15, f"OneCycleLR moved betas in only {len(betas_seen)} steps")
    what = {"schedules": "with LambdaLR, StepLR and a weight-decay change",
            "accumulate": "accumulating two backward() calls, rank 0 with no argument and "
                          "zero_grad(set_to_none=True)",
            "clip": f"clip_grad_norm=0.2, which clipped {clipped} steps",
            "clip_after": f"clip_grad_norm_(params, 0.2) after backward(), which clipped "
                          f"{clipped} steps",
            "edit": f".grad edited after backward(), then clip_grad_norm_, which clipped "
                    f"{clipped} steps",
            "edit_data": f".grad edited through .data after backward(), then clip_grad_norm_, "
                         f"which clipped {clipped} steps",
            "edit_clip": f"clip_grad_norm_(params, 0.2), which clipped {clipped} steps, then "
                         ".grad scaled or zeroed per parameter (mul_ by 0.5 and 2, div_ by 3, "
                         "zero_, through .data)",
            "edit_any": f"clip_grad_norm_(params, 0.2), which clipped {clipped} steps, then "
                        ".grad edited otherwise than by factors (add_, clamp_, a row zeroed, then a "
                        "second clip)",
            "edit_part": f"clip_grad_norm_ of the first layer, which clipped {clipped} steps, then "
                         ".grad scaled or zeroed per parameter (mul_ by 0.5 and 2, div_ by 3, "
                         "zero_, through .data)",
            "clip_part": f"clip_grad_norm_ over part of the parameters and the whole, (max_norm, "
                         f"norm_type, which) {PARTS} in turn after backward(), the first and a later "
                         f"one clipping in {clipped} steps",
            "clip_twice": f"clip_grad_norm_ with max_norm {[m for m, _ in TWICE]} in turn after "
                          f"backward(), the first two finite ones clipping in {clipped} steps",
            "clip_orders": f"clip_grad_norm_ with (max_norm, norm_type) {ORDERS} in turn after "
                           f"backward(), the first finite one and a later one clipping in {clipped} "
                           "steps",
            "clip_p": f"clip_grad_norm_ with (max_norm, norm_type) {ORDERS_P} in turn after "
                      f"backward(), the first finite one and a later one clipping in {clipped} "
                      "steps",
            "one_cycle": f"OneCycleLR cycling lr and betas[0] ({len(betas_seen)} betas)",
            "no_sync": "1, 2 or 4 backward() calls a step, all but the last in opt.no_sync()",
            "groups": "two parameter groups with their own lr, weight_decay and LambdaLR",
            "group_betas": "two parameter groups with their own lr, weight_decay, LambdaLR, betas "
                           "and eps",
            "weights": f"weights clamp_()ed after every step ({clamped} elements clamped) and "
                       "halved weights loaded after step 10",
            "constant": f"morse.torch.AdamW for torch.optim.AdamW, the same arguments "
                        f"({', '.join(f'{k}={v!r}' for k, v in torch_args.items())}; weight_decay "
                        f"{ref_opt.param_groups[0]['weight_decay']!r}, AdamW's default)",
            }.get(mode, mode)
    if learns:
        what += ", .grad after the clip first the rank's own (step 0's edit left out, warned)"
    print(f"rank {opt.rank}: 20 steps ({what}{', on CUDA tensors' if where else ''}), largest "
          f"difference from torch.optim.Adam {worst:.2e}")


def worker_late(kind, start):
    """A script that begins, in step SURPRISE, to do after backward() what
    the first steps did not ("edit": .grad edited; "edit_data": a small
    parameter's .grad halved through .data, which moves no version counter
    and shows in the sample of bits the step compares; "clip": clip_grad_norm_;
    "lr": lr set between backward() and step(); "again": two backward()
    calls where the first steps had one; "again_no_sync": a second
    backward() outside no_sync()), and goes on doing it. That step used the
    gradients as they were pushed; every other step equals torch on the
    global batch (the reference adopts Morse's state after that step). With
    start 0 every step equals torch's, and nothing is said."""
    import morse.torch
    # "edit_data": 427 elements in one partition a shard, of which the step
    # compares a sample (one in 3, every parameter's first and last).
    hidden = 40 if kind == "edit_data" else 5
    torch.manual_seed(1)
    model = Model(hidden)
    rank = int(os.environ["MORSE_RANK"])
    world = int(os.environ["MORSE_WORLD_SIZE"])
    opt = morse.torch.Adam(model.parameters(), lr=0.01, block_elems=16,
                           partition_elems=1024 if kind == "edit_data" else 32)
    check(kind != "edit_data" or opt._sample_index.numel() < 250,
          f"a sample of {opt._sample_index.numel()} of the 427 elements")
    reference = Model(hidden)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    worst = 0.0

    def loss(m, x, y, rows):
        return torch.nn.functional.cross_entropy(m(x[rows]), y[rows]) * (rows.stop - rows.start) / 16

    for step in range(16):
        late = step >= start
        x, y = data(rank, step)
        opt.zero_grad()
        if kind == "again" and late:
            loss(model, x, y, slice(0, 8)).backward()
            loss(model, x, y, slice(8, 16)).backward()
        elif kind == "again_no_sync":
            with opt.no_sync():
                loss(model, x, y, slice(0, 8)).backward()
            if late:
                loss(model, x, y, slice(8, 12)).backward()
                loss(model, x, y, slice(12, 16)).backward()
            else:
                loss(model, x, y, slice(8, 16)).backward()
        else:
            loss(model, x, y, slice(0, 16)).backward()
        lr = 0.01 * 0.8 ** max(0, step - start + 1) if kind == "lr" else 0.01
        if late and kind == "edit":
            with torch.no_grad():
                model.a.weight.grad[0].zero_()
                for p in model.parameters():
                    p.grad.mul_(0.5)
        if late and kind == "edit_data":  # through .data: no version counter moves
            model.b.bias.grad.data.mul_(0.5)  # 3 elements, the first and last in the sample
            model.a.weight.grad.data[20:].mul_(0.5)
        if late and kind == "clip":
            returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        reference.zero_grad()
        grads = []
        for r in range(world):
            xr, yr = data(r, step)
            reference.zero_grad()
            torch.nn.functional.cross_entropy(reference(xr), yr).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for p, *gs in zip(reference.parameters(), *grads):
            p.grad = sum(gs) / world
        with torch.no_grad():
            if late and kind == "edit":
                reference.a.weight.grad[0].zero_()
                for p in reference.parameters():
                    p.grad.mul_(0.5)
            if late and kind == "edit_data":
                reference.b.bias.grad.mul_(0.5)
                reference.a.weight.grad[20:].mul_(0.5)
        if late and kind == "clip":
            norm = morse.torch._TORCH_CLIP_GRAD_NORM(reference.parameters(), 0.1).item()
            if step > start:  # DDP's: the averaged gradient's norm
                check(abs(returned - norm) <= 1e-5 * norm,
                      f"rank {rank} step {step}: clip_grad_norm_ returned {returned}, torch's {norm}")
        ref_opt.param_groups[0]["lr"] = lr
        ref_opt.step()
        if start and step == start:
            adopt(opt, reference, ref_opt)  # this step had the pushed gradients
            continue
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        worst = max(worst, diff)
        check(diff <= 1e-5, f"rank {rank} step {step} ({kind}): max |morse - torch| = {diff}")
    print(f"rank {rank}: 16 steps, '{kind}' from step {start} on, largest difference from "
          f"torch.optim.Adam {worst:.2e}" + (f" outside step {start}" if start else ""))


# The modes that read the averaged gradient (norms of other orders, clips of
# part of the model, scalings after the clip), again with the models on the
# GPU: the replies read where the engine stages them (Engine::StagedReply;
# `test_adam_matches_torch.py cuda` runs these alone; without a GPU they
# are skipped, saying so).
CUDA_MODES = ("clip_p", "clip_part", "edit_clip", "edit_part", "edit_any")
# `test_adam_matches_torch.py surfaces` (the torch2_ twin, under torch 2.x;
# tests/python/CMakeLists.txt): the modes torch's own code is on the path
# of, each once: torch.optim.AdamW and its schedulers, param_groups,
# clip_grad_norm_ of every norm order, zero_grad(set_to_none=True), .grad
# edits with and without a version counter, no_sync() and the hooks, a
# clip and an lr change learned mid-run. The others vary Morse's own
# arithmetic over the same calls (more clips, edits after a clip, each
# optimizer's mirrors), which does not depend on torch's version.
SURFACES = ("constant", "schedules", "accumulate", "clip_after", "clip_orders", "edit", "edit_data",
            "no_sync", "late_clip", "late_lr", "groups", "weights", "one_cycle", "group_betas")


def run_modes(modes):
    for mode in modes:
        code, out = morse_run(__file__, 2, 2, mode)
        print(out)
        check(code == 0, f"the job failed ({mode})")
        check(out.count("largest difference from torch.optim.Adam") == 2, "both ranks report")
        if mode.startswith("late_"):
            check(out.count("warned: morse: in step") == 2, "both ranks warned")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    if sys.argv[1:] == ["cuda"]:
        if not has_cuda("the modes that read the averaged gradient on CUDA tensors"):
            sys.exit(77)
        run_modes([f"{m}@cuda" for m in CUDA_MODES])
        print("PASS")
        sys.exit(0)
    if sys.argv[1:] == ["surfaces"]:
        run_modes(SURFACES)
        print("PASS")
        sys.exit(0)
    run_modes(("constant", "schedules", "accumulate", "clip", "clip_after", "clip_twice", "clip_orders",
                 "clip_p", "clip_part", "edit", "edit_data", "edit_clip", "edit_part", "edit_any", "edit_learn", "no_sync",
                 "late_edit", "late_edit_data", "late_clip", "late_lr", "late_again", "late_again_no_sync", "early_lr", "groups",
                 "weights", "one_cycle", "group_betas"))
    if has_cuda("the modes that read the averaged gradient on CUDA tensors"):
        run_modes([f"{m}@cuda" for m in CUDA_MODES])
    for kind in ("onebit", "zero_one", "lamb"):
        for variant in ("part", "amend"):
            code, out = morse_run(__file__, 2, 2, f"{variant}_{kind}")
            print(out)
            check(code == 0, f"the job failed ({variant}_{kind})")
            sums = set(re.findall(r"mirrors equal, checksum ([0-9a-f]+)", out))
            check(out.count("mirrors equal") == 2 and len(sums) == 1,
                  f"both ranks alike ({variant}_{kind})")
    print("PASS")
