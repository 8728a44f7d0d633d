"""A node's optimizer state sharded over its ranks (morse-run
--node-aggregation=sharded; issue 37, part 1).

1. 2 nodes x 2 ranks (two morse-run invocations on this machine, as on two
   hosts), for each of the four optimizers: the parameters are cut into 2
   slices of whole parameters, each its own Morse job with its own 2 shards
   that see 2 workers (one per node); local rank k pushes, for slice k
   alone, the average of its node's gradients (equal, bit for bit, to
   (g0 + g1) / 2 of that slice formed here from what each rank computed)
   and holds that slice's m, v and error buffer alone (a state_dict of the
   slice's size); after every step every rank of a node holds the same
   parameters, and each slice's workers hold what the simulator with N = 2
   fed those averages holds over that slice. fp32 Adam (element by
   element) gives the bits of the same run with the leader holding the
   state.
2. Weights clamped after every step on every rank: the same, with the
   simulator fed the changes (OneBitAdam, and ZeroOneAdam through its
   syncs and local intervals); clamped on one rank only: every rank of the
   node fails, naming it. On a GPU host, OneBitAdam on CUDA tensors too,
   and 9's `learnleader`, `learnfull` and `addone` and 10 on
   them (skipped, saying so, without a GPU).
3. One host, 3 ranks in one node: 3 slices, ((g0 + g1) + g2) / 3 each.
4. Resume: each rank's state_dict after 4 steps loaded into a fresh job
   (fresh shards) that runs 4 more steps gives the bits of an
   uninterrupted run of 8; a rank given another slice's state is refused.
   ZeroOneAdam saved inside a local interval (each slice's owner its
   slice's interval, every rank every slice's parameters) and resumed by a
   fresh job: every rank on the uninterrupted run's parameters after each
   later step (interval_resume, test_node_aggregation's).
5. With --rank-restarts and checkpoints every 2 steps, a rank killed in
   step 5 restarts its node: sharded, the owner of slice 1 as its Morse
   step begins while slice 0's owner finishes step 5 and writes step 6's
   checkpoint, the node rejoining at step 4 (the latest step both slices
   have); with the leader, the leader. Every rank's parameters after every
   step, in either life, are the undisturbed run's bits.
6. A local rank killed at step 3 without restarts stops both nodes, naming
   it (no hang).
   Wrong use: a slice too small for its shards, and more local ranks than
   parameters, are refused naming the slice; --servers listing shards that
   do not split into the slices is refused; nodes that disagree on the
   mode fail the rendezvous.
7. clip_grad_norm_ after backward() on every rank returns DDP's norm (of
   the job's averaged gradient; in OneBitAdam's compression phase the
   node's own) combined from the slices', and clips every slice by its
   factor: fp32 Adam within 1e-6 of the leader's run, by clip_grad_norm_
   and by clip_grad_norm=.
8. clip_grad_norm_ over the first layer, then over the whole model, every
   step (`part`): each call returns DDP's norm on every rank, the leader's
   node and the sharded node end every step within 1e-6 of DDP + AdamW
   (which without the clips is further off), and each slice's shards hold
   its owner's parameters after every step (the step's clip pieces reach
   their mirrors).
9. clip_grad_norm_, then .grad scaled and zeroed per parameter on every
   rank of the leader's node and of the sharded node (`edit`): within 1e-6
   of DDP + AdamW given the same edits of the clipped average (`learnleader`:
   the leader's node started as on CUDA tensors, .grad after the clip each
   rank's own, so step 0 trains without the edits, the leader warning, and
   every step after as DDP's; `learnfull` the same on the sharded node,
   step 0's edit in slice 0 alone, both owners showing from step 1); one
   rank alone editing is refused, naming it.
10. In OneBitAdam's compression phase (`own`), clip_grad_norm_ then an
   addition and a row's halving of .grad on every rank of the sharded
   node: .grad after the clip torch's clip of the node's average on every
   rank, each slice pushed bit for bit as the edit left it, each slice's
   job the simulator's; one rank alone editing fails, named."""
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import warnings

import numpy
import torch

from harness import check, check_ranks_match_simulator, has_cuda, modes_of, nodes  # noqa: E402
from test_node_aggregation import CLIP, FREEZE, STEPS, build, clamp_weights, node_average  # noqa: E402
from test_node_aggregation import check_node_clip, edit_clipped as add_after_clip, edited  # noqa: E402
from test_node_aggregation import interval_resume, shown_average  # noqa: E402


