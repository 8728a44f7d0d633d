#!/usr/bin/env python3
"""A fault campaign as a benchmark (issue 40): a morse.torch job under
morse-run that loses ranks and shards to SIGKILL while it trains, and ends
where an undisturbed run of the same job ends, bit for bit.

    deploy/experiments/fault_campaign.py [--workers 4] [--shards 2] [--steps 1000]
        [--kill-every 50] [--shard-kills 2] [--seed 1] [--out DIR]

Runs the job twice with `morse-run --rank-restarts --restarts` and
checkpoints every --checkpoint-every steps: once undisturbed, once with a
random rank killed about every --kill-every steps (morse-run restarts it; it
rejoins from its checkpoint and replays the steps since) and --shard-kills
shards killed at random points (morse-run restarts them from their
checkpoints; the ranks wait and replay what they lost). Faults are spaced so
that each one's recovery is over before the next (a rank killed right after a
shard's restart could find no replies to replay: docs/operations.md). The
training script is a 2-layer MLP with OneBitAdam (freeze at step 20) whose
batches are a function of the step, so the replayed steps see the same data.

With --min-workers M the job is elastic (min_workers M,
timeouts.step_seconds 2), and this script supervises every daemon and rank
itself, as systemd or Kubernetes would (for --workload torch, the ranks are
started with the environment morse-run gives them): the shards complete a
step without a rank missing past 2 s, and the others go on. Half the rank kills are then
restarted a second later as before; the other half stay away for
--away-steps steps, their checkpoints deleted, and come back as new nodes
would: joining from the shards' model with a fresh error buffer. Those runs
differ from the undisturbed one (other workers averaged other steps), so the
check is then that the job finishes by itself with every rank's final loss
within 1% of the undisturbed run's; the table adds the steps each fault's
rank was left out of, and a rank away's seconds to resume count from its
new start.

Prints, per fault, the step it hit, the step the rank restarted from (what
it replayed) and the seconds from the kill to the restarted rank's first new
step; then the final loss and checksum of both runs and whether they are
identical. Exit status 0 only if the disturbed run finished by itself and
equals the undisturbed one. Needs a build (MORSE_RUN or --build).
"""
import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def rank_script(out, steps, pace=0.0):
    """The training script every rank runs: writes its step to
    out/progress-<rank> after each step and its result at the end; each
    step takes at least `pace` seconds (a bigger model's compute)."""
    return f"""
import os, time, torch, morse.torch
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
rank = int(os.environ["MORSE_RANK"])
opt = morse.torch.OneBitAdam(model.parameters(), lr=3e-3, freeze_step=20, partition_elems=4096,
                             block_elems=256)
teacher = torch.Generator().manual_seed(99)
w = torch.randn(32, 10, generator=teacher)
loss = torch.tensor(0.0)
for step in range(opt.step_index, {steps}):
    start = time.monotonic()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    y = (x @ w).argmax(1)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    time.sleep(max(0.0, {pace} - (time.monotonic() - start)))
    opt.step()
    with open("{out}/progress-%d.tmp" % rank, "w") as f:
        f.write(str(step + 1))
    os.replace("{out}/progress-%d.tmp" % rank, "{out}/progress-%d" % rank)
    with open("{out}/metrics-%d.jsonl" % rank, "a") as f:
        f.write('{{"step":%d,"loss":%r,"members":%s}}\\n' % (step, loss.item(), opt.membership()))
# The model's loss on 4,096 held-out samples (the same for every run).
held = torch.Generator().manual_seed(12345)
x = torch.randn(4096, 32, generator=held)
with torch.no_grad():
    held_out = torch.nn.functional.cross_entropy(model(x), (x @ w).argmax(1)).item()
print("RESULT rank %d loss %.6f checksum %s held_out %.6f" % (rank, loss.item(), opt.checksum(),
                                                             held_out), flush=True)
"""


def progress(out, workers):
    """The step every rank has reached (the slowest one's)."""
    steps = []
    for r in range(workers):
        try:
            with open(f"{out}/progress-{r}") as f:
                steps.append(int(f.read() or 0))
        except (OSError, ValueError):
            steps.append(0)
    return min(steps)


