"""morse.torch on CUDA tensors (issue 15): a mixed job of 3 workers, ranks 0
and 1 with their model on the GPU (rank 0 overlapping pushes with the
backward pass, rank 1 not), rank 2 on the CPU, with bias correction and the
zero-variance mask (a parameter no loss uses), for each of OneBitAdam
(across the freeze), OneBitAdam with clip_grad_norm, OneBitAdam with the
script's clip_grad_norm_ after backward() (the bits of clip_grad_norm: the
simulator runs with it), ZeroOneAdam (variance,
1-bit, local and sync steps) and OneBitLamb (across the freeze, and again
with the script's clip_grad_norm_), and both again with two parameter
groups of their own lr and weight_decay, each lr changed every step by a
LambdaLR (each group's local steps, sync messages and LAMB layers with its
own values). After
every step each rank holds the x, m, v of the single-process simulator fed
the gradients the workers computed (all three the same bits, except
between zero_one_adam's syncs); the GPU ranks' parameters stay CUDA
tensors; state_dict()/load_state_dict() round trip on the GPU;
clip_grad_norm_ with norm_type 3 in a step that averages gives
torch's norm and clip (the replies decoded where they are staged); edits
of .grad after clip_grad_norm_ in OneBitAdam's compression phase train
bit for bit as on the CPU. Exits
77 (skipped, saying why) without a GPU."""
import json
import os
import sys
import tempfile

import numpy as np
import torch

from harness import (check, check_ranks_match_simulator, clip_in_job, flat_layout,  # noqa: E402
                     morse_run, server)

STEPS = 12
SKIP = 77
# Variance steps, 1-bit steps, then local intervals of 1, 2 and 4 steps; step
# 12 ends with a sync, so state_dict() may save the whole run there.
ZERO_ONE_SCHEDULE = dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
OPTIMIZERS = ("OneBitAdam", "OneBitAdam+clip", "OneBitAdam+script clip", "ZeroOneAdam",
              "ZeroOneAdam+groups", "OneBitLamb", "OneBitLamb+script clip", "OneBitLamb+groups")
CLIP = 0.05


def worker(out):
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    device = torch.device("cuda" if rank < 2 else "cpu")
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(),
                                torch.nn.Linear(20, 4)).to(device)
    model.unused = torch.nn.Parameter(torch.full((7,), 0.5, device=device))  # v = 0: masked
    name = os.environ.get("CUDA_OPTIMIZER", "OneBitAdam")
    # The unused parameter needs missing_grads (torch 2's zero_grad sets None).
    common = dict(lr=0.01, block_elems=16, partition_elems=64, overlap=rank == 0, missing_grads="zero")
    schedule = None
    if name == "ZeroOneAdam":
        opt = morse.torch.ZeroOneAdam(model.parameters(), **ZERO_ONE_SCHEDULE, **common)
    elif name.endswith("+groups"):  # Trainer's split, each group's lr its own every step
        groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01},
                  {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0,
                   "lr": 0.02}]
        if name == "ZeroOneAdam+groups":
            opt = morse.torch.ZeroOneAdam(groups, **ZERO_ONE_SCHEDULE, **common)
        else:
            opt = morse.torch.OneBitLamb(groups, freeze_step=4, **common)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, [lambda t: 1.0 - 0.03 * t, lambda t: 1.0 / (1 + t)])
    elif name == "OneBitAdam+clip":  # the averaged gradient, then each rank's own
        opt = morse.torch.OneBitAdam(model.parameters(), freeze_step=4, clip_grad_norm=CLIP, **common)
    elif name.endswith("+script clip"):  # clip_grad_norm_ below: the same bits
        opt = getattr(morse.torch, name.split("+")[0])(model.parameters(), freeze_step=4, **common)
    else:
        opt = getattr(morse.torch, name)(model.parameters(), freeze_step=4, **common)
    if rank == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy",
                flat_layout(opt, model, [p.detach().cpu() for p in model.parameters()]).numpy())
    checksums, hypers = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        np.save(f"{out}/grad-{rank}-{step}.npy",
                flat_layout(opt, model, [(p.grad if p.grad is not None else torch.zeros_like(p)).cpu()
                                         for p in model.parameters()]).numpy())
        if name.endswith("+script clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if schedule is not None:  # what the simulator steps each group with
            hypers.append(opt._group_hyper())
        opt.step()
        if schedule is not None:
            schedule.step()
        checksums.append(opt.checksum())
        check(all(p.device.type == device.type for p in model.parameters()),
              f"rank {rank}: parameters left {device}")
    json.dump(checksums, open(f"{out}/checksums-{rank}.json", "w"))
    if hypers and rank == 0:
        json.dump(hypers, open(f"{out}/hypers.json", "w"))
    check(torch.equal(model.unused.detach().cpu(), torch.full((7,), 0.5)), "a parameter with v = 0 moved")
    saved = opt.state_dict()
    check(saved["state"]["exp_avg"].device.type == device.type, "state_dict on the parameters' device")
    check(saved["state"]["worker_error"].abs().sum().item() > 0, "the error buffer is saved")
    changed = {"state": dict(saved["state"], exp_avg=saved["state"]["exp_avg"] * 2),
               "param_groups": saved["param_groups"]}
    opt.load_state_dict(changed)
    check(opt.checksum() != checksums[-1], "loading a different state changes the replica")
    opt.load_state_dict(saved)
    check(opt.checksum() == checksums[-1], "loading the saved state restores it")


def norm_type_taken():
    """clip_grad_norm_ with a norm_type the shards send no norm of (3) over
    morse.torch.Adam's CUDA parameters, in a step that averages, one rank:
    the norm of the averaged gradient decoded from the replies where the
    engine stages them (Engine::StagedReply), here the rank's own gradient,
    as torch's within 1e-5; .grad after it the rank's own, untouched (on
    CUDA tensors Morse does not write the clipped average there); True if
    so."""
    import morse.torch
    os.environ["MORSE_INSECURE"] = "1"
    config = tempfile.NamedTemporaryFile("w", suffix=".textproto", delete=False)
    config.write("workers: 1\nshards: 1\nexternal {}\n")
    config.close()
    model = torch.nn.Linear(10, 4).cuda()
    with server(config.name) as address:
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=config.name, block_elems=16)
        model(torch.ones(2, 10, device="cuda")).sum().backward()
        own = [p.grad.detach().cpu().clone() for p in model.parameters()]
        want = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.double(), 3) for g in own]), 3))
        got = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=3))
        kept = all(torch.equal(p.grad.cpu(), g) for p, g in zip(model.parameters(), own))
        print(f"norm_type=3 on CUDA tensors (rank {opt.rank}): {got}, torch's {want}; "
              f".grad after it the rank's own: {kept}")
        opt.step()
        return abs(got - want) <= 1e-5 * want and kept


