"""torch idioms under morse-run (issue 19, first part): the launcher sets
torch.distributed's variables, frozen parameters (requires_grad=False) stay
bit-unchanged (one thawed later is refused after each step, naming it:
torch.optim would train it; DDP, checked here too, leaves it out of its
averaging, so its ranks train different copies of it), add_param_group
past OneBitAdam's freeze_step is refused with a message (before it:
test_add_param_group), weights changed
behind the optimizer's back after a step (on every rank) become the job's,
and morse-run says which Python it found when that one cannot import
morse."""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import torch

from harness import check, morse_run  # noqa: E402


def worker(out):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)  # a frozen layer
    frozen = model[0].weight.detach().clone()
    opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=2, block_elems=16,
                                 partition_elems=32)
    for step in range(6):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        refused = ""
    except ValueError as e:
        refused = str(e)
    # A frozen layer thawed (torch.optim would now train it): refused after
    # the step, naming it, every time until it is frozen again.
    model[0].weight.requires_grad_(True)
    thawed = []
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(50 + step + rank)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        try:
            opt.step()
            thawed.append("")
        except morse.torch.MorseError as e:
            thawed.append(str(e))
    model[0].weight.requires_grad_(False)
    model[0].weight.grad = None
    # Weights changed behind the optimizer's back, on every rank, become the
    # job's (with overlap, at the backward pass's first push).
    with torch.no_grad():
        model[2].weight.copy_(torch.zeros_like(model[2].weight))
    opt.zero_grad()
    try:
        g = torch.Generator().manual_seed(100 + rank)
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        changed = ""
    except morse.torch.MorseError as e:
        changed = str(e)
    json.dump({"changed": changed, "env": env, "frozen_unchanged": torch.equal(model[0].weight, frozen),
               "add_param_group": refused, "thawed": thawed, "checksum": opt.checksum(),
               "step": opt.step_index},
              open(f"{out}/rank-{rank}.json", "w"))


def ddp_thaw(out):
    """DDP's side of the thawed row (docs/python.md): a parameter frozen when
    DDP was built and thawed later is left out of its reducer, so its
    gradient is never averaged and the ranks train different copies of it,
    silently. Writes this rank's thawed and always-trained weights."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(6):
        if step == 3:
            model[0].weight.requires_grad_(True)
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        ddp(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
    json.dump({"thawed": model[0].weight.flatten().tolist(), "trained": model[2].weight.flatten().tolist()},
              open(f"{out}/ddp-{rank}.json", "w"))
    dist.destroy_process_group()


def check_ddp_thaw():
    """Runs ddp_thaw on 2 ranks over gloo and checks what docs/python.md says of it."""
    import socket
    out = tempfile.mkdtemp(prefix="morse-ddp-thaw-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, __file__, "--ddp-thaw", out], env=dict(env, RANK=str(r)))
             for r in range(2)]
    check(all(p.wait(timeout=120) == 0 for p in ranks), "the DDP job failed")
    got = [json.load(open(f"{out}/ddp-{r}.json")) for r in range(2)]
    shutil.rmtree(out, ignore_errors=True)
    check(got[0]["trained"] == got[1]["trained"], "DDP's ranks differ in a parameter it averages")
    check(got[0]["thawed"] != got[1]["thawed"],
          f"torch {torch.__version__}: DDP averaged a parameter thawed after it was built; "
          "docs/python.md says it does not")
    print(f"ok: under DDP (torch {torch.__version__}) a parameter thawed after DDP was built trains "
          "a different copy on each rank")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    if "--ddp-thaw" in sys.argv:
        ddp_thaw(sys.argv[-1])
        sys.exit(0)
    check_ddp_thaw()
    out = tempfile.mkdtemp(prefix="morse-idioms-")
    code, log = morse_run(__file__, 2, 1, out)
    print(log)
    check(code == 0, "the job failed")
    ranks = [json.load(open(f"{out}/rank-{r}.json")) for r in range(2)]
    for r, got in enumerate(ranks):
        check(got["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                             "LOCAL_WORLD_SIZE": "2"}, f"rank {r}'s torch variables: {got['env']}")
        check(got["frozen_unchanged"], f"rank {r}: a requires_grad=False parameter moved")
        check("since step 6, at or after freeze_step 2" in got["add_param_group"],
              f"rank {r}: add_param_group was not refused: {got['add_param_group']!r}")
        check(len(got["thawed"]) == 2 and all(
            "parameter 0 (8, 6) had requires_grad=False when the optimizer was built and got a "
            "gradient "
            f"in step {6 + i}" in e for i, e in enumerate(got["thawed"])),
            f"rank {r}: a thawed parameter was not refused at each step: {got['thawed']!r}")
    check(ranks[0]["checksum"] == ranks[1]["checksum"], "the ranks differ")
    for r, got in enumerate(ranks):
        check(not got["changed"] and got["step"] == 9,
              f"rank {r}: a step after a weight changed on every rank: {got['changed']!r}")
    print("ok: RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE set; frozen parameters unchanged; "
          "a thawed one and add_param_group past the freeze refused; weights changed behind the optimizer on every rank train on")

    # A python3 on PATH that cannot import morse: morse-run names it.
    bin_dir = tempfile.mkdtemp(prefix="morse-fakepy-")
    fake = os.path.join(bin_dir, "python3")
    with open(fake, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} -I \"$@\"\n")  # -I: ignores PYTHONPATH
    os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
    result = subprocess.run([os.environ["MORSE_RUN"], "--servers", "1", "--workers", "1", "--",
                             "python3", "-c", "pass"],
                            env=dict(os.environ, PATH=bin_dir + ":" + os.environ["PATH"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    print(result.stdout[-1500:])
    check(result.returncode != 0, "morse-run should refuse")
    check(f"python3 is {fake}, which cannot import morse.torch" in result.stdout,
          "the message names the interpreter")
    print("PASS")
