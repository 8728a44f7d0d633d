#!/usr/bin/env python3
"""Stragglers as a benchmark (issue 40, part 3): what leaving a slow worker
out of a step (timeouts.straggler_seconds; docs/design.md 4, "Stragglers")
gains in time and costs in loss.

    deploy/experiments/stragglers.py [--workers 4] [--shards 2] [--steps 600]
        [--pause-ms 100] [--pause-every 50] [--grace 0.02 0.1] [--seed 1]

Runs morse-worker's synthetic workload (1-bit Adam, D = 200,003, its freeze
at step 20) with --workers workers and --shards shards, this script
supervising them: once undisturbed, then with a random worker paused
(SIGSTOP, then SIGCONT --pause-ms later: a garbage collection, a preempted
VM, a noisy neighbour) about every --pause-every steps, the same pauses in
every run:
  - with min_workers = workers: every step waits for every worker (no
    stragglers rule; the baseline);
  - with min_workers = workers - 1 and timeouts.straggler_seconds G, for
    each --grace G: a step that has every push but one waits G more, then
    completes without the slow one, which catches up through the replies
    the shards keep (checkpoint.replay_steps 64); one that fell further
    behind exits, and this script starts it again with --rejoin, as
    Kubernetes would: it joins from the shards' model with a fresh error
    buffer.

Prints per run its seconds, its speed relative to the undisturbed run, the
mean loss of the last tenth of the steps (every worker's) relative to the
undisturbed run's, how many steps left a worker out, and how many times a
worker had to rejoin. Every worker of a
run must end with the same model (exit status 1 otherwise). Needs a build
(MORSE_BUILD_DIR or --build).
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
import time

from fault_campaign import free_ports  # noqa: E402 (beside this script)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def step_of(path):
    """The last step a worker's metrics file records, plus one."""
    try:
        with open(path) as f:
            return max([int(m) + 1 for m in re.findall(r'"step":(\d+)', f.read())] or [0])
    except OSError:
        return 0


