"""An elastic morse.torch job (min_workers below workers; issue 40,
docs/python.md "Elastic jobs"): morse-run --min-workers 2 runs 3 ranks and
2 shards of OneBitAdam with timeouts.step_seconds 1.
- Rank 2 kills itself (SIGKILL) before backward() of step 6 and is not
  restarted: morse-run goes on without it, the shards complete step 6 and
  every later one without rank 2 after waiting a second, and ranks 0 and 1
  finish. Their opt.membership() says [0, 1, 2] through step 5 and [0, 1]
  from step 6, and after every step both hold the bits the simulator gives
  when fed their gradients with rank 2 left out of those steps.
- With --rank-restarts 1 and checkpoints every 4 steps, rank 2 is restarted,
  rejoins from its checkpoint of step 4, catches up on the replies the
  shards kept and joins the membership again (the others wait before step
  13 until it has caught up, however slow its start): all three ranks end
  with the same bits, rank 2 back in the last steps' membership.
- Under --node-aggregation (leader, and sharded) with --min-workers 1,
  2 nodes x 2 ranks: rank 3 (node 1's second) kills itself before
  backward() of step 6; node 1's morse-run stops its other rank and ends
  saying the node left, and node 0's two ranks finish: opt.membership()
  is every rank through step 5 and node 0's ranks [0, 1] from step 6, the
  two ranks hold the same parameters after every step, and (leader) the
  leader's bits are the simulator's with N = 2 fed the nodes' averages,
  node 1 left out from step 6.
  With --rank-restarts 1 too (checkpoints every 4 steps), node 1 restarts
  from step 4 while node 0 goes on, catches up and is back in the
  membership: all four ranks on the same bits after every step.
- `clamp`: weights changed after a step in an elastic job (every rank
  clamps them after step CLAMPED - 1): with rank 2 gone for good, ranks
  0 and 1 bit-identical to the simulator given the membership and the
  change; with rank 2 restarted (replaying the clamp, its late pushes
  showing the changed weights), all three identical; and with rank 2
  restarted clamping otherwise, its late push refused, saying so, and the
  job going on without it; with rank 0 gone, the others' change stopping
  them, saying that rank 0 gives the weights.
- --min-workers out of range (the nodes' count under --node-aggregation)
  or with --stages is refused."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from harness import check, morse_run, nodes  # noqa: E402

STEPS = 16
KILLED = 6
CLAMP = 0.1  # `clamp` runs: every rank clamps its weights to ±CLAMP after step CLAMPED - 1
CLAMPED = 9


def wait_for(*paths):
    """Waits until one of `paths` exists, for up to 120 s."""
    deadline = time.time() + 120
    while not any(os.path.exists(p) for p in paths) and time.time() < deadline:
        time.sleep(0.05)


def worker(out, pace, killed=2, change=""):
    """A rank of the job: rank `killed` kills itself in its first life
    (rank 2 of 3 ranks; rank 3, node 1's second, of 2 nodes x 2). With
    `pace` > 0 (its restart is tested) the others go at that pace and wait
    before step STEPS - 3 until it has caught up. `change` "clamp": every
    rank clamps its weights to ±CLAMP after step CLAMPED - 1 (a rank back
    from its restart in its replay); "clamp_other": the same, but the
    restarted rank clamps to ±CLAMP / 2, coming back only once the others
    have completed step CLAMPED (so that it is left out of it), and the
    others wait only until it is about to be refused."""
    import numpy as np
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    rank = int(os.environ["RANK"])
    life = int(os.environ.get("MORSE_RESTART_COUNT", "0"))
    if life > 0:
        # Back later than timeouts.step_seconds (at most 2 here), however
        # fast the restart: the steps go on without it meanwhile.
        time.sleep(3)
        if change == "clamp_other":
            # Left out of step CLAMPED whatever the host's speed: back
            # once the others have completed it.
            wait_for(f"{out}/step-0-{CLAMPED}.json")
    opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=3, block_elems=16,
                                 partition_elems=64)
    first = opt.step_index
    print(f"life {life} starts at step {first}", flush=True)
    if rank == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy", torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    # The killed rank (with --node-aggregation its whole node) restarts,
    # slow on a loaded host, and replays; the others wait for it.
    size = int(os.environ["LOCAL_WORLD_SIZE"]) if os.environ.get("MORSE_NODE_AGGREGATION") else 1
    waits = rank // size != killed // size
    for step in range(first, STEPS):
        if pace and waits and step == STEPS - 3:
            # ... or until it is about to be refused ("clamp_other").
            wait_for(f"{out}/step-{killed}-{step - 1}.json", f"{out}/refused-{killed}")
        if rank == killed and life == 0 and step == KILLED:
            print(f"killing myself in step {step}, before backward()", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if change and step == CLAMPED:
            bound = CLAMP / 2 if change == "clamp_other" and life > 0 else CLAMP
            if bound != CLAMP:
                open(f"{out}/refused-{rank}", "w").close()
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-bound, bound)
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        np.save(f"{out}/grad-{rank}-{step}.npy", flat.numpy())
        opt.step()
        x_now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        record = {"checksum": opt.checksum(), "members": opt.membership(),
                  "x": x_now.numpy().tobytes().hex()}
        with open(f"{out}/step-{rank}-{step}.tmp", "w") as f:
            json.dump(record, f)
        os.rename(f"{out}/step-{rank}-{step}.tmp", f"{out}/step-{rank}-{step}.json")
        time.sleep(pace)  # the others' pace, while a restarted rank catches up


def run_node_returns(how):
    out = tempfile.mkdtemp(prefix=f"morse-elastic-{how}-returns-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 4 replay_steps: 16 }\n"
                "timeouts { step_seconds: 2 recovery_seconds: 60 }\n")
    aggregation = "--node-aggregation" + ("=sharded" if how == "sharded" else "")
    results = nodes(__file__, 2, 2, out, "node:0.4",
                    extra=("--servers", "2", aggregation, "--min-workers", "1", "--config", config,
                           "--rank-restarts", "1"))
    for node, (code, text) in enumerate(results):
        print(f"--- node {node} (exit {code}):\n{text[-4000:]}")
        check(code == 0, f"{how}: node {node} exited with {code}")
    check(re.search(r"rank 3 exited with -9[^\n]*; restarting this node's 2 ranks \(1 of "
                    r"--rank-restarts 1\); they rejoin from their checkpoints and the other nodes "
                    r"go on, until it catches up \(min_workers\)", results[1][1]),
          f"{how}: node 1 did not restart")
    check("[rank 2] life 1 starts at step 4" in results[1][1], f"{how}: node 1 did not rejoin at step 4")
    ranks = [records(out, r) for r in range(4)]
    for s in range(STEPS):
        for r in range(4):
            check(ranks[r][s] is not None, f"{how}: rank {r} did not finish step {s}")
            check(ranks[r][s]["x"] == ranks[0][s]["x"], f"{how}: rank {r} differs at step {s}")
    left_out = [s for s in range(STEPS) if ranks[0][s]["members"] != [0, 1, 2, 3]]
    check(left_out and left_out[0] == KILLED, f"{how}: steps without node 1: {left_out}")
    check(ranks[0][STEPS - 1]["members"] == [0, 1, 2, 3],
          f"{how}: node 1 did not join again: {ranks[0][STEPS - 1]['members']}")
    shutil.rmtree(out)
    print(f"PASS: {how}: rank 3 killed in step {KILLED}, node 1 restarted from step 4; steps "
          f"{left_out} went on without it, it caught up and joined again; all four ranks on the "
          f"same bits after every one of {STEPS} steps")


def run_node_leaves(how):
    import numpy as np
    from morse import _native
    out = tempfile.mkdtemp(prefix=f"morse-elastic-{how}-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("timeouts { step_seconds: 2 recovery_seconds: 60 }\n")
    aggregation = "--node-aggregation" + ("=sharded" if how == "sharded" else "")
    results = nodes(__file__, 2, 2, out, "node:0",
                    extra=("--servers", "2", aggregation, "--min-workers", "1", "--config", config))
    for node, (code, text) in enumerate(results):
        print(f"--- node {node} (exit {code}):\n{text[-4000:]}")
        check(code == 0, f"{how}: node {node} exited with {code}")
    check(re.search(r"rank 3 exited with -9[^\n]*; this node's 2 ranks leave the job, which goes on "
                    r"without the node \(min_workers 1 of 2 nodes\)", results[1][1]),
          f"{how}: node 1 did not say it left")
    check("the job finished without rank 2, rank 3" in results[1][1],
          f"{how}: node 1 did not name the ranks it lost")
    ranks = [records(out, r) for r in range(2)]
    for s in range(STEPS):
        want = [0, 1, 2, 3] if s < KILLED else [0, 1]
        for r in range(2):
            check(ranks[r][s] is not None, f"{how}: rank {r} did not finish step {s}")
            check(ranks[r][s]["members"] == want,
                  f"{how}: rank {r} step {s}: membership {ranks[r][s]['members']}, expected {want}")
        check(ranks[1][s]["x"] == ranks[0][s]["x"], f"{how}: ranks 0 and 1 differ after step {s}")
    if how == "leader":
        # The simulator with N = 2 fed each node's average in local-rank
        # order, node 1 left out from step 6.
        job = json.load(open(f"{out}/job.json"))
        x0 = np.load(f"{out}/x0.npy")
        sim = _native.Simulator(job["base"], job["overrides"], x0)
        for s in range(STEPS):
            grads = []
            for n in range(2):
                own = [np.load(f"{out}/grad-{2 * n + k}-{s}.npy")
                       if os.path.exists(f"{out}/grad-{2 * n + k}-{s}.npy")
                       else np.zeros(x0.size, np.float32) for k in range(2)]
                grads.append((own[0] + own[1]) / np.float32(2))
            sim.step(grads, absent=[1] if s >= KILLED else [])
            check(sim.worker_checksum(0) == ranks[0][s]["checksum"],
                  f"step {s}: node 0 {ranks[0][s]['checksum']}, simulator {sim.worker_checksum(0)}")
    shutil.rmtree(out)
    print(f"PASS: {how}: rank 3 killed in step {KILLED}; node 1 left with both its ranks and node "
          f"0 finished {STEPS} steps alone, its ranks on the same bits"
          + (", the simulator's with node 1 left out" if how == "leader" else ""))


def records(out, rank):
    return [json.load(open(f"{out}/step-{rank}-{s}.json")) if os.path.exists(f"{out}/step-{rank}-{s}.json")
            else None for s in range(STEPS)]


def run_leaves(change=""):
    """Rank 2 killed for good (`change` "clamp": every rank left clamps
    its weights after step CLAMPED - 1, which become the job's)."""
    import numpy as np
    from morse import _native
    out = tempfile.mkdtemp(prefix="morse-elastic-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("timeouts { step_seconds: 1 recovery_seconds: 60 }\n")
    code, log = morse_run(__file__, 3, 2, out, f"0:{change}", config=config,
                          extra=["--min-workers", "2"])
    print(log)
    check(code == 0, "the elastic job failed")
    check("[rank 2] killing myself in step 6" in log, "rank 2 was not killed")
    check("rank 2 exited with -9; the job goes on without it (min_workers 2 of 3)" in log,
          "morse-run did not go on without rank 2")
    check("the job finished without rank 2" in log, "morse-run did not say the job lost rank 2")
    check("step 6 completed without rank(s) 2 in 5 partitions" in log, "no shard said it completed a step without rank 2")
    ranks = [records(out, r) for r in range(2)]
    for r in range(2):
        for s in range(STEPS):
            want = [0, 1, 2] if s < KILLED else [0, 1]
            check(ranks[r][s] is not None, f"rank {r} did not finish step {s}")
            check(ranks[r][s]["members"] == want,
                  f"rank {r} step {s}: membership {ranks[r][s]['members']}, expected {want}")
            check(ranks[r][s]["checksum"] == ranks[0][s]["checksum"], f"rank {r} differs at step {s}")
    # The simulator fed the same gradients (rank 2's after it died: any;
    # its message is formed and left out), rank 2 left out from step 6.
    job = json.load(open(f"{out}/job.json"))
    sim = _native.Simulator(job["base"], job["overrides"], np.load(f"{out}/x0.npy"))
    dim = np.load(f"{out}/x0.npy").size
    for s in range(STEPS):
        grads = [np.load(f"{out}/grad-{r}-{s}.npy") if os.path.exists(f"{out}/grad-{r}-{s}.npy")
                 else np.zeros(dim, np.float32) for r in range(3)]
        if change and s == CLAMPED:
            # The weights every rank left changed to, the simulator's too.
            before = np.frombuffer(bytes.fromhex(ranks[0][s - 1]["x"]), np.float32)
            sim.replace_x(np.clip(before, np.float32(-CLAMP), np.float32(CLAMP)))
        sim.step(grads, absent=[2] if s >= KILLED else [])
        for r in range(2):
            check(sim.worker_checksum(r) == ranks[r][s]["checksum"],
                  f"step {s}: rank {r} {ranks[r][s]['checksum']}, simulator {sim.worker_checksum(r)}")
    if change:
        x = np.frombuffer(bytes.fromhex(ranks[0][STEPS - 1]["x"]), np.float32)
        check(sim.x().tobytes() == x.tobytes(), "rank 0's weights are not the simulator's")
    shutil.rmtree(out)
    changed = f", the weights clamped after step {CLAMPED - 1} on both" if change else ""
    print(f"PASS: rank 2 killed in step {KILLED} for good; ranks 0 and 1 finished {STEPS} steps "
          f"without it{changed}, bit-identical to the simulator given that membership")


def run_returns(change=""):
    """Rank 2 killed and restarted (`change`: as worker's; "clamp_other":
    the restarted rank changes its weights otherwise and leaves, its late
    push refused, while ranks 0 and 1 finish)."""
    out = tempfile.mkdtemp(prefix="morse-elastic-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 4 replay_steps: 16 }\n"
                "timeouts { step_seconds: 1 recovery_seconds: 60 }\n")
    code, log = morse_run(__file__, 3, 2, out, f"0.4:{change}", config=config,
                          extra=["--min-workers", "2", "--rank-restarts", "1"])
    print(log)
    if change == "clamp_other":
        check(code == 0, "the elastic job failed")
        want = (f"at step {CLAMPED} (a step completed without it) are not the ones rank 0 "
                "changed them to")
        check(want in log, "rank 2's other change was not refused at its late push")
        check("the job finished without rank 2" in log, "morse-run did not say rank 2 left")
        ranks = [records(out, r) for r in range(2)]
        for s in range(STEPS):
            check(ranks[1][s]["checksum"] == ranks[0][s]["checksum"], f"rank 1 differs at step {s}")
        shutil.rmtree(out)
        print(f"PASS: rank 2, back from its restart and left out of step {CLAMPED}, changed its "
              "weights otherwise than rank 0: its late push was refused and it left the job; "
              "ranks 0 and 1 finished")
        return
    check(code == 0, "the elastic job failed")
    check("rank 2 exited with -9; restarting it (1 of --rank-restarts 1)" in log,
          "morse-run did not restart rank 2")
    check("[rank 2] life 1 starts at step 4" in log, "rank 2 did not rejoin from its checkpoint")
    ranks = [records(out, r) for r in range(3)]
    for s in range(STEPS):
        for r in range(3):
            check(ranks[r][s] is not None, f"rank {r} did not finish step {s}")
            check(ranks[r][s]["checksum"] == ranks[0][s]["checksum"], f"rank {r} differs at step {s}")
    left_out = [s for s in range(STEPS) if ranks[0][s]["members"] != [0, 1, 2]]
    check(left_out and left_out[0] == KILLED, f"steps without rank 2: {left_out}")
    check(ranks[0][STEPS - 1]["members"] == [0, 1, 2],
          f"rank 2 did not join again: the last step's membership {ranks[0][STEPS - 1]['members']}")
    shutil.rmtree(out)
    changed = f" (the weights clamped after step {CLAMPED - 1})" if change else ""
    print(f"PASS: rank 2 killed in step {KILLED}, restarted from step 4; steps {left_out} went on "
          f"without it, it caught up and joined again; all three ranks identical after {STEPS} "
          f"steps{changed}")


def run_without_rank0():
    """Rank 0 killed for good in step KILLED; ranks 1 and 2 go on and
    clamp their weights after step CLAMPED - 1: rank 0 gives the shards
    changed weights, so each of them stops within timeouts.connect_seconds,
    saying that rank 0 must still be in the job, and morse-run, with fewer
    than min_workers ranks left, fails the job."""
    out = tempfile.mkdtemp(prefix="morse-elastic-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("timeouts { step_seconds: 1 recovery_seconds: 60 connect_seconds: 3 }\n")
    code, log = morse_run(__file__, 3, 2, out, "0:clamp_without0", config=config,
                          extra=["--min-workers", "2"])
    print(log)
    check(code != 0, "the job went on with changed weights and no rank 0 to give them")
    check("fewer than min_workers (2) remain; stopping the job" in log,
          "morse-run did not stop the job once fewer than min_workers ranks were left")
    for rank in (1, 2):
        check(f"[rank {rank}] morse._native.MorseError: FAILED_PRECONDITION" in log and
              "in an elastic job rank 0 gives them: it must still be in the job" in log,
              f"rank {rank} did not say why it stopped")
    check(all(os.path.exists(f"{out}/step-{r}-{CLAMPED - 1}.json") for r in (1, 2)),
          "ranks 1 and 2 did not train without rank 0 until the change")
    shutil.rmtree(out)
    print(f"PASS: rank 0 killed in step {KILLED}; ranks 1 and 2 went on, and their change of "
          f"the weights after step {CLAMPED - 1} stopped them, saying rank 0 gives them")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        if sys.argv[-1].startswith("node:"):  # --worker OUT node:PACE
            worker(sys.argv[-2], float(sys.argv[-1][5:]), killed=3)
        else:  # --worker OUT PACE[:CHANGE]
            pace, _, change = sys.argv[-1].partition(":")
            if change == "clamp_without0":  # rank 0 killed, the others clamp
                worker(sys.argv[-2], float(pace), killed=0, change="clamp")
            else:
                worker(sys.argv[-2], float(pace), change=change)
        sys.exit(0)
    modes = sys.argv[1:] or ["refusals", "leaves", "returns", "clamp", "leader", "sharded"]
    for flags, why in ((["--min-workers", "4"], "give 1 to the job's 3 workers"),
                       (["--min-workers", "0"], "give 1 to the job's 3 workers"),
                       (["--min-workers", "2", "--node-aggregation"],
                        "give 1 to the job's 1 workers (one per node with --node-aggregation)"),
                       (["--min-workers", "2", "--stages", "3"], "not supported")):
        if "refusals" not in modes:
            break
        result = subprocess.run([os.environ["MORSE_RUN"], "--servers", "1", "--workers", "3"] +
                                flags + ["--", sys.executable, "-c", "pass"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=60)
        check(result.returncode != 0 and why in result.stdout,
              f"morse-run {' '.join(flags)}: exit {result.returncode}, {result.stdout!r}")
    if "leaves" in modes:
        run_leaves()
    if "returns" in modes:
        run_returns()
    if "clamp" in modes:
        run_leaves("clamp")
        run_returns("clamp")
        run_returns("clamp_other")
        run_without_rank0()
    for how in ("leader", "sharded"):
        if how in modes:
            run_node_leaves(how)
            run_node_returns(how)
