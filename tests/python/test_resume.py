"""Resume in one call: a run saved with torch.save(opt.state_dict()) at step
4 and restored in a fresh job (new shards, new processes) with
model.load_state_dict + opt.load_state_dict continues bit-identically to
the run that never stopped (OneBitAdam and OneBitLamb, each across the
freeze, 2 workers, 2 shards; OneBitLamb's state_dict carries v', the
layers' state and the last commit; and OneBitAdam and OneBitLamb with two
parameter groups of their own lr and weight_decay, the first padded to
whole blocks). Also: another rank's state is refused, and rank 0's state without
the shards' error buffer is refused against fresh shards, and OneBitLamb
refuses torch.optim.AdamW's state (test_torch_state loads it into the others).
And OneBitAdam's 2-worker state resumed by 3 workers and by 1: from the
saved step, every rank alike, rank 0 warning what the other size changes."""
import json
import os
import re
import sys
import tempfile

import torch

from harness import check, morse_run

SAVE_AT, STEPS = 4, 8


def model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def train(model, opt, first, rank):
    sums = {}
    for step in range(first, STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sums[step] = opt.checksum()
        if step + 1 == SAVE_AT and first == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       f"{os.environ['RESUME_DIR']}/ckpt-{rank}.pt")
    return sums


def optimizer(model):
    import morse.torch
    name = os.environ.get("RESUME_OPTIMIZER", "OneBitAdam")
    params = model.parameters()
    if name.endswith("Groups"):  # 56 elements padded to 64, then 27
        name, params = name[:-len("Groups")], [
            {"params": model[0].parameters(), "weight_decay": 0.01},
            {"params": model[2].parameters(), "lr": 0.02}]
    return getattr(morse.torch, name)(params, lr=0.01, freeze_step=2, block_elems=16,
                                      partition_elems=32)


def resized(mode, rank, out):
    """OneBitAdam's 2-worker checkpoint of step 4 (past its freeze: the
    worker error buffers matter) resumed by 3 workers ("grow": rank 2 loads
    no state) or 1 ("shrink"): every rank goes on from step 4, alike and
    equal to the shards' mirrors, and rank 0 warns once saying what the
    other size drops or starts at zero."""
    import warnings
    saved = torch.load(f"{out}/ckpt-{min(rank, 1)}.pt")
    model = model_and_batch()
    model.load_state_dict(saved["model"])
    opt = optimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank < 2:
            opt.load_state_dict(saved["opt"])
    said = [str(w.message) for w in caught if "morse:" in str(w.message)]
    want = {"grow": "workers 2..2 have no saved state", "shrink": "workers 1..1 are not loaded"}[mode]
    check(len(said) == (rank == 0) and all(want in s for s in said), f"rank {rank} warned {said}")
    check(opt.step_index == SAVE_AT, f"rank {rank} resumed at step {opt.step_index}")
    for step in range(SAVE_AT, STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        check(opt._session.holds_shards_model(), f"rank {rank} step {step}: mirrors differ")
    print(f"rank {rank}: {mode} from step {SAVE_AT}, checksum {opt.checksum()}", flush=True)


def worker(mode):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    out = os.environ["RESUME_DIR"]
    if mode in ("grow", "shrink"):
        resized(mode, rank, out)
        return
    model = model_and_batch()
    if mode == "through":
        opt = optimizer(model)
        sums = train(model, opt, 0, rank)
    else:
        saved = torch.load(f"{out}/ckpt-{rank}.pt")
        model.load_state_dict(saved["model"])
        opt = optimizer(model)
        if isinstance(opt, morse.torch.OneBitLamb):
            partial = {"state": dict(saved["opt"]["state"]), "param_groups": saved["opt"]["param_groups"]}
            partial["state"].pop("lamb_layers")
            try:
                opt.load_state_dict(partial)
                check(False, "a OneBitLamb state without lamb_layers was accepted")
            except ValueError as e:
                check("lamb_layers" in str(e), str(e))
        if type(opt).__name__ == "OneBitLamb" and len(opt.param_groups) == 1:
            params = list(model.parameters())  # torch.optim.AdamW's state of this model
            adamw = {"state": {i: {"step": torch.tensor(4.0), "exp_avg": torch.zeros_like(p),
                                   "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(params)},
                     "param_groups": [{"lr": 0.01, "params": list(range(len(params)))}]}
            try:
                opt.load_state_dict(adamw)
                check(False, "AdamW's state was accepted by OneBitLamb")
            except ValueError as e:
                check("cannot continue" in str(e) and "layer" in str(e), str(e))
        other = torch.load(f"{out}/ckpt-{1 - rank}.pt")["opt"]
        try:
            opt.load_state_dict(other)
            check(False, "another rank's state was accepted")
        except ValueError as e:
            check(f"this state_dict is rank {1 - rank}'s" in str(e), str(e))
        if mode == "no_server_state":
            saved["opt"]["state"].pop("server_error", None)  # as if saved without it
            try:
                opt.load_state_dict(saved["opt"])
            except morse.torch.MorseError as e:
                print(f"REFUSED rank {rank}: {e}", flush=True)
                sys.exit(0)
            check(rank != 0, "rank 0's state without server_error was accepted by fresh shards")
            return
        opt.load_state_dict(saved["opt"])
        check(opt.step_index == SAVE_AT, f"resumed at step {opt.step_index}")
        sums = train(model, opt, SAVE_AT, rank)
    with open(f"{out}/{mode}-{rank}.json", "w") as f:
        json.dump(sums, f)


def main():
    out = tempfile.mkdtemp()
    os.environ["RESUME_DIR"] = out
    # OneBitAdam's files serve no_server_state below.
    for name in ("OneBitLamb", "OneBitLambGroups", "OneBitAdamGroups", "OneBitAdam"):
        os.environ["RESUME_OPTIMIZER"] = name
        for mode in ("through", "resumed"):
            code, text = morse_run(__file__, 2, 2, mode, timeout=180)
            print(text[-2500:])
            check(code == 0, f"the {name} {mode} run failed")
        for rank in range(2):
            through = json.load(open(f"{out}/through-{rank}.json"))
            resumed = json.load(open(f"{out}/resumed-{rank}.json"))
            for step in range(SAVE_AT, STEPS):
                check(through[str(step)] == resumed[str(step)],
                      f"{name} rank {rank} step {step}: resumed {resumed[str(step)]}, uninterrupted "
                      f"{through[str(step)]}")
            print(f"{name} rank {rank}: steps {SAVE_AT}..{STEPS - 1} bit-identical after the resume")
    for mode, workers in (("grow", 3), ("shrink", 1)):
        code, text = morse_run(__file__, workers, 2, mode, timeout=180)
        print(text[-2500:])
        sums = set(re.findall(rf"{mode} from step {SAVE_AT}, checksum (\w+)", text))
        check(code == 0 and len(re.findall(rf"{mode} from step", text)) == workers
              and len(sums) == 1, f"the {mode} run: every rank ends alike ({sums})")
    code, text = morse_run(__file__, 2, 2, "no_server_state",
                           config=_config(out, "timeouts { connect_seconds: 5 }\n"), timeout=180)
    print(text[-2500:])
    check("REFUSED rank 0" in text and "has no server state" in text,
          "rank 0 without the shards' error buffer is refused, saying what to save")
    print("PASS")


def _config(out, text):
    path = f"{out}/job.textproto"
    with open(path, "w") as f:
        f.write(text)
    return path


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    main()
