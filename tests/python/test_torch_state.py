"""Going on from a torch.optim run: a state_dict saved parameter by
parameter (torch.optim.AdamW here, saved once, as a DDP script or Trainer
saves it on rank 0, and loaded by every rank) restores a morse.torch
optimizer at the saved step with the saved moments.

- `adamw`: 3 steps of DDP + AdamW (in one process, fed the ranks' averaged
  gradient), saved; then morse.torch.Adam on 2 ranks loads the weights and
  that file and trains 5 more steps: within 1e-5 of the same AdamW going on
  after every step (Morse's Adam and torch's evaluate the formula in
  different orders, as test_adam_matches_torch says), its moments too. The
  model has two groups (Hugging Face's decay / no-decay split) and a frozen
  parameter among the first group's (in torch's numbering, without state).
  Each rank also checks the refusals first (nothing restored by them): a
  torch.optim.SGD state, AMSGrad, a moment of the wrong shape, parameters
  at different steps, a trained parameter without state, other groups; and
  a DeepSpeed-style state (an int step, its error buffers) loads with one
  warning saying the error buffers start at zero; torch 2's Adam with an L2
  weight decay (decoupled_weight_decay False) with one saying Morse's is
  decoupled; and a torch state saved before its first step sets the groups
  alone.
- `onebit`, `zero_one`: the same file into OneBitAdam (freeze_step 2) and
  ZeroOneAdam (var_freeze_step 2), so their compressed phase starts from
  AdamW's moments: v (frozen there) is torch's exp_avg_sq in every
  parameter's place after 5 steps, and the shards' mirrors hold the
  workers' x after every step, both ranks alike.
- The way back: each `adamw` run's state at its end, converted by
  morse.torch.torch_optim_state_dict (rank 0's; the sharded node's two
  slices together), loaded into torch.optim.AdamW, which goes on 3 steps
  within 1e-5 of the AdamW run that took every step itself; one slice alone refused.
- Then `adamw` on one node of 2 ranks, --node-aggregation=sharded (each
  rank loads its slice's moments from the whole file), and `onebit` with
  the leader stepping for the node (the other rank takes the step alone).
(OneBitLamb's refusal is in test_resume.)"""
import os
import sys
import tempfile
import warnings

import torch

from harness import check, morse_run

SAVED_AT, STEPS, BACK = 3, 8, 3
LR = 0.01
BETAS, EPS = (0.9, 0.95), 1e-7  # not the defaults: the saved ones must win, as in torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.t = torch.nn.Parameter(torch.randn(2, 3, 4) * 0.1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.t.sum(dim=(0, 2))


def groups(m):
    """The biases do not decay; the frozen parameter sits among the first
    group's, as model.parameters() lists a frozen layer."""
    return [{"params": [m.a.bias, m.frozen, m.b.bias], "weight_decay": 0.0},
            {"params": [m.a.weight, m.b.weight, m.t], "weight_decay": 0.1}]


