"""Node-local aggregation (morse-run --node-aggregation; issue 37, part 1,
first cut): one Morse worker per node.

1. 2 nodes x 2 ranks (two morse-run invocations on this machine, as on two
   hosts), for each of the four optimizers: the shards see 2 workers, not
   4; each node's leader pushes the average of its ranks' gradients (equal,
   bit for bit, to (g0 + g1) / 2 formed here from what each rank computed);
   after every step every rank of a node holds its leader's parameters, and
   the leaders hold what the simulator with N = 2 fed those averages holds
   (and each other's bits, except zero_one_adam's local steps). After the
   first step the leader pushes a partition before the last bucket's
   average is in.
   On a GPU host, also OneBitAdam on CUDA tensors, and `edit` (3b) on
   them (skipped, saying so, without a GPU).
2. One host, 3 ranks in one node: one worker, the average in local-rank
   order ((g0 + g1) + g2) / 3, the simulator with N = 1.
3. Weights loaded after building the optimizer, before the first step,
   and weights changed after every step on every rank (a WGAN critic's
   clamp_): the job's, the leaders bit-identical to the simulator fed the
   same changes and the shards' model theirs (ZeroOneAdam too: a clamp
   right after a sync whose next step is local is the next interval's
   anchor, one inside an interval the node's own x_i); changed on one rank of a
   node only: every rank of the node fails, saying to change them the
   same way on every rank (clamp_one; load_one before the first step).
3b. clip_grad_norm_ on every rank (`clip`): DDP's norm; in the
   compression phase the node's own (1-bit Adam's rule), torch's clip of
   the node's average on every rank's .grad, with the bits of the job's
   clip_grad_norm (the leaders the simulator's with it). `edit`: in the
   compression phase an addition and a row's halving of .grad after the
   clip on every rank, pushed by the leader bit for bit as torch's order
   leaves them; `edit_one`: local rank 1 alone editing fails every rank of
   the node, naming it.
3c. ZeroOneAdam saved inside a local interval (each node on parameters
   of its own) and resumed by a fresh job, every rank loading rank 0's
   model and its own state: every rank's parameters after every later
   step the uninterrupted run's (interval_resume).
4. Ranks of a node that set different learning rates (or overlap): every
   rank of the node fails naming the values; nodes that disagree on --node-aggregation
   fail the rendezvous saying so.
5. The node's values move through shared memory wherever this host has
   /dev/shm (every rank says which way its node went); `gloo`: one rank of
   each node without it (a folder that does not exist, MORSE_NODE_SHM=0)
   takes its whole node through gloo's sockets, node 0 saying why once,
   with the same bits."""
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

import numpy
import torch

from harness import check, check_ranks_match_simulator, has_cuda, modes_of, nodes  # noqa: E402

STEPS = 8
# interval_resume: ZeroOneAdam saved after s = 7 (between the syncs of 6 and
# 8), the run going on to s = 12.
INTERVAL_SAVE, INTERVAL_STEPS = 7, 12
FREEZE = 3  # the compressed optimizers' freeze step (build)
CLIP = 0.05  # clip_grad_norm_'s max_norm in the clip runs: below every step's norm here


def build(name, params, lr, **more):
    import morse.torch
    common = dict(block_elems=16, partition_elems=64, **more)
    if name == "Adam":
        return morse.torch.Adam(params, lr=lr, **common)
    if name == "OneBitAdam":
        return morse.torch.OneBitAdam(params, lr=lr, freeze_step=FREEZE, **common)
    if name == "ZeroOneAdam":
        return morse.torch.ZeroOneAdam(params, lr=lr, var_freeze_step=3, var_update_scaler=1,
                                       local_step_scaler=2, local_step_clipper=4, **common)
    if name == "OneBitLamb":
        return morse.torch.OneBitLamb(params, lr=lr, freeze_step=3, **common)
    raise ValueError(name)