def model_of(seed=5):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def worker(out, mode):
    name, _, variant = mode.partition(":")
    variant, _, on = variant.partition("@")  # VARIANT@cuda: on CUDA tensors
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    node = int(os.environ["MORSE_NODE_RANK"])
    if variant in ("kill", "steps"):
        restart_worker(out, name, variant)
        return
    device = torch.device("cuda" if "cuda" in (variant, on) else "cpu")
    model = model_of().to(device)
    if variant.startswith("clipjob"):  # clip_grad_norm=, the job's
        import morse.torch
        opt = morse.torch.Adam(model.parameters(), lr=0.01, block_elems=16, partition_elems=64,
                               clip_grad_norm=CLIP)
    else:
        opt = build(name, model.parameters(), 0.01)
    if variant in ("learnleader", "learnfull"):
        # .grad after the clip first the rank's own, as on CUDA tensors: the
        # leader (each slice's owner) learns from step 0's edit (warning)
        # to show the node the clipped average from step 1 on.
        if device.type == "cpu":
            opt._shows_average = False
        check(not opt._shows_average, f"rank {rank}: shows the clipped average from the start")
        recorder = warnings.catch_warnings(record=True)
        recorded = recorder.__enter__()
        warnings.simplefilter("always")
    if variant in ("leader", "clipleader", "clipjobleader", "partleader", "editleader", "editone",
                   "addone", "anyleader", "learnleader"):
        # the leader holding the node's state
        params, norms = [], []
        for step in range(STEPS):
            x, y = (t.to(device) for t in batch(step, rank))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            numpy.save(f"{out}/own-{rank}-{step}.npy",
                       torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy())
            if variant == "clipleader":
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            if variant == "partleader":
                norms.append(part_clips(model))
            if variant in ("editleader", "editone", "anyleader", "learnleader"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3 * CLIP)
                if variant in ("anyleader", "learnleader"):
                    save_clipped(out, rank, step, model)
                    edit_any(model, step)
                elif variant == "editleader" or local == 1:  # editone: local rank 1 alone
                    edit_clipped(model, step)
            if variant == "addone":  # local rank 1 alone, an edit that is no scaling
                torch.nn.utils.clip_grad_norm_(model.parameters(), 3 * CLIP)
                if local == 1:
                    with torch.no_grad():
                        model[2].bias.grad.add_(0.5)
            opt.step()
            if variant in ("partleader", "editleader", "anyleader", "learnleader") and local == 0:
                check(opt._holds_shards_model(), f"rank {rank} step {step}: the shards' mirrors "
                      "differ from the leader's parameters")
            params.append(flat(model).numpy().tobytes().hex())
        json.dump(params, open(f"{out}/params-{rank}-{variant}.json", "w"))
        json.dump(norms, open(f"{out}/norms-{rank}-{variant}.json", "w"))
        if variant == "learnleader":
            recorder.__exit__(None, None, None)
            said = [str(w.message) for w in recorded if str(w.message).startswith("morse:")]
            check(len(said) == (1 if local == 0 else 0) and all(
                m.startswith("morse: in step 0 .grad was edited after clip_grad_norm_")
                for m in said), f"rank {rank}: the leader's one warning, of step 0: {said}")
        return
    first, end = opt._slices[local]
    sizes = [p.numel() for p in model.parameters()]
    lo, hi = sum(sizes[:first]), sum(sizes[:end])
    d = f"{out}/slice-{local}"
    os.makedirs(d, exist_ok=True)
    steps = range(STEPS)
    if variant.startswith("resume"):
        # resume_first: steps 0-3, then each rank saves its state; resume:
        # a fresh job loads it (resume_other: rank 0 loads rank 1's) and
        # runs steps 4-7.
        steps = range(4) if variant == "resume_first" else range(4, STEPS)
        if variant != "resume_first":
            saved = torch.load(f"{out}/state-{1 - rank if variant == 'resume_other' and rank < 2 else rank}.pt")
            model.load_state_dict(saved["model"])
            try:
                opt.load_state_dict(saved["optimizer"])
            except ValueError as e:
                print(f"rank {rank}: refused: {e}", flush=True)
                raise SystemExit(3)
    if node == 0 and not variant.startswith("resume"):
        with open(os.environ["MORSE_CONFIG"]) as f:
            json.dump({"base": f.read(), "overrides": opt.job_overrides}, open(f"{d}/job.json", "w"))
        numpy.save(f"{d}/x0.npy", opt._flat.cpu().numpy())
    json.dump([lo, hi], open(f"{out}/range-{local}.json", "w"))
    checksums, params, norms = [], [], []
    for step in steps:
        if variant == "kill" and rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # a local rank dies in the middle of the run
        x, y = (t.to(device) for t in batch(step, rank))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        numpy.save(f"{out}/own-{rank}-{step}.npy",
                   torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy())
        if variant == "clipfull":  # every rank, as a DDP script does
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if variant == "partfull":
            norms.append(part_clips(model))
        if variant in ("editfull", "anyfull", "learnfull"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 3 * CLIP)
            if variant in ("anyfull", "learnfull"):
                save_clipped(out, rank, step, model)
            if variant == "learnfull" and step == 0:
                # Slice 0's parameters alone: its owner learns, and slice
                # 1's owner learns from it (it shows its slice from step 1).
                with torch.no_grad():
                    model[0].weight.grad.add_(0.01)
            else:
                (edit_any if variant in ("anyfull", "learnfull") else edit_clipped)(model, step)
        if variant in ("ownfull", "ownone"):
            # The norm alone before the compression phase (max_norm inf),
            # then a clip and an edit after it that is no scaling, on every
            # rank (ownone: on local rank 1 alone).
            clips = step >= FREEZE
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP if clips else math.inf)
            numpy.save(f"{out}/clipped-{rank}-{step}.npy",
                       torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy())
            if clips and (variant == "ownfull" or local == 1):
                add_after_clip(model)
        opt.step()
        if variant in ("partfull", "editfull", "anyfull", "learnfull"):
            check(opt._holds_shards_model(), f"rank {rank} step {step}: slice {local}'s shards' "
                  "mirrors differ from its owner's parameters")
        numpy.save(f"{d}/grad-{node}-{step}.npy", opt._flat_grad.cpu().numpy())
        checksums.append(opt.checksum())
        f = flat(model)
        params.append(f.numpy().tobytes().hex() if variant in ("full", "clipfull", "clipjob", "partfull",
                                                                "editfull", "anyfull", "ownfull",
                                                                "learnfull") else
                      f.numpy().tobytes().hex()[:64] + f"{float(f.double().sum()):.17g}")
        if clamp_weights(model, variant, rank, step):
            # Slice `local`'s weights: the job's (node 0 saves them for its
            # simulator), or inside a ZeroOneAdam local interval the node's
            # own x_i.
            inside = opt._session.exchanged_step != opt.step_index
            if node == 0 or inside:
                numpy.save(f"{d}/x-{step + 1}{f'-{node}' if inside else ''}.npy",
                           opt._flat.cpu().numpy())
    if variant == "learnfull":
        recorder.__exit__(None, None, None)
        said = [str(w.message) for w in recorded if str(w.message).startswith("morse:")]
        check(len(said) == (1 if local == 0 else 0) and all(
            m.startswith("morse: in step 0 .grad was edited after clip_grad_norm_") for m in said),
            f"rank {rank}: slice 0's owner's one warning, of step 0: {said}")
    if variant == "resume_first":
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{out}/state-{rank}.pt")
    json.dump(checksums, open(f"{d}/checksums-{node}.json", "w"))
    json.dump(params, open(f"{out}/params-{rank}-{variant or 'plain'}.json", "w"))
    json.dump(norms, open(f"{out}/norms-{rank}-{variant or 'plain'}.json", "w"))
    state = opt.state_dict()["state"]
    json.dump({"held": [int(state[k].numel()) for k in ("exp_avg", "exp_avg_sq", "worker_error")],
               "slice": hi - lo, "model": sum(sizes), "server_error": "server_error" in state},
              open(f"{out}/held-{rank}.json", "w"))
    print(f"rank {rank} (node {node}, local {local}): done, slice {local} = elements {lo}..{hi}, "
          f"step_index {opt.step_index}")


