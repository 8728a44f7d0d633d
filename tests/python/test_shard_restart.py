"""Shard loss under morse.torch is a pause: morse-run starts 2 shards for a
job that checkpoints every 4 steps; rank 0 kills shard 1 with SIGKILL after
step 9 and morse-run restarts it on its address from its checkpoint (step 8).
The restarted shard has no model until a worker joins again (an external
job), so the workers Join it again, replay their retained pushes of the steps
it lost, check that it recomputes the replies they applied, and go on. After
every step every rank holds the same bits as the undisturbed simulator.

The config is written on one line, as protobuf's text format allows, with
a comment: morse-run must read its checkpoint.dir (the shards' checkpoints,
their last written as they stop, land there) and not the comment's field.

Then a job whose shards take 6 s more to stop than morse-server itself
(a --server-bin wrapper; a large shard's checkpoint as it stops takes
seconds): morse-run waits for them (--stop-timeout), saying so, instead of
killing them after 5 s."""
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import torch

from harness import (check, check_ranks_match_simulator, morse_run, shard_pid,  # noqa: E402
                     train_recorded)
from morse.run import _config_fields, _find_server  # noqa: E402

STEPS = 20
KILL_AFTER = 9


def worker(out):
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    rank = int(os.environ["MORSE_RANK"])
    opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=5, block_elems=16,
                                 partition_elems=64)
    def kill_shard(step):
        if rank == 0 and step == KILL_AFTER:
            pid = shard_pid(os.environ["MORSE_CONFIG"], 1)
            check(pid is not None, "shard 1's process not found")
            os.kill(pid, signal.SIGKILL)
            print(f"killed shard 1 (pid {pid}) after step {step}", flush=True)

    train_recorded(opt, model, out, STEPS, features=12, classes=5, on_step=kill_shard)


def launcher_tidies():
    """morse-run leaves no folder behind unless the job's checkpoints are in
    it (then it names it), and a bad --config or a COMMAND that does not
    exist is a clear error that stops the shards it started."""
    tmp = tempfile.mkdtemp(prefix="morse-tmpdir-")
    env = dict(os.environ, TMPDIR=tmp)
    base = [os.environ["MORSE_RUN"], "--servers", "1", "--workers", "1"]
    script = ["--", sys.executable, __file__, "--worker", tmp, "short"]
    done = subprocess.run(base + script, env=env, capture_output=True, text=True, timeout=120)
    check(done.returncode == 0, f"a short job failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    left = [n for n in os.listdir(tmp) if n.startswith("morse-run-")]  # (torch 2 puts its own there)
    check(left == [], f"morse-run left {left} in its TMPDIR")
    config = os.path.join(tmp, "every-step.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 1 }\n")
    done = subprocess.run(base + ["--config", config] + script, env=env, capture_output=True,
                          text=True, timeout=120)
    check(done.returncode == 0, f"a short job with checkpoints failed: {done.stderr[-1500:]}")
    kept = [n for n in os.listdir(tmp) if n.startswith("morse-run-")]
    check(len(kept) == 1 and f"this job's checkpoints are in {os.path.join(tmp, kept[0])}" in done.stderr
          and "shard-0.ckpt" in os.listdir(os.path.join(tmp, kept[0])),
          f"the checkpoints' folder was not kept and named: {kept}, {done.stderr[-500:]}")
    done = subprocess.run(base + ["--config", os.path.join(tmp, "missing")] + script, env=env,
                          capture_output=True, text=True, timeout=60)
    check(done.returncode != 0 and f"cannot read --config {os.path.join(tmp, 'missing')}: No such file"
          in done.stderr and "Traceback" not in done.stderr, f"a missing --config: {done.stderr[-800:]}")
    done = subprocess.run(base + ["--", os.path.join(tmp, "no-such-command")], env=env,
                          capture_output=True, text=True, timeout=60)
    check(done.returncode != 0 and "cannot run" in done.stderr and "Traceback" not in done.stderr,
          f"a COMMAND that does not exist: {done.stderr[-800:]}")
    check("stopped before any worker joined" in done.stdout, "its shard was not stopped")
    subprocess.run(["rm", "-rf", tmp])
    print("PASS: morse-run removes its folder (keeps and names it when it holds the checkpoints); "
          "a missing --config or COMMAND is a clear error that stops the shards")


def slow_to_stop():
    """Shards that take 6 s more to stop than morse-server: morse-run waits."""
    work = tempfile.mkdtemp(prefix="morse-slow-stop-")
    wrapper, marker = os.path.join(work, "slow-server"), os.path.join(work, "stopped")
    with open(wrapper, "w") as f:
        f.write(f"""#!/bin/bash
{_find_server()} "$@" &
child=$!
trap 'kill -TERM $child; wait $child; sleep 6; echo >> {marker}; exit 0' TERM
wait $child
""")
    os.chmod(wrapper, stat.S_IRWXU)
    out = os.path.join(work, "out")
    os.makedirs(out)
    started = time.time()
    code, log = morse_run(__file__, 2, 2, out, "short", extra=["--server-bin", wrapper])
    print(log[-2000:])
    check(code == 0, "the job with slow shards failed")
    check("waiting for the shards to stop" in log, "morse-run did not say it waits for the shards")
    check(os.path.exists(marker) and len(open(marker).read()) == 2,
          "morse-run killed shards that were still stopping")
    print(f"PASS: shards 6 s slow to stop were waited for ({time.time() - started:.0f} s in all)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        if sys.argv[-1] == "short":
            import morse.torch
            model = torch.nn.Linear(16, 2)
            opt = morse.torch.Adam(model.parameters(), lr=0.01, block_elems=16)
            for _ in range(2):  # "short": a job of two steps
                model(torch.ones(3, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
        else:
            worker(sys.argv[-1])
        sys.exit(0)
    one_line = 'checkpoint { every_steps: 4 dir: "D" } timeouts { recovery_seconds: 60 }  # every_steps: 1'
    check(_config_fields(one_line) == {"checkpoint": None, "checkpoint.every_steps": ["4"],
                                       "checkpoint.dir": ["D"], "timeouts": None,
                                       "timeouts.recovery_seconds": ["60"]},
          f"morse-run read {_config_fields(one_line)} from {one_line!r}")
    out = tempfile.mkdtemp(prefix="morse-restart-")
    checkpoints = tempfile.mkdtemp(prefix="morse-restart-checkpoints-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write(one_line.replace('"D"', f'"{checkpoints}"') + "\n")
    code, log = morse_run(__file__, 2, 2, out, config=config)
    print(log)
    os.remove(config)
    check(code == 0, "the job failed")
    check("killed shard 1" in log, "the shard was not killed")
    check("restarting it on" in log, "morse-run did not restart the shard")
    check("restarted from its checkpoint at step 8" in log, "the workers did not replay from step 8")
    check_ranks_match_simulator(out, 2, STEPS)
    for shard in range(2):
        path = os.path.join(checkpoints, f"shard-{shard}.ckpt")
        check(f"checkpoint of step {STEPS} written to {path} (shutdown)" in log,
              f"shard {shard}'s last checkpoint is not in the config's checkpoint.dir")
    print(f"PASS: shard 1 killed after step {KILL_AFTER} and restarted; {STEPS} steps, both ranks "
          "bit-identical to each other and to the simulator; the one-line config's checkpoint.dir "
          "holds the shards' checkpoints")
    subprocess.run(["rm", "-rf", checkpoints])
    slow_to_stop()
    launcher_tidies()