def interval_worker(out, resumed):
    """ZeroOneAdam on 2 nodes x 2 ranks for 12 steps: each rank saves its
    state_dict() after s = 7, between the syncs of 6 and 8 (each node on
    parameters of its own), rank 0 also the model; `resumed`: a fresh job
    from there (every rank loading rank 0's model, as Trainer does, and its
    own state). Each rank writes its parameters' digest after every step."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    opt = build("ZeroOneAdam", model.parameters(), 0.01)
    first = 0
    if resumed:
        model.load_state_dict(torch.load(f"{out}/model.pt"))
        opt.load_state_dict(torch.load(f"{out}/opt-{rank}.pt"))
        first = INTERVAL_SAVE
    digests = {}
    for step in range(first, INTERVAL_STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        digests[step] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        if step + 1 == INTERVAL_SAVE and not resumed:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = opt.state_dict()
            check(not caught, f"rank {rank} warned {[str(w.message) for w in caught]}")
            inner = state["state"]
            # (every rank of a sharded node steps its slice; else the leader)
            steps = int(os.environ["LOCAL_RANK"]) == 0 or "interval_others" in inner
            check("interval_x" in inner and (not steps or inner.get("inside_interval") == [7, 6]),
                  f"rank {rank}: the state inside the interval: {sorted(inner)}")
            torch.save(state, f"{out}/opt-{rank}.pt")
            if rank == 0:
                torch.save(model.state_dict(), f"{out}/model.pt")
    json.dump(digests, open(f"{out}/{'resumed' if resumed else 'whole'}-{rank}.json", "w"))


def interval_resume(aggregation="--node-aggregation"):
    """interval_worker's two jobs, under `aggregation` (test_node_sharding:
    =sharded): every rank of the resumed one on the uninterrupted run's
    parameters after every step."""
    out = tempfile.mkdtemp(prefix="morse-aggregate-interval-")
    runs = {}
    for mode in ("ZeroOneAdam:interval_save", "ZeroOneAdam:interval_resumed"):
        results = nodes(__file__, 2, 2, out, mode, extra=("--servers", "2", aggregation))
        for node, (code, text) in enumerate(results):
            if code != 0:
                print(f"--- node {node} (exit {code}):\n{text[-4000:]}")
            check(code == 0, f"{mode}: node {node} exited with {code}")
    for kind in ("whole", "resumed"):
        runs[kind] = [json.load(open(f"{out}/{kind}-{rank}.json")) for rank in range(4)]
    at_save = str(INTERVAL_SAVE - 1)
    check(runs["whole"][0][at_save] == runs["whole"][1][at_save]
          and runs["whole"][0][at_save] != runs["whole"][2][at_save],
          "after s = 7 the ranks of a node agree and the nodes differ (a local interval)")
    for rank in range(4):
        for step in range(INTERVAL_SAVE, INTERVAL_STEPS):
            check(runs["resumed"][rank][str(step)] == runs["whole"][rank][str(step)],
                  f"rank {rank} step {step}: resumed {runs['resumed'][rank][str(step)]}, "
                  f"whole {runs['whole'][rank][str(step)]}")
    shutil.rmtree(out, ignore_errors=True)
    print(f"PASS: ZeroOneAdam, 2 nodes x 2 ranks ({aggregation}), saved inside a local "
          f"interval (s = {INTERVAL_SAVE}) and resumed by a fresh job: every rank's parameters the "
          f"uninterrupted run's after each of steps {INTERVAL_SAVE + 1}..{INTERVAL_STEPS}, through "
          "the syncs of 8 and 12")


def worker(out, mode):
    name, _, variant = mode.partition(":")
    if variant.startswith("interval_"):
        interval_worker(out, variant == "interval_resumed")
        return
    variant, _, on = variant.partition("@")  # VARIANT@cuda: on CUDA tensors
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    node = int(os.environ["MORSE_NODE_RANK"])
    torch.manual_seed(5)
    device = torch.device("cuda" if "cuda" in (variant, on) else "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4)).to(device)
    lr = 0.02 if variant == "lr" and rank == 1 else 0.01
    if variant == "gloo" and local == 1:
        # One rank of each node cannot use shared memory (node 0: no such
        # folder; node 1: MORSE_NODE_SHM=0): its whole node goes through
        # gloo, and node 0 says why.
        os.environ["MORSE_NODE_SHM_DIR" if node == 0 else "MORSE_NODE_SHM"] = (
            "/nonexistent/morse-shm" if node == 0 else "0")
    more = {"accumulation_steps": 2} if variant == "accum" else {}
    if variant == "overlap_one":
        more["overlap"] = rank == 0
    opt = build(name, model.parameters(), lr, **more)
    json.dump(opt._node._staging is not None, open(f"{out}/shared-{rank}.json", "w"))
    if variant == "load" or (variant == "load_one" and rank == 1):
        # Weights loaded after building the optimizer, on every rank (or on
        # one only, load_one: the node refuses it).
        torch.manual_seed(9)
        model.load_state_dict(torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(),
                                                  torch.nn.Linear(20, 4)).state_dict())
    if rank == 0:
        # The script's clip_grad_norm_ is the job's clip_grad_norm for the
        # simulator (as test_onebit_identical shows for a worker per rank).
        clip = f"\nclip_grad_norm: {CLIP!r}" if variant == "clip" else ""
        with open(os.environ["MORSE_CONFIG"]) as f:
            json.dump({"base": f.read(), "overrides": opt.job_overrides + clip},
                      open(f"{out}/job.json", "w"))
        numpy.save(f"{out}/x0.npy", torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy())
    checksums, params, norms = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 10, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if variant in ("accum", "accum_learned"):  # two backward() calls a step
            torch.nn.functional.cross_entropy(model(x * 0.5), y).backward()
        if variant == "scaled":  # an edit after backward() sent the gradients to the node
            with torch.no_grad():
                for p in model.parameters():
                    p.grad.mul_(0.5)
        mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        numpy.save(f"{out}/own-{rank}-{step}.npy", mine.cpu().numpy())
        if variant in ("clip", "edit", "edit_one"):
            # Every rank, as a DDP script does. edit: the norm alone before
            # the compression phase (max_norm inf: the steps clip nothing, as
            # the simulator without clip_grad_norm), then a clip and .grad
            # edited after it on every rank (edit_one: on local rank 1 alone).
            clips = variant == "clip" or step >= FREEZE
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                              CLIP if clips else math.inf)))
            clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            numpy.save(f"{out}/clipped-{rank}-{step}.npy", clipped.cpu().numpy())
            if clips and (variant == "edit" or (variant == "edit_one" and local == 1)):
                edit_clipped(model)
        opt.step()
        # The node's buckets (of about partition_elems) left during backward()
        # (overlap), all of them but where the step edited or accumulated
        # without saying so; the job's partitions are 64 elements, so several.
        # On CUDA tensors the node gathers at step() (no buckets yet: a
        # bucket's copy to the host in a hook would hold up backward()).
        early, total = opt._buckets_in_backward or (0, 0)
        if device.type == "cuda":
            check(total == 0, f"rank {rank} step {step}: {total} buckets on CUDA tensors")
        elif variant not in ("scaled", "accum_learned") or step == 0:
            check(total >= 2 and early == total,
                  f"rank {rank} step {step}: {early} of {total} buckets left during backward()")
        elif step > 0:
            check(opt._node_buckets is None, f"rank {rank} step {step}: still overlapping")
        if local == 0 and step > 0 and variant in ("", "clamp", "accum"):
            # The leader pushed a partition whose parameters' averages were
            # in before the step's last bucket was.
            check(opt._pushed_before_last > 0, f"rank {rank} step {step}: the leader pushed "
                  "nothing before the last bucket's average")
        if local == 0:  # the leader's flat gradient holds what it pushed: the node's average
            numpy.save(f"{out}/grad-{node}-{step}.npy", opt._flat_grad.cpu().numpy())
        checksums.append(opt.checksum())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        params.append(flat.numpy().tobytes().hex()[:64] + f"{float(flat.double().sum()):.17g}")
        if clamp_weights(model, variant, rank, step) and local == 0:
            # The job's weights (rank 0 saves them for the simulator), or
            # inside a ZeroOneAdam local interval the node's own x_i.
            inside = opt._session.exchanged_step != opt.step_index
            if rank == 0 or inside:
                numpy.save(f"{out}/x-{step + 1}{f'-{node}' if inside else ''}.npy",
                           torch.cat([p.detach().reshape(-1)
                                      for p in model.parameters()]).cpu().numpy())
    if local == 0:
        json.dump(checksums, open(f"{out}/checksums-{node}.json", "w"))
        # The shards' model is the leader's (their hashes of x).
        json.dump(opt._holds_shards_model(), open(f"{out}/holds-{node}.json", "w"))
    json.dump(params, open(f"{out}/params-{rank}.json", "w"))
    json.dump(norms, open(f"{out}/norms-{rank}.json", "w"))
    print(f"rank {rank} (node {node}, local {local}): done, step_index {opt.step_index}")


def edit_clipped(model):
    """Edits after clip_grad_norm_ that are no scaling of a whole
    parameter: an addition to the first layer's weights, a row of the
    last's halved."""
    with torch.no_grad():
        model[0].weight.grad.add_(1e-3)
        model[2].weight.grad[0].mul_(0.5)