def restart_worker(out, name, variant):
    """variant "kill": a rank kills itself as its step 5 begins its Morse
    step (a sharded node: rank 1, the owner of slice 1, after the node's
    gathers, while rank 0 steps slice 0; the leader's node: rank 0, the
    leader) in its first life; "steps": undisturbed. Each life records its
    parameters after every step; the script goes on from opt.step_index."""
    import morse.torch  # noqa: F401
    rank = int(os.environ["RANK"])
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    model = model_of()
    opt = build(name, model.parameters(), 0.01)
    sharded = os.environ["MORSE_NODE_AGGREGATION"] == "sharded"
    if variant == "kill" and life == 0 and rank == (1 if sharded else 0):
        morse_step = opt._worker_step

        def dying():
            if opt._session.step_index == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            morse_step()
        opt._worker_step = dying
    record = {}
    print(f"rank {rank} life {life}: from step {opt.step_index}", flush=True)
    for step in range(opt.step_index, STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        record[step] = flat(model).numpy().tobytes().hex()
        json.dump(record, open(f"{out}/life-{rank}-{variant}-{life}.json", "w"))


def check_slices(out, nnodes, local_size, steps=range(STEPS)):
    """Each slice's owner pushed ((g0 + g1) + ...) / L of its node's own
    gradients of that slice, and held that slice's state alone."""
    for k in range(local_size):
        lo, hi = json.load(open(f"{out}/range-{k}.json"))
        for node in range(nnodes):
            for step in steps:
                total = node_average([numpy.load(f"{out}/own-{node * local_size + r}-{step}.npy")[lo:hi]
                                      for r in range(local_size)])
                pushed = numpy.load(f"{out}/slice-{k}/grad-{node}-{step}.npy")
                check(pushed.tobytes() == total.tobytes(), f"slice {k} node {node} step {step}: the "
                      "pushed gradient is not the node's average of the slice in local-rank order")
            held = json.load(open(f"{out}/held-{node * local_size + k}.json"))
            check(held["held"] == [hi - lo] * 3 and held["slice"] < held["model"],
                  f"slice {k} node {node}: the rank holds {held['held']} values of m, v and the "
                  f"error buffer, its slice has {hi - lo} of the model's {held['model']}")
            check(held["server_error"] == (node == 0),
                  f"slice {k} node {node}: server_error in the state_dict of its job's worker 0 alone")


def check_shown_slices(out, nnodes, local_size, steps):
    """The warmup of `ownfull` (steps that average, clip_grad_norm_ with
    max_norm inf: the norm alone): every rank's .grad after the call
    (clipped-R-STEP.npy) is DDP's, the job's average, the same bits on
    every rank, within 1e-6 of it (relative), and each slice's owner keeps
    its slice of it after step(). The gradients recorded for the simulator
    become the nodes' averages of each slice, which the owners pushed."""
    for step in steps:
        averages, shown = shown_average(out, nnodes, local_size, step, math.inf)
        for k in range(local_size):
            lo, hi = json.load(open(f"{out}/range-{k}.json"))
            for n in range(nnodes):
                kept = numpy.load(f"{out}/slice-{k}/grad-{n}-{step}.npy")
                check(kept.tobytes() == shown[lo:hi].tobytes(),
                      f"step {step}: slice {k}'s owner on node {n} does not keep the shown average")
                numpy.save(f"{out}/slice-{k}/grad-{n}-{step}.npy", averages[n][lo:hi])


def check_nodes_share(out, nnodes, local_size, variant, may_differ):
    params = [json.load(open(f"{out}/params-{r}-{variant}.json")) for r in range(nnodes * local_size)]
    for r, p in enumerate(params):
        first = (r // local_size) * local_size
        check(p == params[first], f"rank {r} differs from local rank 0 of its node (rank {first})")
        check(may_differ or p == params[0], f"rank {r} differs from rank 0")


def run_nodes(out, mode, nnodes=2, nproc=2, how="sharded", extra=()):
    results = nodes(__file__, nnodes, nproc, out, mode,
                    extra=("--servers", "2", f"--node-aggregation={how}", *extra))
    for node, (code, text) in enumerate(results):  # every failing node's output before the verdict
        if code != 0:
            print(f"--- node {node} (exit {code}):\n{text[-4000:]}")
    return results


def two_nodes(name, variant=""):
    out = tempfile.mkdtemp(prefix=f"morse-sharded-{name}-")
    results = run_nodes(out, f"{name}:{variant}" if variant else name)
    for node, (code, _) in enumerate(results):
        check(code == 0, f"{name}: node {node} exited with {code}")
    text = results[0][1]
    banner = re.findall(r"shard \d/2 of job '\S+': model size from the workers, (\d+) workers", text)
    check(len(banner) == 4 and set(banner) == {"2"},
          f"{name}: 2 slices x 2 shards, each seeing 2 workers (one per node): {banner}")
    check(re.search(r"\[slice 1 server 1\]", text), f"{name}: the shards are named by slice")
    # This model's slices are whole parameters, 200 and 104 elements: rank 0
    # (alone) says that slice 0 holds more than 1.25 even shares.
    warned = re.findall(r"\[rank (\d)\].*slice 0 holds 200 of the model's 304 elements, 1\.32 "
                        r"times an even share \(its largest parameter is .*, of 200 elements\)",
                        text + results[1][1])
    check(warned == ["0"], f"{name}: rank 0 alone warns that slice 0 is uneven: {warned}")
    may_differ = name == "ZeroOneAdam"
    check_slices(out, 2, 2)
    check_nodes_share(out, 2, 2, variant or "plain", may_differ)
    for k in range(2):
        check_ranks_match_simulator(f"{out}/slice-{k}", 2, STEPS, ranks_may_differ=may_differ)
    what = {"clamp": ", clamped after every step", "cuda": " on CUDA tensors"}.get(variant, "")
    print(f"PASS: {name}{what}: 2 nodes x 2 ranks, state sharded in 2 slices: one worker per node "
          "in each slice's job, the node's average of each slice pushed by its owner, which holds "
          f"that slice's state alone; every rank on the same bits; each slice the simulator with "
          f"N = 2 for {STEPS} steps")


def adam_as_the_leader():
    """fp32 Adam is element by element: sharding the state changes no bit."""
    out = tempfile.mkdtemp(prefix="morse-sharded-adam-")
    check(all(code == 0 for code, _ in run_nodes(out, "Adam:leader", how="leader")), "leader failed")
    check(all(code == 0 for code, _ in run_nodes(out, "Adam:full")), "sharded failed")
    for r in range(4):
        leader = json.load(open(f"{out}/params-{r}-leader.json"))
        sharded = json.load(open(f"{out}/params-{r}-full.json"))
        check(leader == sharded, f"rank {r}: Adam sharded differs from Adam with the leader")
    print(f"PASS: Adam (fp32) with the state sharded gives the leader's bits on every rank for "
          f"{STEPS} steps")


def restart(how):
    """A rank killed in step 5 of a job that checkpoints every 2 steps:
    morse-run --rank-restarts restarts its node's ranks, which rejoin from
    their checkpoints (a sharded node: the latest step every slice has,
    step 4, though slice 0's owner had written step 6's) and replay; every
    rank's parameters after every step, in either life, are the
    undisturbed run's bits."""
    out = tempfile.mkdtemp(prefix=f"morse-node-restart-{how}-")
    config = os.path.join(out, "job.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 2 }\n")
    extra = ("--config", config, "--rank-restarts", "1")
    for variant in ("steps", "kill"):
        results = run_nodes(out, f"OneBitAdam:{variant}", how=how, extra=extra)
        for node, (code, _) in enumerate(results):
            check(code == 0, f"{how} {variant}: node {node} exited with {code}")
    text = results[0][1]
    killed = 1 if how == "sharded" else 0
    check(re.search(rf"rank {killed} exited with -9[^\n]*; restarting this node's 2 ranks", text),
          f"{how}: node 0 restarts its 2 ranks: {text[-3000:]}")
    check(re.search(r"rank 1 life 1: from step 4", text), f"{how}: the node rejoins at step 4")
    for r in range(4):
        whole = json.load(open(f"{out}/life-{r}-steps-0.json"))
        check(sorted(map(int, whole)) == list(range(STEPS)), f"rank {r}: the undisturbed run")
        lives = sorted(glob.glob(f"{out}/life-{r}-kill-*.json"))
        check(len(lives) == (2 if r < 2 else 1), f"rank {r}: {len(lives)} lives")
        for path in lives:
            for step, bits in json.load(open(path)).items():
                check(bits == whole[step], f"{how}: rank {r} step {step} ({path}) differs from the "
                      "undisturbed run")
    print(f"PASS: {how}: a rank killed in step 5 restarts its node's ranks, which rejoin at step 4 "
          f"and end every step on the undisturbed run's bits")


def part_clips(model):
    """`part`'s clips, as a DDP script might make them: the first layer
    by CLIP, then the whole model by 3 CLIP; their norms."""
    return [float(torch.nn.utils.clip_grad_norm_(list(model[0].parameters()), CLIP)),
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), 3 * CLIP))]