def compressing_edits(device):
    """OneBitAdam's compression phase (freeze_step 1, one rank, one shard)
    on a Linear on `device`, clip_grad_norm_ after backward() each step and,
    in the compressing steps, .grad edited after it (an add_, a row's mul_,
    every gradient halved): the clip is torch's own on .grad, in place, and
    step() pushes .grad as it finds it (DeepSpeed's rule). Returns the
    parameters after 5 steps, and the same without the edits, on the CPU."""
    import morse.torch
    os.environ["MORSE_INSECURE"] = "1"
    config = tempfile.NamedTemporaryFile("w", suffix=".textproto", delete=False)
    config.write("workers: 1\nshards: 1\nexternal {}\n")
    config.close()
    trained = []
    for edits in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(10, 4).to(device)
        with server(config.name) as address:
            opt = morse.torch.OneBitAdam(model.parameters(), freeze_step=1, rank=0, world_size=1,
                                         servers=[address], config=config.name, block_elems=16)
            for step in range(5):
                opt.zero_grad()
                x = torch.randn(8, 10, generator=torch.Generator().manual_seed(step)).to(device)
                model(x).square().sum().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                if edits and step > 0:
                    with torch.no_grad():
                        model.weight.grad.add_(0.001 * step)
                        model.weight.grad[0].mul_(0.5)
                        for p in model.parameters():
                            p.grad.mul_(0.5)
                opt.step()
        trained.append(torch.cat([p.detach().cpu().flatten() for p in model.parameters()]))
    return trained


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    if not torch.cuda.is_available():
        print(f"SKIP: no GPU here (torch {torch.__version__}: torch.cuda.is_available() is False)")
        sys.exit(SKIP)
    import morse
    print("GPU:", morse.cuda_device(), "| torch", torch.__version__, "| Python", sys.version.split()[0])
    # Every case runs, whatever failed before it (a lent GPU's minutes are
    # few): each prints PASS or FAIL, and the exit code says whether any failed.
    failed = []
    if norm_type_taken():
        print("PASS norm_type=3: on CUDA tensors in a step that averages, torch's norm and clip")
    else:
        print("FAIL norm_type=3: not torch's norm and clip on CUDA tensors")
        failed.append("norm_type=3")
    # Edits after clip_grad_norm_ in compressing steps on CUDA tensors
    # (refused until session 74): the same bits as on the CPU, and moved by
    # the edits.
    on_gpu, on_cpu = compressing_edits("cuda"), compressing_edits("cpu")
    if torch.equal(on_gpu[0], on_cpu[0]) and torch.equal(on_gpu[1], on_cpu[1]) \
            and not torch.equal(on_gpu[0], on_gpu[1]):
        print("PASS compressing edits: .grad edited after clip_grad_norm_ in OneBitAdam's "
              "compression phase on CUDA tensors trains bit for bit as on the CPU")
    else:
        print("FAIL compressing edits: on CUDA tensors "
              f"{(on_gpu[0] - on_cpu[0]).abs().max():.2e} from the CPU's run "
              f"(unedited {(on_gpu[1] - on_cpu[1]).abs().max():.2e}); the edits moved it "
              f"{(on_gpu[0] - on_gpu[1]).abs().max():.2e}")
        failed.append("compressing edits")
    for name in OPTIMIZERS:
        os.environ["CUDA_OPTIMIZER"] = name
        out = tempfile.mkdtemp(prefix="morse-cuda-")
        code, log = morse_run(__file__, 3, 2, out)
        print(log)
        try:
            check(code == 0, f"the {name} job failed")
            if name.endswith("+script clip"):  # the simulator clips as clip_grad_norm does
                clip_in_job(out, CLIP)
            # zero_one_adam's ranks differ between syncs (their own local steps).
            check_ranks_match_simulator(out, 3, STEPS, ranks_may_differ=name.startswith("ZeroOneAdam"))
        except SystemExit:  # check() printed FAIL and why
            print(f"(the {name} job's gradients, checksums and config are kept in {out})")
            failed.append(name)
            continue
        print(f"PASS {name}: {STEPS} steps, 2 GPU + 1 CPU workers bit-identical to the simulator")
    if failed:
        print(f"FAIL: {', '.join(failed)}")
        sys.exit(1)