def edited(flat, sizes):
    """edit_clipped on a flat gradient (numpy float32), the same bits."""
    flat = flat.copy()
    flat[:sizes[0]] += numpy.float32(1e-3)
    row = sizes[0] + sizes[1]
    flat[row:row + 20] *= numpy.float32(0.5)
    return flat


def clamp_weights(model, variant, rank, step):
    """A WGAN critic's weight clipping after step `step`: on every rank
    (variant clamp, but after the last step), or on rank 1 alone after
    step 2 (clamp_one: the node refuses it). Whether it clamped."""
    if not ((variant == "clamp" and step < STEPS - 1)
            or (variant == "clamp_one" and rank == 1 and step == 2)):
        return False
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.15, 0.15)
    return True


def node_average(own):
    """((g0 + g1) + ...) / L in float32, in local-rank order."""
    total = own[0].copy()
    for g in own[1:]:
        total += g
    total /= numpy.float32(len(own))
    return total


def check_node_averages(out, nnodes, local_size, steps=range(STEPS)):
    """Each leader pushed ((g0 + g1) + ...) / L of its node's own gradients."""
    for node in range(nnodes):
        for step in steps:
            own = [numpy.load(f"{out}/own-{node * local_size + r}-{step}.npy") for r in range(local_size)]
            total = node_average(own)
            pushed = numpy.load(f"{out}/grad-{node}-{step}.npy")
            check(pushed.tobytes() == total.tobytes(), f"node {node} step {step}: the pushed gradient "
                  "is not the node's average in local-rank order")