def edit_clipped(model, step):
    """`edit`'s edits of the clipped gradient, on every rank as a DDP script
    makes them: the first layer's weight halved, the last bias zeroed every
    other step and in the others divided by 3."""
    with torch.no_grad():
        model[0].weight.grad.mul_(0.5)
        if step % 2 == 0:
            model[2].bias.grad.zero_()
        else:
            model[2].bias.grad.div_(3)


def save_clipped(out, rank, step, model):
    """.grad as clip_grad_norm_ left it on this rank (`any*` variants)."""
    numpy.save(f"{out}/clipped-{rank}-{step}.npy",
               torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy())


def edit_any(model, step):
    """`edit`'s other edits of the clipped gradient, which no factor per
    parameter gives, on every rank as a DDP script makes them: an add_ and
    a clamp_; a row zeroed (slice 0's parameter) followed by a second clip;
    a whole weight halved (slice 1's: a factor, while slice 0 is unchanged)
    followed by a second clip; or nothing."""
    with torch.no_grad():
        if step % 4 == 0:
            model[0].weight.grad.add_(0.01)
            model[2].weight.grad.clamp_(-0.02, 0.02)
        elif step % 4 == 1:
            model[0].weight.grad[0].zero_()
        elif step % 4 == 2:
            model[2].weight.grad.mul_(0.5)
    if step % 4 in (1, 2):
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)