def children(parent, kind):
    """pid -> rank (kind "rank") or shard ("shard") of morse-run `parent`'s
    ranks or shards."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            if kind == "shard":
                if argv and argv[0].endswith(b"morse-server") and b"--shard" in argv:
                    found[int(pid)] = int(argv[argv.index(b"--shard") + 1])
            else:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
                if b"MORSE_RANK" in env:
                    found[int(pid)] = int(env[b"MORSE_RANK"])
        except (OSError, ValueError, IndexError):
            continue
    return found


def note_recoveries(records, lines, arrived):
    """Adds to each fault record what its restarted process said: the step
    it restarted from ("from"), the step the job had completed
    ("completed"), and the seconds from the kill to that line. `lines` are
    the job's output, each prefixed "[rank r] " or "[... shard s] ...",
    `arrived` when each came."""
    for record in records:
        if record["kind"] == "rank":
            # "rejoining at step 30 ...; the shards have completed 32 steps",
            # or "resuming at step 910" when they had not gone on.
            pattern = re.compile(rf"^\[rank {record['who']}\] worker {record['who']}: "
                                 r"(?:rejoining|resuming) at step (\d+)(?:.*completed (\d+) steps)?")
        else:  # the restarted shard's own line; the ranks had reached record["step"]
            pattern = re.compile(rf"shard {record['who']}: resumed from \S+ at step (\d+)")
        for i in range(record["seen"], len(lines)):
            m = pattern.search(lines[i])
            if m:
                record["from"] = int(m.group(1))
                if record["kind"] == "rank":
                    record["completed"] = int(m.group(2) or m.group(1))
                else:
                    record["completed"] = max(record["from"], record["step"])
                record["rejoin_seconds"] = arrived[i] - record["killed_at"]
                break


def note_left_out(records, lines):
    """Adds to each rank fault the steps the shards completed without that
    rank after it ("left_out"): for a rank away, from the step it missed to
    the one it joined at; for one restarted at once, the steps of the
    shards' lines "step T completed without rank(s) R" up to its next
    fault (none when it was back within timeouts.step_seconds)."""
    left = {}
    for line in lines:
        m = re.search(r"step (\d+) completed without rank\(s\) ([\d, ]+) in", line)
        if m:
            for rank in m.group(2).split(", "):
                left.setdefault(int(rank), set()).add(int(m.group(1)))
    for i, record in enumerate(records):
        if record["kind"] != "rank":
            continue
        until = next((r["step"] for r in records[i + 1:] if r["kind"] == "rank"
                      and r["who"] == record["who"]), float("inf"))
        if "from" in record and (record.get("away") or record["from"] > record["step"]):
            # Not in any step from the one it missed to the one it joined
            # at (a rank that came back to find its checkpoint's step gone
            # from the shards' kept replies joins from their model).
            record["left_out"] = max(record["from"] - record["step"], 0)
        else:
            record["left_out"] = len([s for s in left.get(record["who"], ())
                                      if record["step"] - 1 <= s < until])


def failure_log(lines):
    """What to show of a job that failed: every rank's lines (their
    errors, rejoins and tracebacks; the last 200), then the job's last 20
    lines (the shards' progress)."""
    ranks = [line for line in lines if re.match(r"^\[(?:rank|worker) ", line)][-200:]
    return "".join(["--- the ranks' output:\n"] + ranks + ["--- the job's last lines:\n"]
                   + lines[-20:])


def run(args, faults):
    """One job; returns (exit code, output lines, results, fault records)."""
    out = tempfile.mkdtemp(prefix="morse-campaign-")
    script = os.path.join(out, "train.py")
    with open(script, "w") as f:
        f.write(rank_script(out, args.steps, args.pace))
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write(f"checkpoint {{ every_steps: {args.checkpoint_every} }}\n"
                "timeouts { recovery_seconds: 120 }\n")
    morse_run = os.environ.get("MORSE_RUN", os.path.join(args.build, "bin", "morse-run"))
    command = [morse_run, "--servers", str(args.shards), "--workers", str(args.workers),
               "--config", config, "--rank-restarts", str(args.steps), "--restarts",
               str(args.shard_kills + 1), "--", args.python, script]
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build, "python"))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines, arrived = [], []  # morse-run's output, and when each line came

    def read():
        for line in iter(proc.stdout.readline, ""):
            arrived.append(time.time())
            lines.append(line)
            if args.verbose:
                sys.stdout.write(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    records = []
    plan = list(faults)
    while proc.poll() is None:
        time.sleep(0.05)
        if not plan:
            continue
        at, kind = plan[0]
        if progress(out, args.workers) < at:
            continue
        plan.pop(0)
        targets = children(proc.pid, kind)
        if not targets:
            continue
        pid = random.choice(sorted(targets))
        who = targets[pid]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        records.append({"kind": kind, "who": who, "step": progress(out, args.workers),
                        "killed_at": killed_at, "seen": len(lines)})
    reader.join(timeout=10)
    code = proc.wait()
    results = {}
    for line in lines:
        m = re.search(r"RESULT rank (\d+) loss (\S+) checksum (\S+)", line)
        if m:
            results[int(m.group(1))] = (float(m.group(2)), m.group(3))
    note_recoveries(records, lines, arrived)
    shutil.rmtree(out, ignore_errors=True)
    return code, lines, results, records


def free_ports(n, build):
    """N free loopback ports, chosen as morse-run (BUILD's) chooses them:
    below the ephemeral range, where no connection's own port can take one
    first."""
    sys.path.insert(0, os.path.join(build, "python"))
    from morse.run import _free_ports
    return _free_ports(n)


def run_supervised(args, faults):
    """The campaign with this script supervising every daemon and rank, as
    systemd or Kubernetes would: a killed one is started again with its
    command line (ranks rejoining from their checkpoints), and a rank away
    comes back later as a new node. The ranks are morse-worker's synthetic
    workload (--workload worker: 1-bit Adam, its freeze at step 20) or the
    morse.torch script of run() (--workload torch), started with the
    environment morse-run gives its ranks. Returns what run() does."""
    out = tempfile.mkdtemp(prefix="morse-campaign-")
    config = os.path.join(out, "job.textproto")
    torch_ranks = args.workload == "torch"
    with open(config, "w") as f:
        f.write(f"""workers: {args.workers}
shards: {args.shards}
timeouts {{ step_seconds: 30 recovery_seconds: 120 }}
checkpoint {{ every_steps: {args.checkpoint_every} }}
""")
        # The torch script's first push describes its model (external).
        f.write("external {}\n" if torch_ranks else f"""synthetic {{ dim: 200003 noise: 0.2 }}
optimizer: "onebit_adam"
freeze_step: 20
lr {{ lr: 0.01 }}
steps: {args.steps}
block_elems: 256
partition_elems: 16384
seed: 7
log_every: 100
""")
    if args.min_workers:
        with open(config, "a") as f:
            f.write(f"min_workers: {args.min_workers}\n")
        text = open(config).read().replace("step_seconds: 30", "step_seconds: 2")
        with open(config, "w") as f:
            f.write(text)
    ports = free_ports(args.shards, args.build)
    servers = ",".join(f"127.0.0.1:{p}" for p in ports)
    bin_dir = args.build
    commands = {("shard", s): [f"{bin_dir}/server/morse-server", "--config", config, "--shard", str(s),
                               "--listen", f"127.0.0.1:{ports[s]}", "--insecure",
                               "--checkpoint_dir", out] for s in range(args.shards)}
    envs = {}
    if torch_ranks:
        script = os.path.join(out, "train.py")
        with open(script, "w") as f:
            f.write(rank_script(out, args.steps, args.pace))
    for r in range(args.workers):
        if torch_ranks:
            # What morse-run sets for its ranks (MORSE_REJOIN on restarts).
            commands[("rank", r)] = [args.python, script]
            envs[("rank", r)] = dict(os.environ, PYTHONPATH=os.path.join(args.build, "python"),
                                     MORSE_RANK=str(r), MORSE_WORLD_SIZE=str(args.workers),
                                     MORSE_CONFIG=config, MORSE_SERVERS=servers, MORSE_INSECURE="1",
                                     MORSE_CHECKPOINT_DIR=out)
        else:
            commands[("rank", r)] = [f"{bin_dir}/worker/morse-worker", "--config", config, "--rank",
                                     str(r), "--servers", servers, "--insecure", "--checkpoint_dir",
                                     out, "--rejoin", "--metrics", f"{out}/metrics-{r}.jsonl"]
    lines, arrived = [], []
    lock = threading.Lock()
    procs, readers = {}, []

    def start(key, again=False):
        env = envs.get(key)
        if env is not None and again:
            env = dict(env, MORSE_REJOIN="1")
        p = subprocess.Popen(commands[key], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env)
        procs[key] = p

        def read():
            for line in iter(p.stdout.readline, ""):
                with lock:
                    arrived.append(time.time())
                    lines.append(f"[{key[0]} {key[1]}] {line}")
                if args.verbose:
                    sys.stdout.write(f"[{key[0]} {key[1]}] {line}")
        t = threading.Thread(target=read, daemon=True)
        t.start()
        readers.append(t)

    def worker_progress(ranks=None):
        steps = []
        for r in ranks if ranks is not None else range(args.workers):
            try:
                with open(f"{out}/metrics-{r}.jsonl") as f:
                    steps.append(max([int(m) + 1 for m in re.findall(r'"step":(\d+)', f.read())] or [0]))
            except OSError:
                steps.append(0)
        return min(steps) if steps else 0

    def leader_progress():
        # The slowest rank's step, leaving out the ones away (an elastic
        # job goes on without them).
        return worker_progress([r for r in range(args.workers) if r not in away])

    for s in range(args.shards):
        start(("shard", s))
    time.sleep(0.5)
    for r in range(args.workers):
        start(("rank", r))
    records, plan = [], list(faults)
    away = {}  # rank -> the step at which it comes back
    failures = {}  # rank -> its exits with an error that were restarted
    last_fault = -args.gap
    deadline = time.time() + 1800

    def failed():
        # Ranks that exited with an error on their own (not killed here: a
        # killed one is started again at once) and that a supervisor would
        # restart (systemd's Restart=on-failure, morse-run --rank-restarts):
        # e.g. a rank back from its checkpoint that the job left behind
        # while it started ("too far behind to catch up: restart it").
        return [r for r in range(args.workers) if r not in away
                and procs[("rank", r)].poll() not in (None, 0)
                and failures.get(r, 0) < (args.failure_restarts if faults else 0)]

    while (any(procs[("rank", r)].poll() is None for r in range(args.workers)) or away
           or failed()):
        time.sleep(0.05)
        if time.time() > deadline:
            break
        for r in failed():
            failures[r] = failures.get(r, 0) + 1
            with lock:
                seen = len(lines)
            records.append({"kind": "rank", "who": r, "step": worker_progress([r]),
                            "killed_at": time.time(), "seen": seen,
                            "exited": procs[("rank", r)].returncode})
            start(("rank", r), again=True)
        for r, back in list(away.items()):
            if leader_progress() >= back or all(procs[("rank", o)].poll() is not None
                                               for o in range(args.workers) if o not in away):
                del away[r]
                for record in reversed(records):  # seconds to resume: from this start
                    if record["kind"] == "rank" and record["who"] == r and record.get("away"):
                        record["killed_at"] = time.time()
                        with lock:
                            record["seen"] = len(lines)
                        break
                start(("rank", r), again=True)  # a new node: no checkpoint, the shards' model
        # Each fault at least a gap after the last one's step, whatever the
        # plan said: one rank's return can hold the progress back until two
        # faults are due at once (a shard and a worker lost together are
        # not recoverable in place: docs/operations.md).
        if not plan or leader_progress() < max(plan[0][0], last_fault + args.gap):
            continue
        if leader_progress() >= args.steps - args.gap:
            # Deferred so long that the job ends before a rank could be
            # left out and come back, or a recovery be seen: not injected
            # (a loaded host slows the recoveries, not the plan).
            print(f"fault_campaign: {len(plan)} planned fault(s) not injected: the job reached "
                  f"step {leader_progress()} of {args.steps} before they were due", flush=True)
            plan.clear()
            continue
        at, kind = plan.pop(0)
        last_fault = leader_progress()
        candidates = ([r for r in range(args.workers) if r not in away] if kind.startswith("rank")
                      else range(args.shards))
        who = random.choice(list(candidates))
        key = ("rank" if kind.startswith("rank") else "shard", who)
        with lock:
            seen = len(lines)
        killed_at = time.time()
        procs[key].kill()
        procs[key].wait()
        records.append({"kind": key[0], "who": who, "step": leader_progress(),
                        "killed_at": killed_at, "seen": seen, "away": kind == "rank-away"})
        if kind == "rank-away":
            for f in os.listdir(out):  # its checkpoints: it comes back as a new node
                if f.startswith(f"worker-{who}."):
                    os.remove(os.path.join(out, f))
            away[who] = leader_progress() + args.away_steps
            continue
        time.sleep(1.0)  # the supervisor's restart delay
        start(key, again=True)
    codes = [procs[("rank", r)].wait(timeout=60) for r in range(args.workers)]
    for s in range(args.shards):
        procs[("shard", s)].terminate()
        procs[("shard", s)].wait(timeout=30)
    for t in readers:
        t.join(timeout=5)
    results = {}
    for line in lines:
        m = (re.search(r"^\[rank (\d+)\] RESULT rank \d+ loss (\S+) checksum (\S+) held_out (\S+)",
                       line)
             if torch_ranks else
             re.search(r'^\[rank (\d+)\] \{"rank":\d+.*"final_loss":([^,]+),.*"checksum":"([0-9a-f]+)"',
                       line))
        if m:
            results[int(m.group(1))] = (float(m.group(2)), m.group(3))
            if torch_ranks:
                results["held_out"] = float(m.group(4))
    note_recoveries(records, lines, arrived)
    note_left_out(records, lines)
    # The mean loss over the last tenth of the steps, every rank's lines
    # (one step's loss is one batch's; this is steadier).
    tail = []
    for r in range(args.workers):
        try:
            with open(f"{out}/metrics-{r}.jsonl") as f:
                for line in f:
                    m = re.search(r'"step":(\d+),.*"loss":([^,}]+)[,}]', line)
                    if m and int(m.group(1)) >= args.steps - max(args.steps // 10, 1):
                        tail.append(float(m.group(2)))
        except OSError:
            pass
    results["tail_loss"] = sum(tail) / len(tail) if tail else float("nan")
    shutil.rmtree(out, ignore_errors=True)
    code = 0 if all(c == 0 for c in codes) else next(c for c in codes if c != 0)
    return code, lines, results, records


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--workers", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--shards", type=int, default=2, help="server shards (default 2)")
    p.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    p.add_argument("--kill-every", type=int, default=50,
                   help="steps between rank kills, on average (default 50)")
    p.add_argument("--shard-kills", type=int, default=2, help="shards killed (default 2)")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="checkpoint.every_steps (default 10)")
    p.add_argument("--seed", type=int, default=1, help="where the faults fall (default 1)")
    p.add_argument("--workload", choices=("torch", "worker"), default="torch",
                   help="torch: a morse.torch script under morse-run (default); worker: "
                        "morse-worker's synthetic workload (D = 200,003), supervised by this script")
    p.add_argument("--min-workers", type=int, default=0, metavar="M",
                   help="an elastic job (min_workers M), this script supervising the ranks: half "
                        "the rank kills stay away for --away-steps steps and come back as new nodes")
    p.add_argument("--away-steps", type=int, default=100,
                   help="steps a rank killed in an elastic job stays away (default 100)")
    p.add_argument("--pace", type=float, default=0.0, metavar="SECONDS",
                   help="--workload torch: each step's compute takes at least this long, as a "
                        "bigger model's would (default 0: the MLP's own, about 1 ms)")
    p.add_argument("--failure-restarts", type=int, default=2,
                   help="with --min-workers, times a rank that exits with an error on its own is "
                        "restarted, as a supervisor would (default 2)")
    p.add_argument("--verbose", action="store_true", help="show morse-run's output as it comes")
    p.add_argument("--python", default="/usr/bin/python3" if os.path.exists("/usr/bin/python3")
                   else sys.executable,
                   help="the Python with torch that runs the ranks (default /usr/bin/python3)")
    p.add_argument("--build", default=os.environ.get("MORSE_BUILD_DIR", os.path.join(ROOT, "build")))
    args = p.parse_args()
    if args.workers < 2 or args.shards < 1 or args.steps < 4 * args.checkpoint_every:
        p.error("needs --workers >= 2, --shards >= 1 and --steps >= 4 x --checkpoint-every")
    if args.min_workers and not 1 <= args.min_workers < args.workers:
        p.error("--min-workers needs a value in [1, --workers)")
    random.seed(args.seed)
    # Faults at least 3 checkpoint intervals apart (each recovery over before
    # the next), a rank kill about every --kill-every steps, shard kills at
    # random among them.
    gap = args.gap = max(3 * args.checkpoint_every, 1)
    faults, step = [], gap
    while step < args.steps - gap:
        faults.append([step, "rank"])
        step += max(gap, int(random.expovariate(1.0 / args.kill_every)) + gap // 2)
    for index in random.sample(range(len(faults)), min(args.shard_kills, len(faults))):
        faults[index][1] = "shard"
    if args.min_workers:  # every other rank kill stays away
        ranks = [f for f in faults if f[1] == "rank"]
        for f in ranks[1::2] or ranks[:1]:  # at least one, where there is a rank kill
            f[1] = "rank-away"
    faults = [tuple(f) for f in faults]

    started = time.time()
    job = run if args.workload == "torch" and not args.min_workers else run_supervised
    code, clean_lines, undisturbed, _ = job(args, [])
    clean_seconds = time.time() - started
    if code != 0 or len([r for r in undisturbed if isinstance(r, int)]) != args.workers:
        sys.stdout.write("".join(clean_lines[-30:]))
        sys.exit(f"fault_campaign: the undisturbed run failed (exit {code})")
    started = time.time()
    code, lines, disturbed, records = job(args, faults)
    faulty_seconds = time.time() - started
    print(f"{args.workers} ranks, {args.shards} shards, {args.steps} steps, checkpoints every "
          f"{args.checkpoint_every}; {len(records)} faults")
    print("| fault | at step | restarted from | steps replayed | seconds to resume |"
          + (" steps left out |" if args.min_workers else ""))
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if args.min_workers else ""))
    for r in records:
        replayed = r["completed"] - r["from"] if "completed" in r else "?"
        seconds = f"{r['rejoin_seconds']:.1f}" if "rejoin_seconds" in r else "?"
        kind = f"{r['kind']} {r['who']}" + (" (away)" if r.get("away") else "") + (
            f" (exited {r['exited']}, restarted)" if "exited" in r else "")
        print(f"| {kind} | {r['step']} | {r.get('from', '?')} | {replayed} | {seconds} |"
              + (f" {r.get('left_out', '-')} |" if args.min_workers else ""))
    if args.min_workers:
        # Other steps averaged other workers: the same job, not the same
        # bits. Every rank that trained to the end holds the same model.
        finals = {v[1] for r, v in disturbed.items() if r not in ("tail_loss", "held_out")}
        clean, elastic = undisturbed["tail_loss"], disturbed.get("tail_loss", float("nan"))
        ratio = elastic / clean
        left_out = [r for r in records if r.get("away")]
        ok = (code == 0 and len(finals) == 1 and bool(left_out)
              and all(r.get("left_out", 0) > 0 for r in left_out))
        print(f"undisturbed: {clean_seconds:.1f} s, mean loss of the last {max(args.steps // 10, 1)} "
              f"steps {clean:.6g}")
        print(f"elastic, with faults: {faulty_seconds:.1f} s, exit {code}; mean loss of the last "
              f"steps {elastic:.6g} ({ratio:.4f} x the undisturbed run's); the ranks at the end "
              f"hold {'one model' if len(finals) == 1 else f'{len(finals)} different models'}")
        if "held_out" in undisturbed:
            # The final model itself, on samples no rank trained on.
            held = disturbed.get("held_out", float("nan")) / undisturbed["held_out"]
            print(f"held-out loss of the final model: {disturbed.get('held_out', float('nan')):.6g} "
                  f"against {undisturbed['held_out']:.6g} undisturbed ({held:.4f} x)")
        print("FINISHED: the job ran to the end by itself, the ranks away were left out and came "
              "back, every rank ends with the same model" if ok else
              "FAILED: see the log above")
        if not ok:
            sys.stdout.write(failure_log(lines))
        return 0 if ok else 1
    for key in ("tail_loss", "held_out"):
        undisturbed.pop(key, None)
        disturbed.pop(key, None)
    same = disturbed == undisturbed and len(disturbed) == args.workers
    loss = undisturbed[0][0]
    print(f"undisturbed: {clean_seconds:.1f} s, loss {loss:.6f}, checksum {undisturbed[0][1]}")
    if disturbed:
        print(f"with faults: {faulty_seconds:.1f} s, loss {disturbed.get(0, (float('nan'),))[0]:.6f}, "
              f"checksum {disturbed.get(0, (0, '?'))[1]}; exit {code}")
    print("IDENTICAL: every rank's final loss and checksum equal the undisturbed run's" if same and
          code == 0 else "DIFFERENT or unfinished: see the log above")
    if not (same and code == 0):
        sys.stdout.write(failure_log(lines))
    return 0 if same and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