def shown_average(out, nnodes, local_size, step, max_norm):
    """A step that averages, clipped by clip_grad_norm_(…, max_norm) on
    every rank: every rank's .grad after the call (clipped-R-STEP.npy) is
    DDP's, the clipped job average, the same bits on every rank, within
    1e-6 of torch's clip of the average (relative: torch sums the norm in
    another order). Returns (the nodes' averages, which the stepping ranks
    pushed, and what .grad held)."""
    averages = [node_average([numpy.load(f"{out}/own-{n * local_size + r}-{step}.npy")
                              for r in range(local_size)]) for n in range(nnodes)]
    job = sum(a.astype(numpy.float64) for a in averages) / nnodes
    shown = [numpy.load(f"{out}/clipped-{r}-{step}.npy") for r in range(nnodes * local_size)]
    check(all(s.tobytes() == shown[0].tobytes() for s in shown),
          f"step {step}: .grad after clip_grad_norm_ differs between the ranks")
    want = job * min(1.0, max_norm / (numpy.linalg.norm(job) + 1e-6))
    off = float(numpy.abs(shown[0] - want).max() / numpy.abs(want).max())
    check(off <= 1e-6, f"step {step}: .grad after clip_grad_norm_ is {off} (relative) from "
          "DDP's clipped average")
    return averages, shown[0]


def check_shown_averages(out, nnodes, local_size, variant, steps):
    """The steps that average of the clip variants (CLIP's clip, or
    `edit`'s max_norm inf: none): .grad after the call DDP's on every rank
    (shown_average) and in the leader's after step() (grad-NODE-STEP.npy).
    The gradients recorded for the simulator become the nodes' averages,
    which the leaders pushed."""
    for step in steps:
        averages, shown = shown_average(out, nnodes, local_size, step,
                                        CLIP if variant == "clip" else math.inf)
        for n in range(nnodes):
            kept = numpy.load(f"{out}/grad-{n}-{step}.npy")
            check(kept.tobytes() == shown.tobytes(),
                  f"step {step}: node {n}'s leader does not keep the shown average")
            numpy.save(f"{out}/grad-{n}-{step}.npy", averages[n])


def check_clip_norms(out, nnodes, local_size, freeze):
    """Every rank's clip_grad_norm_ returned DDP's norm: of the job's
    averaged gradient (the nodes' averages averaged) before `freeze`, of its
    node's own after (1-bit Adam's rule), equal on every rank of a node."""
    norms = [json.load(open(f"{out}/norms-{r}.json")) for r in range(nnodes * local_size)]
    for step in range(STEPS):
        nodes_avg = [node_average([numpy.load(f"{out}/own-{n * local_size + r}-{step}.npy")
                                   for r in range(local_size)]).astype(numpy.float64)
                     for n in range(nnodes)]
        job = sum(nodes_avg) / nnodes
        for r in range(nnodes * local_size):
            node = r // local_size
            want = numpy.linalg.norm(job if step < freeze else nodes_avg[node])
            check(abs(norms[r][step] - want) <= 1e-5 * want,
                  f"rank {r} step {step}: clip_grad_norm_ gave {norms[r][step]}, DDP's is {want}")
            check(norms[r][step] == norms[node * local_size][step],
                  f"rank {r} step {step}: not its leader's norm")
            check(norms[r][step] > CLIP, f"step {step}: the clip did not act ({norms[r][step]})")