def edit_after_clip(variants=("editleader", "editfull", "anyleader", "anyfull", "learnleader",
                              "learnfull"),
                    alone=("editone", "addone"), on=""):
    """`edit`: clip_grad_norm_ of the whole model, then .grad scaled and
    zeroed per parameter on every rank (`editleader`, `editfull`), or
    edited otherwise (`anyleader`, `anyfull`: edit_any; the step amended,
    design.md 2.6), fp32 Adam, on the leader's node and on the sharded
    node: the parameters DDP + AdamW's given the same edits of the clipped
    average (within 1e-6; without the edits further off), the shards'
    mirrors the workers' after every step. Local rank 1 alone editing
    (`editone`: a scaling, `addone`: an addition; the leader's node):
    every rank of both nodes fails, naming it. `on`="cuda": on CUDA
    tensors."""
    suffix = f"@{on}" if on else ""
    outs = {v: tempfile.mkdtemp(prefix=f"morse-sharded-{v}-") for v in variants}
    for variant, out in outs.items():
        check(all(code == 0 for code, _ in run_nodes(
            out, f"Adam:{variant}{suffix}", how="leader" if variant.endswith("leader") else "sharded")),
            f"{variant}{suffix}: the node's edits after the clip failed")
    worst, apart = 0.0, 0.0
    for variant, out in outs.items():
        edits_of = edit_any if variant.startswith(("any", "learn")) else edit_clipped
        reference, unedited = model_of(), model_of()
        ref_opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.0)
                    for m in (reference, unedited)]
        for step in range(STEPS):
            own = [numpy.load(f"{out}/own-{r}-{step}.npy") for r in range(4)]
            average = (node_average(own[:2]) + node_average(own[2:])) / numpy.float32(2)
            # (learnleader: step 0 trains on the clipped average unedited.)
            edited_here = not (variant.startswith("learn") and step == 0)
            for m, o, edits in ((reference, ref_opts[0], edited_here),
                                (unedited, ref_opts[1], False)):
                at = 0
                for p in m.parameters():
                    p.grad = torch.from_numpy(average[at:at + p.numel()].copy()).view_as(p)
                    at += p.numel()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 3 * CLIP)
                if edits and variant.startswith(("any", "learn")):
                    # Every rank's .grad after the clip: DDP's, the clipped
                    # average, the same bits on every rank.
                    ddp = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).numpy()
                    shown = [numpy.load(f"{out}/clipped-{r}-{step}.npy") for r in range(4)]
                    check(all(numpy.array_equal(s, shown[0]) for s in shown),
                          f"{variant} step {step}: the ranks' .grad after the clip differ")
                    off = float(numpy.abs(shown[0] - ddp).max() / numpy.abs(ddp).max())
                    check(off <= 1e-6, f"{variant} step {step}: .grad after the clip is {off} "
                          "(relative) from DDP's clipped average")
                if edits:
                    edits_of(m, step)
                o.step()
            want = flat(reference).numpy()
            for r in range(4):
                got = numpy.frombuffer(bytes.fromhex(
                    json.load(open(f"{out}/params-{r}-{variant}.json"))[step]), numpy.float32)
                worst = max(worst, float(numpy.abs(got - want).max()))
            apart = max(apart, float(numpy.abs(flat(unedited).numpy() - want).max()))
    check(worst <= 1e-6, f"the nodes' parameters are {worst} from DDP + AdamW's")
    check(apart > 100 * max(worst, 1e-8), f"the edits hardly matter here ({apart}): a weak test")
    for variant in alone:  # local rank 1 alone scales, or adds
        results = run_nodes(tempfile.mkdtemp(prefix=f"morse-sharded-{variant}-"),
                            f"Adam:{variant}{suffix}", how="leader")
        for node, (code, text) in enumerate(results):
            check(code != 0 and re.search(rf"local ranks \[1\] of node {node} changed \.grad "
                                          r"after clip_grad_norm_ in step 0 otherwise than its "
                                          r"leader", text),
                  f"{variant}: node {node}: a rank that alone edited after the clip is not named")
    print(f"PASS: edit: clip_grad_norm_, then .grad scaled (mul_, div_) and zeroed per parameter, or "
          "added to, clamped, a row zeroed and clipped again (.grad after the clip DDP's on "
          "every rank), on every rank of "
          f"the leader's and the sharded node: the parameters {worst:.2g} from DDP + AdamW's given "
          f"the same edits ({apart:.2g} without them), the mirrors the workers' after every step; "
          "local rank 1 alone editing stops both nodes, naming it"
          f"{' (on CUDA tensors: ' + ', '.join(variants) + ')' if on else ''}")