def data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def ddp_step(model, opt, step):
    """One DDP + AdamW step in one process: the 2 ranks' average gradient."""
    grads = []
    for rank in range(2):
        model.zero_grad()
        x, y = data(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
    for p, g0, g1 in zip(model.parameters(), *grads):
        p.grad = None if g0 is None else (g0 + g1) / 2
    opt.step()


def reference(out):
    """The DDP + AdamW run: the checkpoint at SAVED_AT, then every step's
    weights and the moments at the end."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=BETAS, eps=EPS)
    for step in range(SAVED_AT):
        ddp_step(model, opt, step)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{out}/ckpt.pt")
    weights = {}
    for step in range(SAVED_AT, STEPS + BACK):
        ddp_step(model, opt, step)
        weights[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if step == STEPS - 1:
            moments = {n: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                       for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"weights": weights, "moments": moments}, f"{out}/reference.pt")


def refused(opt, state_dict, words, what):
    try:
        opt.load_state_dict(state_dict)
    except ValueError as e:
        check(all(w in str(e) for w in words), f"{what}: {e}")
        return
    check(False, f"{what} was loaded")


def refusals(opt, saved):
    """What Morse cannot continue exactly is refused, naming why."""
    import copy
    state, groups_saved = saved["state"], saved["param_groups"]

    def edited(change):
        d = copy.deepcopy(saved)
        change(d)
        return d
    sgd = {"state": {i: {"momentum_buffer": torch.zeros(1)} for i in state},
           "param_groups": groups_saved}
    refused(opt, sgd, ["no exp_avg and exp_avg_sq", "momentum_buffer"], "an SGD state")
    refused(opt, edited(lambda d: d["param_groups"][1].update(amsgrad=True)),
            ["amsgrad=True"], "an AMSGrad state")
    first = min(state)
    refused(opt, edited(lambda d: d["state"][first].update(exp_avg=torch.zeros(7))),
            ["has shape (7,)"], "a moment of another shape")
    refused(opt, edited(lambda d: d["state"][first].update(step=torch.tensor(2.0))),
            ["different steps", "step 2", "step 3"], "parameters at different steps")
    refused(opt, edited(lambda d: d["state"].pop(first)),
            ["has no state"], "a trained parameter without state")
    refused(opt, edited(lambda d: d["param_groups"].pop()),
            ["1 parameter groups", "the optimizer 2"], "one group of two")
    if opt.rank == 0:  # (rank 1 may see the step rank 0 restored the shards at)
        left = opt.state_dict()["state"]
        check(opt.step_index == 0 and float(left["exp_avg"].abs().max()) == 0,
              f"a refusal restored something: step {opt.step_index}")


def worker(mode):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    out = os.environ["TORCH_STATE_DIR"]
    saved = torch.load(f"{out}/ckpt.pt")
    ref = torch.load(f"{out}/reference.pt")
    torch.manual_seed(5)  # other weights: the checkpoint's must be loaded
    model = Model()
    model.load_state_dict(saved["model"])
    kw = dict(lr=0.5, block_elems=16, partition_elems=32)  # lr: the saved groups' win
    opt = {"adamw": lambda: morse.torch.Adam(groups(model), **kw),
           "onebit": lambda: morse.torch.OneBitAdam(groups(model), freeze_step=2, **kw),
           "zero_one": lambda: morse.torch.ZeroOneAdam(groups(model), var_freeze_step=2, **kw),
           }[mode]()
    if mode == "adamw":
        refusals(opt, saved["opt"])
        fresh = torch.optim.AdamW(groups(Model()), lr=0.03).state_dict()
        opt.load_state_dict(fresh)
        check(opt.param_groups[0]["lr"] == 0.03, "a state before the first step set no lr")
        deepspeed = {"state": {i: dict(s, step=int(s["step"]), worker_error=torch.ones(8),
                                       server_error=torch.ones(4))
                               for i, s in saved["opt"]["state"].items()},
                     "param_groups": saved["opt"]["param_groups"]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(deepspeed)
        said = [str(w.message) for w in caught if "morse:" in str(w.message)]
        check(len(said) == 1 and "start at zero" in said[0], f"one warning: {said}")
        check(float(opt.state_dict()["state"]["worker_error"].abs().max()) == 0,
              "the worker error buffer is not zero")
        coupled = {"state": saved["opt"]["state"], "param_groups": [
            dict(g, decoupled_weight_decay=False) for g in saved["opt"]["param_groups"]]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(coupled)  # torch 2's Adam with an L2 weight decay in group 1
        said = [str(w.message) for w in caught if "morse:" in str(w.message)]
        check(len(said) == 1 and "group(s) [1]" in said[0] and "decoupled" in said[0],
              f"one warning for the L2 weight decay: {said}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved["opt"])
    said = [str(w.message) for w in caught if "morse:" in str(w.message)]
    check(not said, f"AdamW's state loaded with warnings: {said}")
    check(opt.step_index == SAVED_AT, f"resumed at step {opt.step_index}")
    check(opt.param_groups[0]["lr"] == LR, f"lr {opt.param_groups[0]['lr']}, saved {LR}")
    names = dict(model.named_parameters())
    worst = 0.0
    for step in range(SAVED_AT, STEPS):
        x, y = data(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        check(opt._session is None or opt._session.holds_shards_model(),
              f"rank {rank} step {step}: the shards' mirrors differ from the workers' x")
        if mode == "adamw":
            diff = max(float((names[n] - w).abs().max()) for n, w in ref["weights"][step].items())
            check(diff <= 1e-5, f"rank {rank} step {step}: max |morse - AdamW| = {diff}")
            worst = max(worst, diff)
    if mode == "adamw":
        print(f"rank {rank}: weights within {worst:.1e} of AdamW's after every step", flush=True)
    state = opt.state_dict()["state"]
    if mode == "adamw":  # for the way back (back_to_adamw)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   f"{out}/morse-{os.environ.get('LOCAL_RANK', rank)}.pt")
    if opt._session is None:  # a node's rank that the leader steps for: no moments
        print(f"rank {rank}: {mode} from AdamW's state at step {SAVED_AT}, {STEPS - SAVED_AT} "
              f"steps, mirrors equal, checksum {opt.checksum()}", flush=True)
        return
    name_of = {id(p): n for n, p in model.named_parameters()}
    for p, (lo, hi) in zip(opt._params, opt._ranges):  # (a sharded node's: its slice's)
        name = name_of[id(p)]
        m, v = ref["moments"][name]
        if mode == "adamw":
            for what, mine, theirs in (("exp_avg", state["exp_avg"], m),
                                       ("exp_avg_sq", state["exp_avg_sq"], v)):
                diff = float((mine[lo:hi] - theirs.reshape(-1)).abs().max())
                check(diff <= 1e-6 * max(1.0, float(theirs.abs().max())),
                      f"rank {rank}: {name}'s {what} {diff} from AdamW's")
        else:  # v frozen since the load: AdamW's at the checkpoint, in its place
            saved_v = saved["opt"]["state"][_index(saved["opt"], model, name)]["exp_avg_sq"]
            check(torch.equal(state["exp_avg_sq"][lo:hi], saved_v.reshape(-1)),
                  f"rank {rank}: {name}'s frozen exp_avg_sq is not the loaded one in its place")
    print(f"rank {rank}: {mode} from AdamW's state at step {SAVED_AT}, {STEPS - SAVED_AT} steps, "
          f"mirrors equal, checksum {opt.checksum()}", flush=True)


def back_to_adamw(out, how):
    """The way back: the Morse run's state after step STEPS - 1 (rank 0's,
    or both slices' of the sharded node) as torch.optim.AdamW's, loaded
    with the weights into DDP + AdamW, which goes on BACK steps within 1e-5
    of the AdamW run that took every step itself."""
    import morse.torch
    ref = torch.load(f"{out}/reference.pt")
    saved = [torch.load(f"{out}/morse-{k}.pt") for k in range(2 if how == "sharded" else 1)]
    model = Model()
    model.load_state_dict(saved[0]["model"])
    opt = torch.optim.AdamW(groups(model), lr=0.5)
    opt.load_state_dict(morse.torch.torch_optim_state_dict(*[s["opt"] for s in saved]))
    check(opt.param_groups[0]["lr"] == LR, f"lr {opt.param_groups[0]['lr']}, saved {LR}")
    if how == "sharded":  # one slice alone is refused, naming what to give
        try:
            morse.torch.torch_optim_state_dict(saved[1]["opt"])
            check(False, "one slice of two was converted")
        except ValueError as e:
            check("its 2 slices' together" in str(e), str(e))
    names = dict(model.named_parameters())
    worst = 0.0
    for step in range(STEPS, STEPS + BACK):
        ddp_step(model, opt, step)
        worst = max([worst] + [float((names[n] - w).abs().max())
                               for n, w in ref["weights"][step].items()])
    check(worst <= 1e-5, f"AdamW from Morse's state ({how}): max |x - AdamW's| = {worst}")
    print(f"AdamW from morse.torch.Adam's state ({how or 'flat'}): {BACK} steps within {worst:.1e} "
          "of the AdamW run that took every step itself")


def _index(saved, model, name):
    """`name`'s index in torch's numbering of the groups' parameters."""
    listed = [p for g in groups(model) for p in g["params"]]
    position = [i for i, p in enumerate(listed) if p is dict(model.named_parameters())[name]][0]
    return [i for g in saved["param_groups"] for i in g["params"]][position]


def main():
    out = tempfile.mkdtemp()
    os.environ["TORCH_STATE_DIR"] = out
    reference(out)
    for mode, how in (("adamw", None), ("onebit", None), ("zero_one", None),
                      ("adamw", "sharded"), ("onebit", "leader")):
        extra = () if how is None else (f"--node-aggregation={how}",)
        code, text = morse_run(__file__, 2, 2, mode, timeout=180, extra=extra)
        print(text[-2500:])
        check(code == 0, f"the {mode} run failed")
        sums = {line.rsplit(" ", 1)[-1] for line in text.splitlines() if "mirrors equal" in line}
        # (A sharded node's ranks each sum their own slice's job.)
        check(text.count("mirrors equal") == 2 and (len(sums) == 1 or how == "sharded"),
              f"{mode}: both ranks end with one checksum: {sums}")
        if mode == "adamw":
            back_to_adamw(out, how)
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    main()