def check_node_clip(out, node, step, local_size):
    """A compressing step's clip_grad_norm_ on a node (torch's own on the
    node's average): every rank's .grad after it (clipped-R-STEP.npy) the
    same, within 1e-6 of torch's clip of the node's average (torch sums the
    norm in another order). Returns (the average, the clipped gradient)."""
    ranks = range(node * local_size, (node + 1) * local_size)
    average = node_average([numpy.load(f"{out}/own-{r}-{step}.npy") for r in ranks])
    clipped = [numpy.load(f"{out}/clipped-{r}-{step}.npy") for r in ranks]
    check(all(c.tobytes() == clipped[0].tobytes() for c in clipped),
          f"node {node} step {step}: .grad after clip_grad_norm_ differs between its ranks")
    norm = numpy.linalg.norm(average.astype(numpy.float64))
    want = average * numpy.float32(CLIP / (norm + 1e-6))
    check(norm > CLIP and numpy.allclose(clipped[0], want, rtol=1e-6, atol=0),
          f"node {node} step {step}: .grad after clip_grad_norm_ is not torch's clip of the "
          f"node's average: {numpy.abs(clipped[0] - want).max()} apart")
    return average, clipped[0]


def check_own_clips(out, nnodes, local_size, variant, sizes):
    """The compression phase of the clip variants (each node clips its
    own gradient, 1-bit Adam's rule): every rank's .grad after
    clip_grad_norm_ is its leader's, torch's clip of the node's average (to
    float rounding: torch sums the norm in another order), as DDP's inside
    the node; the leader pushed .grad as the ranks left it (`edit`: edited
    after the clip, bit for bit). `clip`: the gradients recorded for the
    simulator become the nodes' averages, which the simulator with the
    job's clip_grad_norm clips, to check the bits of the clip."""
    for node in range(nnodes):
        for step in range(FREEZE, STEPS):
            average, clipped = check_node_clip(out, node, step, local_size)
            pushed = numpy.load(f"{out}/grad-{node}-{step}.npy")
            expected = edited(clipped, sizes) if variant == "edit" else clipped
            check(pushed.tobytes() == expected.tobytes(),
                  f"node {node} step {step}: the leader did not push .grad as the clip "
                  f"{'and the edit ' if variant == 'edit' else ''}left it")
            if variant == "clip":
                numpy.save(f"{out}/grad-{node}-{step}.npy", average)