def edit_in_compression(on=""):
    """`own`: OneBitAdam on the sharded node, in its compression phase
    clip_grad_norm_ on every rank, then an addition and a row's halving of
    .grad (1-bit Adam's rule: the node's own gradient, in torch's order).
    Every rank's .grad after the clip is the same, torch's clip of the
    node's average (within 1e-6); each slice's owner pushed that slice of
    it as the edit left it, bit for bit; each slice's job the simulator fed
    those pushes. Local rank 1 alone editing (`ownone`): every rank of both
    nodes fails, naming it. `on`="cuda": on CUDA tensors (where .grad
    after a clip of the averaged gradient, in the warmup, stays the rank's
    own: design.md 2.6)."""
    suffix = f"@{on}" if on else ""
    out = tempfile.mkdtemp(prefix="morse-sharded-own-")
    check(all(code == 0 for code, _ in run_nodes(out, f"OneBitAdam:ownfull{suffix}")),
          "the sharded node's edits after the clip in the compression phase failed")
    sizes = [200, 20, 80, 4]
    if on != "cuda":
        check_shown_slices(out, 2, 2, range(FREEZE))
    check_slices(out, 2, 2, steps=range(FREEZE))
    for node in range(2):
        for step in range(FREEZE, STEPS):
            _, clipped = check_node_clip(out, node, step, 2)
            pushed = edited(clipped, sizes)
            for k in range(2):
                lo, hi = json.load(open(f"{out}/range-{k}.json"))
                got = numpy.load(f"{out}/slice-{k}/grad-{node}-{step}.npy")
                check(got.tobytes() == pushed[lo:hi].tobytes(), f"node {node} step {step}: slice "
                      f"{k}'s owner did not push .grad as the clip and the edit left it")
    check_nodes_share(out, 2, 2, "ownfull", False)
    for k in range(2):
        check_ranks_match_simulator(f"{out}/slice-{k}", 2, STEPS)
    results = run_nodes(tempfile.mkdtemp(prefix="morse-sharded-ownone-"), f"OneBitAdam:ownone{suffix}")
    for node, (code, text) in enumerate(results):
        check(code != 0 and re.search(rf"local ranks \[1\] of node {node} changed \.grad after "
                                      rf"clip_grad_norm_ in step {FREEZE} otherwise than local rank 0",
                                      text),
              f"ownone: node {node}: a rank that alone edited after the clip is not named")
    print("PASS: own: OneBitAdam's compression phase on the sharded node, clip_grad_norm_ then "
          ".grad added to and a row halved on every rank: .grad after the clip torch's clip of the "
          "node's average on every rank, each slice pushed as the edit left it, bit for bit, each "
          "slice's job the simulator's; local rank 1 alone editing stops both nodes, naming it"
          f"{' (on CUDA tensors)' if on else ''}")


def clip_part():
    """clip_grad_norm_ over the first layer, then the whole model, every
    step, on the leader's node and on the sharded node. fp32 Adam: DDP's
    norms on every rank, the parameters DDP + AdamW's (fed the nodes'
    averages, clipped by torch) within 1e-6. OneBitAdam: DDP's norms in
    its warmup, the node's own gradient's in its compression phase (1-bit
    Adam's rule, as for whole clips). Both: the shards' mirrors the
    workers' after every step (checked by the ranks)."""
    for name in ("Adam", "OneBitAdam"):
        outs = {v: tempfile.mkdtemp(prefix=f"morse-sharded-{name}-{v}-")
                for v in ("partleader", "partfull")}
        check(all(code == 0 for code, _ in run_nodes(outs["partleader"], f"{name}:partleader",
                                                     how="leader")), f"{name}: leader failed")
        check(all(code == 0 for code, _ in run_nodes(outs["partfull"], f"{name}:partfull")),
              f"{name}: sharded failed")
        worst, apart, acted = check_part_clips(name, outs)
        phase = "" if name == "Adam" else " (in the compression phase the node's own gradient's)"
        against = (f"the parameters {worst:.2g} from DDP + AdamW's after every step ({apart:.2g} "
                   "without the clips); " if name == "Adam" else "")
        print(f"PASS: {name}, clip_grad_norm_ over the first layer, then the whole model, on the "
              f"leader's and the sharded node: DDP's norms on every rank{phase}, the first "
              f"layer's clip acting in every step, the whole's in {acted} of {STEPS}; {against}"
              "the shards' mirrors the workers' after every step")


