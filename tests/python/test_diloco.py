"""morse.torch.DiLoCo (docs/design.md 2.11) across 3 ranks and 2 shards: each
rank takes sync_every inner AdamW steps on its own data, then syncs. After
every sync each rank's outer parameters and momentum must be the
single-process simulator's, fed the pseudo-gradients the ranks pushed, and
every rank's model must be the outer parameters; the outer parameters must
follow torch.optim.SGD(nesterov=True) on the ranks' average pseudo-gradient
(within float rounding of the average). Run with fp32 both ways (and an lr
scheduler on the inner optimizer), with int8 and error feedback on both
sides (and a resume mid-interval in a fresh job, then the same states
resumed by one rank more, which has none: it starts at the shards' last
sync), and the same with a
synchronous warmup (warmup_steps: each sync at the inner step the schedule
written out here says, resumed mid-interval too); the inner steps clip
with torch's clip_grad_norm_. Where torch sees a GPU, the int8 run again
with ranks 0 and 1's models on it (rank 2's on the CPU): the outer state
stays on the host, the models stay CUDA tensors, and every rank and the
simulator hold the same bits (without a GPU that run is skipped, saying
so). Bad arguments, a Morse optimizer as the inner
one among them, are refused before the job is joined. Under morse-run
--node-aggregation (2 nodes x 2 ranks) each node is one DiLoCo worker whose
ranks take their inner steps together on the node's average gradient,
bit-identical to the simulator with N = 2 (a sync every SYNC_EVERY steps,
and streaming with an overlap); =sharded is refused. Arguments name codecs
to run alone (`test_diloco.py int8@cuda`: that run only); none, everything.
Under a GradScaler on nodes (`int8amp`) a step is skipped by every rank of
the node where one of them overflowed, as DDP inside the node would, the
loss scales move alike, and a skipped step at a sync still merges."""
import copy
import glob
import json
import math
import os
import shutil
import signal
import sys
import tempfile

import torch

from harness import check, check_ranks_match_simulator, cpu_grad_scaler, has_cuda, morse_run  # noqa: E402

RANKS = 3
SYNC_EVERY = 3
SYNCS = 4
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
SAVE_AT = 7  # inner steps: two syncs and one step of the third interval
# int8+warmup: the first WARMUP outer steps after one inner step each, then
# every SYNC_EVERY: syncs after inner steps 1, 2, 5, 8 and 11 of the 12 (the
# schedule written out), SAVE_AT two steps into the fourth interval.
WARMUP = 2
WARMUP_SYNCS_AT = [1, 2, 5, 8, 11]
NODE_CLIP = 0.3  # clip_grad_norm_'s max_norm in the int8clip node run


# int8+amp: (rank, inner step) whose loss is infinite under the GradScaler:
# two steps inside an interval and one whose step ends with a sync.
AMP_OVERFLOWS = {(1, 1), (1, 5), (2, 4)}
# int8amp (2 nodes x 2 ranks): node 0 overflows in steps 1 and 5 (a merge
# step) on its rank 1, node 1 in step 4 on its leader and 8 (a merge step)
# on its rank 3.
NODE_AMP_OVERFLOWS = {(1, 1), (1, 5), (2, 4), (3, 8)}