def check_nodes_share(out, nnodes, local_size, nodes_may_differ):
    params = [json.load(open(f"{out}/params-{r}.json")) for r in range(nnodes * local_size)]
    for r, p in enumerate(params):
        leader = (r // local_size) * local_size
        check(p == params[leader], f"rank {r} differs from its node's leader (rank {leader})")
        check(nodes_may_differ or p == params[0], f"rank {r} differs from rank 0")


def shm_usable():
    """Whether this host gives the node's ranks shared memory (/dev/shm)."""
    try:
        with tempfile.NamedTemporaryFile(dir="/dev/shm"):
            return True
    except OSError:
        return False


def check_shared(out, ranks, expected, what):
    shared = [json.load(open(f"{out}/shared-{r}.json")) for r in range(ranks)]
    check(shared == [expected] * ranks, f"{what}: the nodes' ranks exchange through "
          f"{'shared memory' if expected else 'gloo'}: {shared}")


def two_nodes(name, variant=""):
    """`variant` may end in @cuda: on CUDA tensors, where .grad after a
    clip of the averaged gradient stays the rank's own until the script is
    seen editing it (design.md 2.6)."""
    out = tempfile.mkdtemp(prefix=f"morse-aggregate-{name}-")
    mode = f"{name}:{variant}" if variant else name
    variant, _, on = variant.partition("@")
    results = nodes(__file__, 2, 2, out, mode, extra=("--servers", "2", "--node-aggregation"))
    for node, (code, text) in enumerate(results):  # every failing node's output before the verdict
        if code != 0:
            print(f"--- node {node} (exit {code}):\n{text[-4000:]}")
    for node, (code, text) in enumerate(results):
        check(code == 0, f"{name}: node {node} exited with {code}")
    banner = re.findall(r"shard \d/2 of job '\S+': model size from the workers, (\d+) workers", results[0][1])
    check(banner and set(banner) == {"2"}, f"{name}: the shards see 2 workers (one per node): {banner}")
    may_differ = name == "ZeroOneAdam"
    own_clips = variant in ("clip", "edit")  # the compression phase's clip is the node's own
    if own_clips and on == "cuda":
        check_node_averages(out, 2, 2, range(FREEZE))
    elif own_clips:
        check_shown_averages(out, 2, 2, variant, range(FREEZE))
    else:
        check_node_averages(out, 2, 2, range(STEPS))
    if own_clips:
        check_own_clips(out, 2, 2, variant, [200, 20, 80, 4])
    check_shared(out, 4, shm_usable() and variant != "gloo", name)
    fell_back = [len(re.findall(r"exchanges its gradients through gloo's sockets, not shared memory: "
                                r"local rank 1 could not map", text)) for _, text in results]
    check(fell_back == ([1, 0] if variant == "gloo" else [0, 0]) or not shm_usable(),
          f"{name}: the node a rank of which could not map its region says so once: {fell_back}")
    if own_clips:
        check_clip_norms(out, 2, 2, FREEZE)
    check_nodes_share(out, 2, 2, may_differ)
    for node in range(2):  # zero_one_adam's shards hold the last sync's model
        check(may_differ or json.load(open(f"{out}/holds-{node}.json")),
              f"{name}: the shards' model is not node {node}'s leader's")
    check_ranks_match_simulator(out, 2, STEPS, ranks_may_differ=may_differ)
    warned = [len(re.findall(r"changed gradients after backward\(\) had sent them", text))
              for _, text in results]
    if variant in ("scaled", "accum_learned"):
        check(warned == [2, 2], f"{name}: each rank warns once that its node gathers at step() "
              f"from the edited step on: {warned}")
    else:
        check(warned == [0, 0], f"{name}: a node fell back to gathering at step(): {warned}")
    what = {"cuda": " on CUDA tensors", "clamp": ", clamped after every step",
            "scaled": ", .grad scaled after backward() (the overlap gives way to step())",
            "accum": ", two backward() a step with accumulation_steps=2 (overlapped)",
            "accum_learned": ", two backward() a step without accumulation_steps (the overlap "
                             "gives way to step())",
            "clip": ", clip_grad_norm_ after backward() on every rank (DDP's norm and, in the "
                    "warmup, DDP's clipped average in .grad on every rank; in the compression "
                    "phase torch's clip of the node's average, .grad on every rank)",
            "edit": ", in the compression phase clip_grad_norm_, then .grad added to and a row "
                    "halved on every rank (pushed as torch's order gives them)",
            "load": ", weights loaded after building it",
            "gloo": ", one rank of each node without shared memory (its node through gloo)"}.get(
                variant, "") + (" on CUDA tensors" if on == "cuda" else "")
    print(f"PASS: {name}{what}: 2 nodes x 2 ranks with node "
          "aggregation: one worker per node, the node "
          f"average pushed, every rank on its leader's bits, the simulator with N = 2 for {STEPS} steps")


def one_node_of_three():
    out = tempfile.mkdtemp(prefix="morse-aggregate-one-")
    command = [os.environ["MORSE_RUN"], "--servers", "1", "--workers", "3", "--node-aggregation",
               "--", sys.executable, __file__, "--worker", out, "OneBitAdam"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240)
    if result.returncode != 0:
        print(result.stdout[-4000:])
    check(result.returncode == 0, "3 ranks in one node failed")
    check_node_averages(out, 1, 3)
    check_shared(out, 3, shm_usable(), "3 ranks in one node")
    check_nodes_share(out, 1, 3, False)
    check_ranks_match_simulator(out, 1, STEPS)
    print("PASS: one node of 3 ranks: one worker, ((g0 + g1) + g2) / 3 pushed, every rank on its bits")


def wrong_use():
    command = [os.environ["MORSE_RUN"], "--servers", "1", "--workers", "2", "--node-aggregation",
               "--", sys.executable, __file__, "--worker", tempfile.mkdtemp(), "Adam:lr"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240)
    print(result.stdout[-3000:])
    check(result.returncode != 0, "ranks of a node with different learning rates should fail")
    for rank in (0, 1):
        check(re.search(rf"\[rank {rank}\].*set different \(lr, weight_decay\)", result.stdout),
              f"rank {rank} names the disagreement")
    command[-1] = "Adam:overlap_one"  # local rank 0 alone overlapping
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=240)
    print(result.stdout[-3000:])
    check(result.returncode != 0, "ranks of a node with different overlap settings should fail")
    for rank in (0, 1):
        check(re.search(rf"\[rank {rank}\].*ValueError: overlap=.* local ranks \[1\] of node 0 "
                        r"set overlap=False .* every rank of a node must pass the same overlap",
                        result.stdout), f"rank {rank} names the overlap disagreement")
    for variant, when in (("clamp_one", "after step 2"), ("load_one", "before the first step")):
        command[-1] = f"OneBitAdam:{variant}"
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=240)
        print(result.stdout[-3000:])
        check(result.returncode != 0, f"{variant}: a node whose rank 1 alone changed its weights "
              "should fail")
        for rank in (0, 1):
            check(re.search(rf"\[rank {rank}\].*local ranks \[1\] of node 0 hold other parameters "
                            rf"than its leader {when} .*same way on every rank", result.stdout),
                  f"{variant}: rank {rank} names the rank that changed its weights alone")
    # In the compression phase, an edit after clip_grad_norm_ made by local
    # rank 1 alone: the step is the leader's, then every rank fails naming it.
    command[-2:] = [tempfile.mkdtemp(), "OneBitAdam:edit_one"]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=240)
    print(result.stdout[-3000:])
    check(result.returncode != 0, "edit_one: a node whose rank 1 alone edited after the clip should fail")
    for rank in (0, 1):
        check(re.search(rf"\[rank {rank}\].*local ranks \[1\] of node 0 changed \.grad after "
                        rf"clip_grad_norm_ in step {FREEZE} otherwise than its leader", result.stdout),
              f"edit_one: rank {rank} names the rank that edited alone")
    results = nodes(__file__, 2, 1, "-", "Adam", extra=[("--node-aggregation",), ()], timeout=120)
    for node, (code, text) in enumerate(results):
        print(text[-1500:])
        check(code != 0 and "--node-aggregation" in text and "every node must give the same" in text,
              f"node {node}: the disagreement on --node-aggregation is named")
    print("PASS: different learning rates or overlap settings in a node, weights changed on one "
          "of its ranks only, an "
          "edit after clip_grad_norm_ on one of its ranks only and a disagreement on "
          "--node-aggregation fail, saying so")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(*sys.argv[-2:])
        sys.exit(0)
    # ctest runs the modes in these parts, each a test of its own
    # (python_node_aggregation_optimizers, ...): a part's name runs its
    # modes; a mode is OPTIMIZER or OPTIMIZER:VARIANT (two_nodes; VARIANT@cuda
    # on CUDA tensors), "cuda", "three" or "wrong".
    parts = {"optimizers": ["OneBitAdam", "Adam", "ZeroOneAdam", "OneBitLamb", "OneBitLamb:gloo",
                            "cuda", "three", "wrong", "interval_resume"],
             "idioms": ["OneBitAdam:clamp", "ZeroOneAdam:clamp", "OneBitAdam:clip", "OneBitAdam:edit", "Adam:load",
                        "Adam:scaled", "OneBitAdam:accum", "OneBitAdam:accum_learned"]}
    for mode in modes_of(parts):
        if mode == "cuda":
            # CUDA tensors (the 4 ranks sharing this host's GPU; staged
            # through the host inside each node): where there is a GPU.
            if has_cuda("CUDA tensors with node aggregation"):
                two_nodes("OneBitAdam", "cuda")
                two_nodes("OneBitAdam", "edit@cuda")
        elif mode == "three":
            one_node_of_three()
        elif mode == "wrong":
            wrong_use()
        elif mode == "interval_resume":
            interval_resume()
        else:
            name, _, variant = mode.partition(":")
            if name not in ("OneBitAdam", "Adam", "ZeroOneAdam", "OneBitLamb"):
                sys.exit(f"unknown part or mode {mode!r}: the parts are {', '.join(parts)}")
            two_nodes(name, variant)