def check_part_clips(name, outs):
    """clip_part's norms, and for Adam its parameters against DDP + AdamW's
    with and without the clips: (worst, apart, steps the whole's clip acted)."""
    model = model_of()
    sizes = [p.numel() for p in model.parameters()]
    first = sizes[0] + sizes[1]  # the first layer's elements
    reference, unclipped = model_of(), model_of()
    ref_opts = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.0)
                for m in (reference, unclipped)]
    worst, apart, acted = 0.0, 0.0, 0
    for step in range(STEPS):
        # Each run's ranks computed their gradients from its own parameters.
        for variant, out in outs.items():
            own = [numpy.load(f"{out}/own-{r}-{step}.npy") for r in range(4)]
            nodes_avg = [node_average(own[:2]), node_average(own[2:])]
            average = (nodes_avg[0] + nodes_avg[1]) / numpy.float32(2)
            for r in range(4):
                # OneBitAdam's compression phase (freeze_step 3) clips the
                # node's own gradient.
                g = (average if name == "Adam" or step < 3 else nodes_avg[r // 2]).astype(numpy.float64)
                part = numpy.linalg.norm(g[:first])
                factor = min(1.0, CLIP / (part + 1e-6))
                whole = math.sqrt((part * factor) ** 2 + numpy.linalg.norm(g[first:]) ** 2)
                got = json.load(open(f"{out}/norms-{r}-{variant}.json"))[step]
                for call, (have, want) in enumerate(zip(got, (part, whole))):
                    check(abs(have - want) <= 1e-5 * want, f"{name} {variant} rank {r} step {step} "
                          f"call {call}: clip_grad_norm_ gave {have}, DDP's is {want}")
                check(part > CLIP, f"{name} step {step}: the first layer's clip did not act")
                acted += variant == "partleader" and r == 0 and whole > 3 * CLIP
            if variant == "partleader" and name == "Adam":
                for m, o, clips in ((reference, ref_opts[0], True), (unclipped, ref_opts[1], False)):
                    at = 0
                    for p in m.parameters():
                        p.grad = torch.from_numpy(average[at:at + p.numel()].copy()).view_as(p)
                        at += p.numel()
                    if clips:
                        torch.nn.utils.clip_grad_norm_(list(m[0].parameters()), CLIP)
                        torch.nn.utils.clip_grad_norm_(m.parameters(), 3 * CLIP)
                    o.step()
        if name != "Adam":
            continue
        want, off = flat(reference).numpy(), flat(unclipped).numpy()
        for variant, out in outs.items():
            for r in range(4):
                got = numpy.frombuffer(bytes.fromhex(
                    json.load(open(f"{out}/params-{r}-{variant}.json"))[step]), numpy.float32)
                worst = max(worst, float(numpy.abs(got - want).max()))
        apart = max(apart, float(numpy.abs(off - want).max()))
    if name == "Adam":
        check(worst <= 1e-6, f"the nodes' parameters are {worst} from DDP + AdamW's")
        check(apart > 100 * max(worst, 1e-8), f"the clips hardly matter here ({apart}): a weak test")
    return worst, apart, acted


def clip_as_the_leader():
    """clip_grad_norm_ after backward() on every rank, fp32 Adam: the
    sharded node returns DDP's norm (of the job's averaged gradient,
    combined from the slices' norms) on every rank and clips every slice
    by its factor, so its parameters follow the leader's run, whose clip
    is the node worker's own, to float rounding (each slice's session
    clips by the L2 max_norm that gives it the model's factor)."""
    for name in ("OneBitAdam", "Adam"):
        # OneBitAdam's compression phase (from step 3): the norm of the
        # node's own gradient (1-bit Adam's rule, as for a worker).
        out = tempfile.mkdtemp(prefix="morse-sharded-clip-")
        check(all(code == 0 for code, _ in run_nodes(out, f"{name}:clipfull")), "sharded failed")
        for step in range(STEPS):
            own = [numpy.load(f"{out}/own-{r}-{step}.npy") for r in range(4)]
            nodes_avg = [node_average(own[:2]).astype(numpy.float64),
                         node_average(own[2:]).astype(numpy.float64)]
            for r in range(4):
                want = numpy.linalg.norm((nodes_avg[0] + nodes_avg[1]) / 2
                                         if name == "Adam" or step < 3 else nodes_avg[r // 2])
                got = json.load(open(f"{out}/norms-{r}-clipfull.json"))[step]
                check(abs(got - want) <= 1e-5 * want and got > CLIP,
                      f"{name} rank {r} step {step}: clip_grad_norm_ gave {got}, DDP's is {want}")
    check(all(code == 0 for code, _ in run_nodes(out, "Adam:clipleader", how="leader")),
          "leader failed")
    # clip_grad_norm= (the job's clip) on the sharded node and on the leader.
    check(all(code == 0 for code, _ in run_nodes(out, "Adam:clipjobleader", how="leader")),
          "leader with clip_grad_norm= failed")
    check(all(code == 0 for code, _ in run_nodes(out, "Adam:clipjob")),
          "sharded with clip_grad_norm= failed")
    worst = 0.0
    for r in range(4):
        for leader, sharded in (("clipleader", "clipfull"), ("clipjobleader", "clipjob")):
            leader = json.load(open(f"{out}/params-{r}-{leader}.json"))
            sharded = json.load(open(f"{out}/params-{r}-{sharded}.json"))
            check(len(leader) == len(sharded) == STEPS, "a run's steps are missing")
            for a, b in zip(leader, sharded):
                a, b = (numpy.frombuffer(bytes.fromhex(h), numpy.float32) for h in (a, b))
                worst = max(worst, float(numpy.abs(a - b).max()))
        check(json.load(open(f"{out}/params-{r}-clipleader.json")) ==
              json.load(open(f"{out}/params-{r}-clipjobleader.json")),
              "the leader's clip_grad_norm_ and clip_grad_norm= differ")
    check(worst <= 1e-6, f"the sharded node's clipped run is {worst} from the leader's")
    print(f"PASS: clip_grad_norm_ on a sharded node: DDP's norm on every rank (OneBitAdam's "
          f"compression phase: the node's own), every step clipped; Adam's parameters, by "
          f"clip_grad_norm_ or clip_grad_norm=, {worst:.2g} from the leader's run after "
          f"{STEPS} steps (where the two clips give the same bits)")


def one_node_of_three():
    out = tempfile.mkdtemp(prefix="morse-sharded-one-")
    command = [os.environ["MORSE_RUN"], "--servers", "1", "--workers", "3",
               "--node-aggregation=sharded", "--", sys.executable, __file__, "--worker", out,
               "OneBitAdam"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240)
    if result.returncode != 0:
        print(result.stdout[-4000:])
    check(result.returncode == 0, "3 ranks in one node failed")
    check_slices(out, 1, 3)
    check_nodes_share(out, 1, 3, "plain", False)
    for k in range(3):
        check_ranks_match_simulator(f"{out}/slice-{k}", 1, STEPS)
    print("PASS: one node of 3 ranks: 3 slices, ((g0 + g1) + g2) / 3 of each pushed by its owner")


def resume():
    whole = tempfile.mkdtemp(prefix="morse-sharded-whole-")
    check(all(code == 0 for code, _ in run_nodes(whole, "OneBitAdam")), "the whole run failed")
    out = tempfile.mkdtemp(prefix="morse-sharded-resume-")
    check(all(code == 0 for code, _ in run_nodes(out, "OneBitAdam:resume_first")), "steps 0-3 failed")
    check(all(code == 0 for code, _ in run_nodes(out, "OneBitAdam:resume")), "steps 4-7 failed")
    for r in range(4):
        first = json.load(open(f"{out}/params-{r}-resume_first.json"))
        then = json.load(open(f"{out}/params-{r}-resume.json"))
        check(first + then == json.load(open(f"{whole}/params-{r}-plain.json")),
              f"rank {r}: the resumed run differs from the uninterrupted one")
    results = run_nodes(out, "OneBitAdam:resume_other")
    text = results[0][1]
    check(results[0][0] != 0 and re.search(r"refused: this state_dict holds slice 1 of 2's "
                                           r"optimizer state, this rank trains slice 0 of 2", text),
          "rank 0 given rank 1's state is refused, naming both slices")
    print("PASS: each rank's state_dict after 4 steps, loaded into a fresh job, gives the bits of "
          "an uninterrupted run of 8; another slice's state is refused")


def wrong_use():
    out = tempfile.mkdtemp(prefix="morse-sharded-wrong-")
    results = run_nodes(out, "OneBitAdam:clamp_one")
    for node in (0,):
        code, text = results[node]
        check(code != 0, "a node whose rank 1 alone clamped its weights should fail")
        for rank in (0, 1):
            # Each slice's owner compares the ranks' copies of its slice:
            # slice 0's finds rank 1's changed, slice 1's rank 0's unchanged.
            check(re.search(rf"\[rank {rank}\].*local ranks \[{1 - rank}\] of node 0 hold other "
                            rf"parameters of slice {rank} than local rank {rank}, which steps it, "
                            r"after step 2 .*same way on every rank", text),
                  f"rank {rank} names the rank whose copy of its slice differs")
    # A local rank killed at step 3: every rank of both nodes stops, the
    # dead one named, within the test's timeout (no hang in the node's
    # collectives or the other node's exchange).
    results = run_nodes(out, "OneBitAdam:kill")
    check(results[0][0] != 0 and re.search(r"rank 1 exited with -9", results[0][1]),
          "node 0 names its killed rank")
    # (Rank 0, losing its node's group, may go at once too: both named.)
    check(results[1][0] != 0 and re.search(r"the job stopped: node 0: .*rank 1 exited with -9",
                                           results[1][1]), "node 1 stops, naming node 0's killed rank")
    command = [os.environ["MORSE_RUN"], "--servers", "1", "--workers", "2",
               "--node-aggregation=sharded", "--", sys.executable, __file__, "--worker", out,
               "OneBitAdam"]
    command[2:3] = ["127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=60)
    print(result.stdout[-800:])
    check(result.returncode == 2 and "do not split into the 2 slices" in result.stdout,
          "3 listed shards for 2 slices are refused")
    results = nodes(__file__, 2, 1, "-", "Adam",
                    extra=[("--node-aggregation=sharded",), ("--node-aggregation",)], timeout=120)
    for node, (code, text) in enumerate(results):
        print(text[-1000:])
        check(code != 0 and "--node-aggregation=sharded" in text and "every node must give the same"
              in text, f"node {node}: the disagreement on the mode is named")
    print("PASS: a killed local rank stops both nodes, naming it; weights changed on one rank "
          "only, a slice too small for its "
          "shards, more ranks than parameters, shards that do not split into the slices and nodes "
          "that disagree on the mode fail, saying so")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(*sys.argv[-2:])
        sys.exit(0)
    # ctest runs the modes in these parts, each a test of its own
    # (python_node_sharding_optimizers, ...): a part's name runs its modes.
    parts = {"optimizers": ["OneBitAdam", "Adam", "ZeroOneAdam", "OneBitLamb", "clamp", "cuda", "leader",
                            "three"],
             "clips": ["clip", "part"],
             "edits": ["edit", "own"],
             "recovery": ["resume", "interval_resume", "restart_sharded", "restart_leader",
                          "wrong"]}
    for mode in modes_of(parts):
        if mode == "clamp":
            two_nodes("OneBitAdam", "clamp")
            # Before, right after and inside ZeroOneAdam's local intervals.
            two_nodes("ZeroOneAdam", "clamp")
        elif mode == "cuda":
            # CUDA tensors (the 4 ranks sharing this host's GPU; staged
            # through the host inside each node): where there is a GPU.
            if has_cuda("CUDA tensors with the sharded node state"):
                two_nodes("OneBitAdam", "cuda")
                edit_in_compression(on="cuda")
                edit_after_clip(("learnleader", "learnfull"), alone=("addone",),
                                on="cuda")
        elif mode == "leader":
            adam_as_the_leader()
        elif mode == "clip":
            clip_as_the_leader()
        elif mode == "part":
            clip_part()
        elif mode == "edit":
            edit_after_clip()
        elif mode == "own":
            edit_in_compression()
        elif mode.startswith("restart_"):
            restart(mode[len("restart_"):])
        elif mode == "three":
            one_node_of_three()
        elif mode == "resume":
            resume()
        elif mode == "interval_resume":
            interval_resume("--node-aggregation=sharded")
        elif mode == "wrong":
            wrong_use()
        else:
            two_nodes(mode)