def loss_of(model, step, rank, device="cpu"):
    """Rank's loss of inner step `step` (its batch a function of both)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
    return torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))


def backward(model, step, rank, device="cpu"):
    loss_of(model, step, rank, device).backward()


def amp_step(model, opt, scaler, step, rank):
    """One step of the fp16 recipe (scale, backward, unscale_, torch's clip
    at 0.5, scaler.step, update), the loss infinite where AMP_OVERFLOWS
    says."""
    loss = loss_of(model, step, rank)
    scaler.scale(loss * math.inf if (rank, step) in AMP_OVERFLOWS else loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()


def expected_scales(skipped, steps, init_scale=1024.0, growth_interval=3):
    """GradScaler's loss scale after each of `steps` steps, those in
    `skipped` overflowing: halved at each, doubled after growth_interval
    steps in a row without one."""
    scale, tracker, scales = init_scale, 0, []
    for step in range(steps):
        if step in skipped:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = scale * 2.0, 0
        scales.append(scale)
    return scales


def node_worker(out, mode):
    """Under morse-run --node-aggregation (2 nodes x 2 ranks): mode "int8"
    (a sync every SYNC_EVERY inner steps) or "stream" (int4, FRAGMENTS
    fragments, overlap_steps 1, flush() at the end); "int8clip" clips;
    "int8amp" under a GradScaler (the loss infinite where NODE_AMP_OVERFLOWS
    says; unscale_ and a clip that keeps every bit in even steps, neither in
    odd ones). Each rank saves its own (unscaled) gradient and the one its
    inner step took (the node's average) at every step, and its parameters
    (under amp, its skipped steps and loss scales); each node's leader its
    pseudo-gradients and checksums. Under =sharded, the refusal."""
    import numpy as np
    import morse.torch
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    node = int(os.environ["MORSE_NODE_RANK"])
    torch.manual_seed(3 + rank)  # the leader's initial values must become everyone's
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    if os.environ["MORSE_NODE_AGGREGATION"] == "sharded":
        try:
            morse.torch.DiLoCo(model, inner)
            check(False, "DiLoCo was built under --node-aggregation=sharded")
        except morse.torch.MorseError as e:
            check("--node-aggregation=sharded" in str(e), f"unclear error: {e}")
            print(f"REFUSED {e}")
        return
    stream = mode == "stream"
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    args = (dict(sync_every=STREAM_SYNC_EVERY, fragments=FRAGMENTS, overlap_steps=1, codec="int4")
            if stream else dict(sync_every=SYNC_EVERY, codec="int8"))
    opt = morse.torch.DiLoCo(model, inner, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                             block_elems=16, partition_elems=64, **args)
    if rank == 0 and life == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy", opt.outer_parameters().numpy())
    steps = (STREAM_SYNC_EVERY // FRAGMENTS) * STREAM_SYNCS if stream else SYNC_EVERY * SYNCS
    checksums, params, norms = [], {}, []
    if mode == "int8amp":
        scaler, skipped, scales = cpu_grad_scaler(init_scale=1024.0, growth_interval=3), [], []
    for step in range(opt.inner_steps, steps + 1):
        if mode == "int8kill" and rank == 1 and life == 0 and step == 7:
            os.kill(os.getpid(), signal.SIGKILL)  # the node restarts (--rank-restarts)
        done = opt.step_index
        if step == steps:
            opt.flush()  # the last sync, in flight with the overlap (on every rank)
        else:
            opt.zero_grad()
            if mode == "int8amp":
                loss = loss_of(model, step, rank)
                scaler.scale(loss * math.inf if (rank, step) in NODE_AMP_OVERFLOWS else loss).backward()
                if step % 2 == 0:
                    scaler.unscale_(opt)  # this rank's own gradient
                own = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                if step % 2 == 0:
                    # The node's average first (_clip_grad_norm), clipped by
                    # 1.0 (no bit changes), then the node's verdict at step().
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30)
                else:
                    own = own * torch.tensor(1.0 / scaler.get_scale())  # a power of two
                np.save(f"{out}/own-{rank}-{step}.npy", own.numpy())
                taken = adamw_steps(inner)
                scaler.step(opt)
                scaler.update()
                if adamw_steps(inner) == taken:
                    skipped.append(step)
                scales.append(scaler.get_scale())
            else:
                backward(model, step, rank)
                np.save(f"{out}/own-{rank}-{step}.npy",
                        torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy())
                if mode == "int8clip":  # of the node's average, as DDP inside the node
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                      NODE_CLIP)))
                opt.step()
            np.save(f"{out}/took-{rank}-{step}.npy",
                    torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy())
        params[step] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes().hex()
        json.dump(params, open(f"{out}/params-{rank}-{life}.json", "w"))
        if opt.step_index == done:
            continue
        if local == 0:
            np.save(f"{out}/grad-{node}-{done}.npy", opt._grad.numpy())
        checksums.append(opt.checksum())
        # Every sync averaged both nodes: every rank of them, on every rank.
        world = list(range(int(os.environ["WORLD_SIZE"])))
        assert opt.membership() == world, f"membership {opt.membership()}, expected {world}"
    json.dump(checksums, open(f"{out}/checksums-{rank}.json", "w"))
    json.dump(norms, open(f"{out}/norms-{rank}.json", "w"))
    if mode == "int8amp":
        json.dump({"skipped": skipped, "scales": scales}, open(f"{out}/amp-{rank}.json", "w"))
    print(f"rank {rank}: {steps} inner steps, {opt.step_index} outer")


def node_aggregation(modes=("int8", "stream", "int8clip", "int8amp"), restarts=True):
    """DiLoCo under morse-run --node-aggregation, 2 nodes x 2 ranks: each
    node's ranks take every inner step with the node's average gradient
    ((g0 + g1) / 2, bit for bit) and end every step on the same
    parameters; the nodes' leaders hold what the simulator with N = 2 fed
    their pseudo-gradients holds, and the other ranks report their
    leader's checksums. Under =sharded DiLoCo refuses, saying so."""
    from harness import nodes
    from test_node_aggregation import node_average
    import numpy as np
    for mode in modes:
        out = tempfile.mkdtemp(prefix=f"morse-diloco-nodes-{mode}-")
        results = nodes(__file__, 2, 2, out, mode, extra=("--servers", "2", "--node-aggregation"))
        for node, (code, text) in enumerate(results):
            if code != 0:
                print(text[-4000:])
            check(code == 0, f"{mode}: node {node} exited with {code}")
        steps = (STREAM_SYNC_EVERY // FRAGMENTS) * STREAM_SYNCS if mode == "stream" else SYNC_EVERY * SYNCS
        for node in range(2):
            ranks = (2 * node, 2 * node + 1)
            norms = [json.load(open(f"{out}/norms-{r}.json")) for r in ranks]
            check(norms[0] == norms[1], f"{mode}: node {node}'s ranks' clip_grad_norm_ differ")
            skipped = set()
            if mode == "int8amp":
                # As DDP inside the node: a step is skipped on every rank of
                # the node where one of them overflowed, and no other, and
                # the ranks' loss scales move alike.
                want = sorted(s for r, s in NODE_AMP_OVERFLOWS if r in ranks)
                amp = [json.load(open(f"{out}/amp-{r}.json")) for r in ranks]
                for r, got in zip(ranks, amp):
                    check(got["skipped"] == want, f"rank {r} skipped {got['skipped']}, not {want}")
                    check(got["scales"] == expected_scales(want, steps),
                          f"rank {r}'s loss scales {got['scales']}, not the node's "
                          f"{expected_scales(want, steps)}")
                skipped = set(want)
            for step in range(steps):
                if step in skipped:
                    continue
                average = node_average([np.load(f"{out}/own-{r}-{step}.npy") for r in ranks])
                if mode == "int8clip":
                    # torch's clip of the node's average (in its own order of
                    # operations, so to float rounding here).
                    norm = float(np.linalg.norm(average.astype(np.float64)))
                    check(abs(norms[0][step] - norm) <= 1e-5 * norm,
                          f"step {step}: clip_grad_norm_ {norms[0][step]}, the node average's {norm}")
                    average = average * np.float32(min(1.0, NODE_CLIP / (norm + 1e-6)))
                for r in ranks:
                    took = np.load(f"{out}/took-{r}-{step}.npy")
                    check(took.tobytes() == average.tobytes() if mode != "int8clip" else
                          np.allclose(took, average, rtol=1e-5, atol=0),
                          f"{mode}: rank {r}'s inner step {step} did not take its node's average")
            if mode == "int8clip":
                check(sum(n > NODE_CLIP for n in norms[0]) >= steps // 2,
                      f"the clip acted in {sum(n > NODE_CLIP for n in norms[0])} steps only")
            params = [json.load(open(f"{out}/params-{r}-0.json")) for r in ranks]
            check(params[0] == params[1], f"{mode}: node {node}'s ranks hold different parameters")
            check(json.load(open(f"{out}/checksums-{ranks[1]}.json")) ==
                  json.load(open(f"{out}/checksums-{ranks[0]}.json")),
                  f"{mode}: rank {ranks[1]} does not report its leader's checksums")
            os.rename(f"{out}/checksums-{ranks[0]}.json", f"{out}/checksums-leader-{node}.json")
        for f in os.listdir(out):
            if f.startswith(("own-", "took-", "params-", "checksums-", "norms-", "amp-")) \
                    and "leader" not in f:
                os.remove(f"{out}/{f}")
        for node in range(2):
            os.rename(f"{out}/checksums-leader-{node}.json", f"{out}/checksums-{node}.json")
        syncs = STREAM_SYNCS if mode == "stream" else SYNCS
        check_ranks_match_simulator(out, 2, syncs)
        print(f"PASS: DiLoCo ({mode}) under --node-aggregation, 2 nodes x 2 ranks: every inner step "
              f"on the node's average gradient, each node's ranks on one model, the leaders "
              f"bit-identical to the simulator with N = 2 for {syncs} syncs")
    if not restarts:
        return
    # A non-leader killed in inner step 7 (a sync every 3, checkpoints every
    # sync): morse-run restarts the node, the leader rejoins from its
    # checkpoint of sync 2 (inner step 6) with its inner state, the other
    # rank takes both from it, and every rank's parameters after every
    # step, in either life, are those of a run without the kill.
    runs = {}
    for mode in ("int8", "int8kill"):
        out = tempfile.mkdtemp(prefix=f"morse-diloco-nodes-{mode}-")
        config = os.path.join(out, "job.textproto")
        with open(config, "w") as f:
            f.write("checkpoint { every_steps: 1 }\n")
        results = nodes(__file__, 2, 2, out, mode, extra=("--servers", "2", "--node-aggregation",
                                                          "--config", config, "--rank-restarts", "1"))
        for node, (code, text) in enumerate(results):
            if code != 0:
                print(text[-4000:])
            check(code == 0, f"{mode}: node {node} exited with {code}")
        runs[mode] = out
    check("restarting this node's 2 ranks" in results[0][1], "node 0 was not restarted")
    for r in range(4):
        whole = json.load(open(f"{runs['int8']}/params-{r}-0.json"))
        lives = [json.load(open(f)) for f in sorted(glob.glob(f"{runs['int8kill']}/params-{r}-*.json"))]
        check(len(lives) == (2 if r < 2 else 1), f"rank {r}: {len(lives)} lives")
        check(lives[-1] and min(map(int, lives[-1])) == (6 if r < 2 else 0),
              f"rank {r}'s last life began at inner step {min(map(int, lives[-1]))}")
        for life in lives:
            for step, bits in life.items():
                check(bits == whole[step], f"rank {r} inner step {step}: not the undisturbed run's")
    print("PASS: DiLoCo under --node-aggregation: a rank killed at inner step 7 restarts its node, "
          "which rejoins at sync 2 (inner step 6) and ends every step on the undisturbed run's bits")
    results = nodes(__file__, 1 + 1, 1, "-", "int8", extra=("--servers", "1",
                                                             "--node-aggregation=sharded"))
    for node, (code, text) in enumerate(results):
        check(code == 0 and "REFUSED" in text, f"=sharded: node {node}: {text[-2000:]}")
    print("PASS: DiLoCo under --node-aggregation=sharded is refused, saying to use the leader")


def worker(out, codec, phase):
    """phase: "full" trains every step; "save" stops in the middle of an
    interval (SAVE_AT) and saves each rank's state; "resume" continues from
    it in a fresh job. codec CODEC@cuda puts ranks 0 and 1's models on the
    GPU; CODEC+warmup syncs after each of the first WARMUP inner steps."""
    import numpy as np
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    codec, _, variant = codec.partition("+")
    warmup = dict(warmup_steps=WARMUP) if variant == "warmup" else {}
    amp = variant == "amp"
    syncs_at = WARMUP_SYNCS_AT if warmup else [SYNC_EVERY * (k + 1) for k in range(SYNCS)]
    codec, _, where = codec.partition("@")
    device = torch.device("cuda" if where == "cuda" and rank < 2 else "cpu")
    torch.manual_seed(3 + rank)  # rank 0's initial values must become everyone's
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(),
                                torch.nn.Linear(20, 4)).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    if phase == "full":
        other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        for bad, kind in ((dict(sync_every=0), ValueError), (dict(outer_momentum=1.0), ValueError),
                          (dict(outer_lr=-1.0), ValueError), (dict(inner_optimizer=other), ValueError),
                          (dict(inner_optimizer="adamw"), TypeError),
                          (dict(warmup_steps=-1), ValueError),
                          (dict(warmup_steps=2, warmup_sync_every=0), ValueError),
                          # The warmup's syncs are one inner step apart.
                          (dict(warmup_steps=2, overlap_steps=1), ValueError),
                          # A Morse optimizer (not built: it would join the job).
                          (dict(inner_optimizer=object.__new__(morse.torch.Adam)), ValueError)):
            args = dict(inner_optimizer=inner, world_size=RANKS, servers=["unused:1"])
            args.update(bad)
            try:
                morse.torch.DiLoCo(model, **args)
                check(False, f"{bad} was accepted")
            except kind as e:
                print(f"refused {sorted(bad)}: {e}")
    opt = morse.torch.DiLoCo(model, inner, sync_every=SYNC_EVERY, outer_lr=OUTER_LR,
                             outer_momentum=OUTER_MOMENTUM, codec=codec, block_elems=16,
                             partition_elems=64, **warmup)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    check(torch.equal(flat, opt.outer_parameters()), "the model does not start from x_outer")
    first = 0
    if phase == "grow" and rank == RANKS:
        # A rank the saved job did not have (RANKS + 1 now): it loads
        # nothing and starts at the shards' last sync, with their outer
        # parameters (the others resume from their own states).
        first = opt.inner_steps
        check(first == SYNC_EVERY * (SAVE_AT // SYNC_EVERY) and opt.step_index == SAVE_AT // SYNC_EVERY,
              f"rank {rank} without a state starts at inner step {first}, outer step "
              f"{opt.step_index}")
    elif phase in ("resume", "grow"):
        state = torch.load(f"{out}/state-{rank}.pt")
        if rank == 1:  # another rank's state is refused, and nothing changes
            try:
                opt.load_state_dict(torch.load(f"{out}/state-0.pt"))
                check(False, "rank 0's state was accepted on rank 1")
            except ValueError as e:
                print(f"refused rank 0's state on rank 1: {e}")
        try:  # the inner optimizer's (torch.optim's) state given to DiLoCo
            opt.load_state_dict(state["inner"])
            check(False, "the inner optimizer's state was accepted by DiLoCo")
        except ValueError as e:
            check("inner.load_state_dict" in str(e), str(e))
        opt.load_state_dict(state)
        first = opt.inner_steps
        check(first == SAVE_AT, f"resumed at inner step {first}")
    elif rank == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy", flat.numpy())
    # The inner steps are the script's own: torch's clipping of this rank's
    # gradient, and (without the resume, which would need its state) an lr
    # schedule on the inner optimizer.
    scheduler = torch.optim.lr_scheduler.StepLR(inner, 4, 0.5) if codec == "fp32" else None
    if amp:
        # fp16 loss scaling: the same recipe on a copy of the model under
        # torch's AdamW and a GradScaler of its own, set to the outer
        # parameters at each sync, is what each rank's inner steps must
        # be, bit for bit (its own skips, its own loss scale).
        scaler = cpu_grad_scaler(init_scale=1024.0, growth_interval=3)
        shadow = copy.deepcopy(model)
        shadow_inner = torch.optim.AdamW(shadow.parameters(), lr=0.01, weight_decay=0.01)
        shadow_scaler = cpu_grad_scaler(init_scale=1024.0, growth_interval=3)
        skipped = []
    checksums = []
    for step in range(first, SYNC_EVERY * SYNCS):
        if phase == "save" and step == SAVE_AT:
            torch.save(opt.state_dict(), f"{out}/state-{rank}.pt")
            return
        opt.zero_grad()
        if amp:
            before = opt.inner_steps
            amp_step(model, opt, scaler, step, rank)
            check(opt.inner_steps == before + 1, f"step {step}: {opt.inner_steps - before} inner steps")
            shadow_inner.zero_grad()
            taken = adamw_steps(shadow_inner)
            amp_step(shadow, shadow_inner, shadow_scaler, step, rank)
            if adamw_steps(shadow_inner) == taken:
                skipped.append(step)
            if step + 1 in syncs_at:
                torch.nn.utils.vector_to_parameters(opt.outer_parameters(), shadow.parameters())
            check(all(torch.equal(a, b) for a, b in zip(model.parameters(), shadow.parameters())),
                  f"rank {rank} step {step}: the inner step is not torch's AdamW under its GradScaler")
            check(scaler.get_scale() == shadow_scaler.get_scale(), f"step {step}: another loss scale")
        else:
            backward(model, step, rank, device)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        if scheduler is not None:
            scheduler.step()
        synced = len([s for s in syncs_at if s <= step + 1])
        check(opt.step_index == synced, f"after {step + 1} inner steps: outer step "
              f"{opt.step_index}, the schedule {syncs_at} has {synced}")
        if step + 1 not in syncs_at:
            continue
        outer = synced - 1
        np.save(f"{out}/grad-{rank}-{outer}.npy", opt._grad.numpy())
        np.save(f"{out}/outer-{rank}-{outer}.npy", opt.outer_parameters().numpy())
        check(all(p.device.type == device.type for p in model.parameters()),
              f"sync {outer}: the parameters left {device}")
        local = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        check(torch.equal(local, opt.outer_parameters()),
              f"sync {outer}: the model is not the outer parameters")
        checksums.append(opt.checksum())
    suffix = {"resume": "-resumed", "grow": "-grown"}.get(phase, "")
    json.dump(checksums, open(f"{out}/checksums-{rank}{suffix}.json", "w"))
    if amp:
        want = [step for r, step in sorted(AMP_OVERFLOWS) if r == rank]
        check(skipped == want, f"rank {rank}: skipped inner steps {skipped}, expected {want}")
        print(f"rank {rank}: skipped inner steps {skipped}, loss scale {scaler.get_scale()}")


def adamw_steps(opt):
    """How many steps torch's AdamW `opt` has taken (0 before its first)."""
    state = opt.state_dict()["state"]
    return float(state[0]["step"]) if 0 in state else 0.0


STREAM_SYNC_EVERY = 4  # each fragment syncs every 4 inner steps
FRAGMENTS = 2  # of the 6 partitions: a sync every 2 inner steps
STREAM_SYNCS = 6  # three rounds of both fragments
STREAM_SAVE_AT = 7  # inner steps: three syncs applied, a fourth fragment's run half done


def streaming_worker(out, overlap, phase):
    """Streaming DiLoCo: fragments=2, overlap_steps 0 or 1 (mixing 0.5).
    After each sync the synced fragment's parameters are the outer ones
    (or the mix of local and outer), the other fragment's kept their local
    progress; phases as worker()'s."""
    import numpy as np
    import morse.torch
    overlap = int(overlap)
    rank = int(os.environ["MORSE_RANK"])
    torch.manual_seed(3 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    args = dict(sync_every=STREAM_SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                codec="int4", block_elems=16, partition_elems=64)
    if phase == "full" and rank == 0 and not overlap:
        for bad, words in ((dict(fragments=3), "dividing sync_every=4"),
                           (dict(fragments=2, overlap_steps=2), "overlap_steps=2: in [0, 2)"),
                           (dict(fragments=2, mixing=1.0), "mixing=1.0"),
                           # 4 divides sync_every but not the 6 partitions.
                           (dict(sync_every=8, fragments=4), "must divide the layout's partitions (6)")):
            try:
                morse.torch.DiLoCo(model, inner, world_size=RANKS, servers=["unused:1"],
                                   **{**args, **bad})
                check(False, f"{bad} was accepted")
            except (ValueError, morse.torch.MorseError) as e:
                check(words in str(e), f"{bad}: {e}")
                print(f"refused {bad}: {e}")
    opt = morse.torch.DiLoCo(model, inner, fragments=FRAGMENTS, overlap_steps=overlap, **args)
    partitions = opt._partitions
    check(len(partitions) == 6, f"{len(partitions)} partitions")
    if phase == "full" and rank == 0 and not overlap:
        # The merge (compress::MergeOuter through the C ABI) refuses a wrong
        # size and a step not completed, leaving the parameters as they are.
        local = opt._local().numpy()
        for bad, step, words in ((np.zeros(5, np.float32), 0, "local holds 5 values"),
                                 (local, -1, "step -1: an outer step"),
                                 (local, 0, "outer step 0 has not completed")):
            kept = bad.copy()
            try:
                opt._session.merge_outer(step, bad)
                check(False, f"merge_outer({step}, {bad.size} values) was accepted")
            except morse.torch.MorseError as e:
                check(words in str(e), f"merge_outer: {e}")
                check(np.array_equal(bad, kept), "a refused merge changed the parameters")
                print(f"refused merge_outer({step}, {bad.size} values): {e}")
    first = 0
    if phase == "resume":
        opt.load_state_dict(torch.load(f"{out}/state-{rank}.pt"))
        first = opt.inner_steps
        check(first == STREAM_SAVE_AT, f"resumed at inner step {first}")
    elif rank == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy", opt.outer_parameters().numpy())
    # The parameters the merge mixes with the outer ones (after the inner
    # step that applies the sync).
    seen = {}
    merge = opt._merge

    def spy(step):
        seen["local"] = opt._local()
        merge(step)
    opt._merge = spy
    checksums = []
    period = STREAM_SYNC_EVERY // FRAGMENTS
    # With the overlap, the last sync is still in flight after the last
    # step(): flush() applies it (a step later than step() would have).
    for step in range(first, period * STREAM_SYNCS + 1):
        done = opt.step_index
        if step == period * STREAM_SYNCS:
            if not overlap:
                break
            opt.flush()
            check(opt.step_index == done + 1, "flush() did not apply the last sync")
            opt.flush()  # nothing in flight: nothing happens
            check(opt.step_index == done + 1, "a second flush() took a step")
        else:
            if phase == "save" and step == STREAM_SAVE_AT:
                torch.save(opt.state_dict(), f"{out}/state-{rank}.pt")
                return
            opt.zero_grad()
            backward(model, step, rank)
            opt.step()
        if opt.step_index == done:
            continue
        outer = done
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        x_outer = opt.outer_parameters()
        local = seen["local"]
        for q, (b, e) in enumerate(partitions):
            if q % FRAGMENTS != outer % FRAGMENTS:
                check(torch.equal(after[b:e], local[b:e]),
                      f"sync {outer}: partition {q}, not synced, lost its local progress")
                continue
            want = x_outer[b:e] if not overlap else 0.5 * local[b:e] + 0.5 * x_outer[b:e]
            check(torch.equal(after[b:e], want),
                  f"sync {outer}: partition {q} is not the {'mix' if overlap else 'outer'}")
        np.save(f"{out}/grad-{rank}-{outer}.npy", opt._grad.numpy())
        checksums.append(opt.checksum())
    suffix = {"resume": "-resumed", "grow": "-grown"}.get(phase, "")
    json.dump(checksums, open(f"{out}/checksums-{rank}{suffix}.json", "w"))


def check_outer_steps(out):
    """The outer parameters follow torch's SGD with Nesterov momentum on the
    average of the ranks' pseudo-gradients (fp32: up to the rounding of the
    shards' average)."""
    import numpy as np
    x = torch.nn.Parameter(torch.from_numpy(np.load(f"{out}/x0.npy")))
    sgd = torch.optim.SGD([x], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    worst = 0.0
    for outer in range(SYNCS):
        deltas = [torch.from_numpy(np.load(f"{out}/grad-{r}-{outer}.npy")) for r in range(RANKS)]
        x.grad = torch.stack(deltas).double().mean(0).float()
        sgd.step()
        got = torch.from_numpy(np.load(f"{out}/outer-0-{outer}.npy"))
        worst = max(worst, (got - x.detach()).abs().max().item())
    check(worst < 1e-5, f"the outer parameters are {worst} from torch's Nesterov SGD")
    print(f"outer parameters within {worst:.2e} of torch.optim.SGD(nesterov=True)")


def check_resumed(out, arg, done, what):
    """Saves in the middle of a run and resumes in a fresh job (fresh
    shards): each rank's checksums from sync `done` on must be those of the
    run in `out` that never stopped."""
    whole = [json.load(open(f"{out}/checksums-{r}.json")) for r in range(RANKS)]
    saved = tempfile.mkdtemp(prefix="morse-diloco-resume-")
    for phase in ("save", "resume"):
        code, log = morse_run(__file__, RANKS, 2, saved, arg, phase)
        print(log)
        check(code == 0, f"the {phase} job failed ({what})")
    for r in range(RANKS):
        resumed = json.load(open(f"{saved}/checksums-{r}-resumed.json"))
        check(resumed == whole[r][done:],
              f"rank {r} resumed: {resumed}, uninterrupted: {whole[r][done:]}")
    if arg == "int8":
        # The same states resumed by one rank more, which has none: it
        # starts at the shards' last sync and every rank syncs alike (it
        # waited for syncs no other rank would push, until the job's
        # timeout, before).
        code, log = morse_run(__file__, RANKS + 1, 2, saved, arg, "grow")
        print(log)
        check(code == 0, f"the job of {RANKS + 1} ranks from {RANKS} ranks' states failed")
        check(f"rank {RANKS} has no saved state and starts at sync {done}" in log,
              f"rank {RANKS} says where it starts")
        grown = [json.load(open(f"{saved}/checksums-{r}-grown.json")) for r in range(RANKS + 1)]
        check(all(g == grown[0] and len(g) == len(whole[0]) - done for g in grown),
              f"the ranks of the grown job synced apart: {grown}")
        print(f"PASS: {RANKS} ranks' states resumed by {RANKS + 1}, the new rank from the shards' "
              "last sync, every rank's outer state alike after each sync")
    shutil.rmtree(saved)


if __name__ == "__main__":
    if "--worker" in sys.argv and os.environ.get("MORSE_NODE_AGGREGATION"):
        node_worker(*sys.argv[-2:])
        sys.exit(0)
    if "--worker" in sys.argv:
        if sys.argv[-2] in ("0", "1"):  # streaming: out, overlap, phase
            streaming_worker(*sys.argv[-3:])
        else:
            worker(*sys.argv[-3:])
        sys.exit(0)
    # Arguments: the codecs to run alone (say int8@cuda); none: everything.
    chosen = sys.argv[1:]
    if not chosen:
        node_aggregation()
    codecs = chosen or ["fp32", "int8", "int8+warmup", "int8+amp", "int8@cuda"]
    if any(c.endswith("@cuda") for c in codecs) and not has_cuda("DiLoCo with models on the GPU"):
        codecs = [c for c in codecs if not c.endswith("@cuda")]
    for codec in codecs:
        out = tempfile.mkdtemp(prefix="morse-diloco-")
        code, log = morse_run(__file__, RANKS, 2, out, codec, "full")
        print(log)
        check(code == 0, f"the job failed ({codec})")
        if codec == "fp32":
            check_outer_steps(out)
        elif codec in ("int8", "int8+warmup"):
            # Saved in the middle of an interval.
            schedule = (WARMUP_SYNCS_AT if "warmup" in codec
                        else [SYNC_EVERY * (k + 1) for k in range(SYNCS)])
            check_resumed(out, codec, len([s for s in schedule if s <= SAVE_AT]), codec)
            print(f"PASS: resumed at inner step {SAVE_AT} in a fresh job, the same bits ({codec})")
        if codec == "int8+amp":
            lines = [line for line in log.splitlines() if "skipped inner steps" in line]
            check(len(lines) == RANKS, "every rank reports its skipped inner steps")
            print(f"PASS: under torch.amp.GradScaler each rank skipped its own overflowing inner "
                  f"steps ({sorted(AMP_OVERFLOWS)}), bit for bit torch's AdamW under its own "
                  "GradScaler, and every rank synced at the same steps")
        syncs = len(WARMUP_SYNCS_AT) if "warmup" in codec else SYNCS
        for r in range(RANKS):
            for outer in range(syncs):
                os.remove(f"{out}/outer-{r}-{outer}.npy")
        check_ranks_match_simulator(out, RANKS, syncs)
        warmed = f"{WARMUP} of one inner step, then " if "warmup" in codec else ""
        print(f"PASS: {syncs} syncs ({warmed}{SYNC_EVERY} inner steps each), {RANKS} ranks "
              f"bit-identical to each other and to the simulator ({codec})")
    for overlap in ("0", "1") if not chosen else ():
        # Streaming: 6 syncs of alternating fragments, int4 with feedback;
        # saved with the second fragment half-way and resumed in a fresh job.
        out = tempfile.mkdtemp(prefix="morse-streaming-")
        code, log = morse_run(__file__, RANKS, 2, out, overlap, "full")
        print(log)
        check(code == 0, f"the streaming job failed (overlap_steps {overlap})")
        check_resumed(out, overlap, STREAM_SAVE_AT // (STREAM_SYNC_EVERY // FRAGMENTS),
                      f"streaming, overlap_steps {overlap}")
        check_ranks_match_simulator(out, RANKS, STREAM_SYNCS)
        print(f"PASS: streaming DiLoCo, {FRAGMENTS} fragments, overlap_steps {overlap}: "
              f"{STREAM_SYNCS} syncs bit-identical across {RANKS} ranks and to the simulator, "
              f"resumed mid-fragment with the same bits")
