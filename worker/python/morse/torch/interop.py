"""A morse.torch optimizer's saved state as torch.optim's: the way back
from Morse to DDP + torch.optim.AdamW (or any torch.optim.Adam-style
optimizer) without losing Adam's moments. The way in is the Morse
optimizers' load_state_dict, which takes torch.optim's state
(_MorseOptimizer._from_per_parameter)."""
import torch


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
    for group, indices in zip(saved["param_groups"], numbered):
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