def run(args, pauses, min_workers, grace):
    """One job; returns a dict of what it measured."""
    out = tempfile.mkdtemp(prefix="morse-stragglers-")
    config = os.path.join(out, "job.textproto")
    timeouts = "step_seconds: 30 recovery_seconds: 120" + (
        f" straggler_seconds: {grace}" if grace else "")
    with open(config, "w") as f:
        f.write(f"""workers: {args.workers}
shards: {args.shards}
synthetic {{ dim: 200003 noise: 0.2 }}
optimizer: "onebit_adam"
freeze_step: 20
lr {{ lr: 0.01 }}
steps: {args.steps}
block_elems: 256
partition_elems: 16384
seed: 7
log_every: 1000
min_workers: {min_workers}
timeouts {{ {timeouts} }}
checkpoint {{ replay_steps: 64 }}
""")
    ports = free_ports(args.shards, args.build)
    servers = ",".join(f"127.0.0.1:{p}" for p in ports)
    logs = []

    def start(command, name):
        log = open(os.path.join(out, f"{name}.log"), "a")
        logs.append(log)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    shards = [start([f"{args.build}/server/morse-server", "--config", config, "--shard", str(s),
                     "--listen", f"127.0.0.1:{ports[s]}", "--insecure"], f"shard-{s}")
              for s in range(args.shards)]
    time.sleep(0.5)
    metrics = [os.path.join(out, f"metrics-{r}.jsonl") for r in range(args.workers)]
    started = time.time()
    def worker(r, rejoin=False):
        return start([f"{args.build}/worker/morse-worker", "--config", config, "--rank", str(r),
                      "--servers", servers, "--insecure", "--metrics", metrics[r]]
                     + (["--rejoin"] if rejoin else []), f"worker-{r}")

    workers = [worker(r) for r in range(args.workers)]

    def signal_worker(r, signum):
        try:
            os.kill(workers[r].pid, signum)
        except ProcessLookupError:  # it had just exited
            pass
    plan = list(pauses)
    paused = None  # (worker, when to resume it)
    rejoins = 0
    deadline = started + 900
    while any(w.poll() is None for w in workers) and time.time() < deadline:
        time.sleep(0.002)
        for r, w in enumerate(workers):
            # Too far behind to catch up: it exits, and comes back.
            if w.poll() not in (None, 0) and min_workers < args.workers and rejoins < 50:
                rejoins += 1
                workers[r] = worker(r, rejoin=True)
        if paused and time.time() >= paused[1]:
            signal_worker(paused[0], signal.SIGCONT)
            paused = None
        if paused or not plan or workers[plan[0][1]].poll() is not None:
            continue
        at, who = plan[0]
        if step_of(metrics[who]) >= at:
            plan.pop(0)
            signal_worker(who, signal.SIGSTOP)
            paused = (who, time.time() + args.pause_ms / 1000)
    if paused:
        signal_worker(paused[0], signal.SIGCONT)
    seconds = time.time() - started
    codes = []
    for w in workers:
        try:
            codes.append(w.wait(timeout=60))
        except subprocess.TimeoutExpired:
            w.kill()
            codes.append(-9)
    for s in shards:
        s.terminate()
        s.wait(timeout=30)
    for log in logs:
        log.close()
    tail, absent_steps, checksums = [], set(), set()
    for r in range(args.workers):
        with open(metrics[r]) as f:
            for line in f:
                m = re.search(r'"step":(\d+),.*"loss":([^,}]+)', line)
                if not m:
                    continue
                step = int(m.group(1))
                if step >= args.steps - max(args.steps // 10, 1):
                    tail.append(float(m.group(2)))
                if '"absent":[' in line:
                    absent_steps.add(step)
        with open(os.path.join(out, f"worker-{r}.log")) as f:
            for m in re.finditer(r'"checksum":"([0-9a-f]+)"', f.read()):
                checksums.add(m.group(1))
    failed = next((c for c in codes if c != 0), 0)
    if failed:
        with open(os.path.join(out, f"worker-{codes.index(failed)}.log")) as f:
            sys.stdout.write(f.read()[-3000:])
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "tail": sum(tail) / len(tail) if tail else float("nan"),
            "left_out": len(absent_steps), "models": len(checksums), "exit": failed,
            "rejoins": rejoins}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--workers", type=int, default=4, help="workers (default 4)")
    p.add_argument("--shards", type=int, default=2, help="server shards (default 2)")
    p.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    p.add_argument("--pause-ms", type=float, default=100,
                   help="how long a paused worker stays stopped (default 100)")
    p.add_argument("--pause-every", type=int, default=50,
                   help="steps between pauses, on average (default 50)")
    p.add_argument("--grace", type=float, nargs="+", default=[0.02, 0.1], metavar="SECONDS",
                   help="timeouts.straggler_seconds to compare (default 0.02 0.1)")
    p.add_argument("--seed", type=int, default=1, help="where the pauses fall (default 1)")
    p.add_argument("--build", default=os.environ.get("MORSE_BUILD_DIR", os.path.join(ROOT, "build")))
    args = p.parse_args()
    if args.workers < 2 or args.shards < 1 or args.steps < 40 or args.pause_every < 1:
        p.error("needs --workers >= 2, --shards >= 1, --steps >= 40 and --pause-every >= 1")
    if args.pause_ms <= 0 or any(not 0 < g < 30 for g in args.grace):
        p.error("--pause-ms must be positive and each --grace in (0, 30) seconds")
    for binary in ("server/morse-server", "worker/morse-worker"):
        if not os.access(os.path.join(args.build, binary), os.X_OK):
            sys.exit(f"stragglers: no {binary} under {args.build} (build Morse, or pass --build)")
    random.seed(args.seed)
    pauses, step = [], 25  # after the warmup's first steps
    while step < args.steps - 10:
        pauses.append((step, random.randrange(args.workers)))
        step += 1 + int(random.expovariate(1.0 / args.pause_every))
    n = args.workers
    runs = [("undisturbed", [], n, None), (f"paused, min_workers {n} (waits)", pauses, n, None)]
    runs += [(f"paused, min_workers {n - 1}, straggler_seconds {g:g}", pauses, n - 1, g)
             for g in args.grace]
    print(f"{n} workers, {args.shards} shards, {args.steps} steps of the synthetic workload "
          f"(D = 200,003, 1-bit Adam); {len(pauses)} pauses of {args.pause_ms:g} ms")
    print("| run | seconds | speed vs undisturbed | tail loss vs undisturbed | steps with a worker "
          "left out | rejoins | models at the end |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    base, ok = None, True
    for name, plan, min_workers, grace in runs:
        r = run(args, plan, min_workers, grace)
        base = base or r
        ok &= r["exit"] == 0 and r["models"] == 1
        print(f"| {name} | {r['seconds']:.1f} | {base['seconds'] / r['seconds']:.2f} | "
              f"{r['tail'] / base['tail']:.4f} | {r['left_out']} | {r['rejoins']} | {r['models']}"
              + (f" (exit {r['exit']})" if r["exit"] else "") + " |", flush=True)
    print("OK: every run finished with one model" if ok else "FAILED: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
