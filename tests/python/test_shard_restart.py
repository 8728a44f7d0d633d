"""Shard loss under morse.torch is a pause: morse-run starts 2 shards for a
job that checkpoints every 4 steps; rank 0 kills shard 1 with SIGKILL after
step 9 and morse-run restarts it on its address from its checkpoint (step 8).
The restarted shard has no model until a worker joins again (an external
job), so the workers Join it again, replay their retained pushes of the steps
it lost, check that it recomputes the replies they applied, and go on. After
every step every rank holds the same bits as the undisturbed simulator.

The same with the script's clip_grad_norm_ of the whole model every step
(`whole`), and over the first layer, then the whole model (`part`), fp32
Adam, so that every step averages and commits its clip (its norm, or its
pieces): the killed shard's restart from step 8 replays steps 8 and 9 with
their clips (carried by the next steps' pushes; the commit of step 7,
which the checkpoint holds applied, is taken as applied), and every rank
ends every step on the bits of the same job undisturbed, the shards'
mirrors holding the workers' parameters after every step.

The same with the weights clamped after every step (`clamp`: a change
after a step, which rank 0 gives the shards before the next step's
pushes): the next step begins by asking whether the shards hold the
clamped weights, with shard 1 just restarted (from the checkpoint the
shards wrote once they held step 9's weights) and behind; the workers
replay step 9 to it before rank 0 gives it the weights, and every rank ends
every step on the undisturbed run's bits. (Before, the question failed:
the restarted shard had no model until a push joined it again.) And
OneBitAdam with rank 0's `state_dict()` after every step (`save`), the
first right after the kill: it brings shard 1 to step 10 too, and every
saved server error buffer is the undisturbed run's. In every variant the
ranks ask whether the shards hold their parameters right after the kill
too (`holds_shards_model()`, which catches the shard up the same way).

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


def worker_clips(out, what, kill):
    """`part`: Adam with clips of the first layer and of the whole every
    step (`what` "part"), or of the whole alone ("whole"), or no clip and
    the weights clamped after every step ("clamp"), or OneBitAdam with rank
    0's state_dict() after every step ("save"); shard 1 killed after step
    KILL_AFTER when `kill`, before the ranks ask whether the shards hold
    their parameters. Writes each step's parameters, as hex, to
    params-<rank>.json, and the server error buffers rank 0 saved to
    errors-0.json."""
    import json
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    rank = int(os.environ["MORSE_RANK"])
    if what == "save":  # its compression phase has server error buffers
        opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=5, block_elems=16,
                                     partition_elems=64)
    else:
        opt = morse.torch.Adam(model.parameters(), lr=0.01, block_elems=16, partition_elems=64)
    params, errors = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if what == "part":
            norm = float(torch.nn.utils.clip_grad_norm_(list(model[0].parameters()), 0.05))
            check(norm > 0.05, f"step {step}: the first layer's clip did not act ({norm})")
        if what in ("part", "whole"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        opt.step()
        if what == "clamp":
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.3, 0.3)
        if kill and rank == 0 and step == KILL_AFTER:
            pid = shard_pid(os.environ["MORSE_CONFIG"], 1)
            check(pid is not None, "shard 1's process not found")
            os.kill(pid, signal.SIGKILL)
            print(f"killed shard 1 (pid {pid}) after step {step}", flush=True)
        if what == "save" and rank == 0:
            # The shards' error buffers as rank 0's state_dict() saves them
            # (after the kill, from shard 1 brought back to this step first).
            errors.append(opt.state_dict()["state"]["server_error"].numpy().tobytes().hex())
        # (Also right after the kill, shard 1 back at an older step: the
        # ranks' replays bring it to this one first.)
        check(what == "clamp" or opt._holds_shards_model(), f"rank {rank} step {step}: the "
              "shards' mirrors differ from this rank's parameters")
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
                      .tobytes().hex())
    json.dump(params, open(f"{out}/params-{rank}.json", "w"))
    json.dump(errors, open(f"{out}/errors-{rank}.json", "w"))


def clips(one_line, what):
    """`part`, `clamp` or `save` (the module's docstring), or `whole` (a
    clip of the whole model alone): the restarted run's bits are the
    undisturbed run's. `one_line`: the config, its checkpoint.dir "D"."""
    import json
    runs, saved = {}, {}
    for kill in (True, False):
        out = tempfile.mkdtemp(prefix=f"morse-restart-{what}-{'kill' if kill else 'whole'}-")
        config = os.path.join(out, "base.textproto")
        os.makedirs(f"{out}/checkpoints")
        with open(config, "w") as f:  # each run its own checkpoints
            f.write(one_line.replace('"D"', f'"{out}/checkpoints"') + "\n")
        code, log = morse_run(__file__, 2, 2, out, f"{what}-kill" if kill else what, config=config)
        if code != 0:
            print(log[-4000:])
        check(code == 0, f"the {what} clip job {'with' if kill else 'without'} the kill failed")
        if kill:
            # (Weights changed after step 8: the shards wrote a checkpoint
            # of step 9 once they held them.)
            at = 9 if what == "clamp" else 8
            replayed = "killed shard 1" in log and f"restarted from its checkpoint at step {at}" in log
            if what in ("clamp", "save"):  # by the question, before the next step's pushes
                replayed = replayed and f"replaying steps {at}..9 before step 10" in log
            if not replayed:
                print("\n".join(line for line in log.splitlines()
                                if "completed" not in line and "checkpoint of" not in line))
            check(replayed, f"shard 1 was not killed and replayed from step {at}")
        runs[kill] = [json.load(open(f"{out}/params-{r}.json")) for r in range(2)]
        saved[kill] = json.load(open(f"{out}/errors-0.json"))
        subprocess.run(["rm", "-rf", out])
    check(runs[True][0] == runs[True][1], "the ranks differ")
    for step in range(STEPS):
        check(runs[True][0][step] == runs[False][0][step],
              f"step {step}: the restarted run's parameters differ from the undisturbed run's")
    check(saved[True] == saved[False], "rank 0's saved server error buffers differ from the "
          "undisturbed run's")
    if what == "save":
        check(len(saved[True]) == STEPS and any(e != saved[True][0] for e in saved[True]),
              "rank 0 saved no server error buffers that change")
        print(f"PASS: save: rank 0's state_dict() after every step, shard 1 killed after step "
              f"{KILL_AFTER} and brought to step 10 by the workers' replays for it: {STEPS} steps "
              "and every saved server error buffer on the undisturbed run's bits")
        return
    if what == "clamp":
        print(f"PASS: clamp: weights clamped after every step, shard 1 killed after step "
              f"{KILL_AFTER} and brought to step 10 by the workers' replays before rank 0 gave "
              f"the shards the clamped weights: {STEPS} steps on the undisturbed run's bits")
        return
    clipped = ("over the first layer and the whole every step" if what == "part" else
               "over the whole every step")
    print(f"PASS: {what}: clip_grad_norm_ {clipped}, shard 1 killed after step {KILL_AFTER} and "
          f"replayed from step 8 with the steps' clips: {STEPS} steps on the undisturbed run's "
          "bits, the mirrors the workers' after every step")


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
    check(done.returncode == 2 and "cannot run" in done.stderr and "no such program" in done.stderr
          and "Traceback" not in done.stderr, f"a COMMAND that does not exist: {done.stderr[-800:]}")
    check("[server" not in done.stdout, f"a shard started for a COMMAND that cannot run: {done.stdout}")
    subprocess.run(["rm", "-rf", tmp])
    print("PASS: morse-run removes its folder (keeps and names it when it holds the checkpoints); "
          "a missing --config is a clear error that stops the shards, a missing COMMAND one before "
          "any starts")


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
        elif sys.argv[-1].startswith(("part", "whole", "clamp", "save")):
            what, _, kill = sys.argv[-1].partition("-")
            worker_clips(sys.argv[-2], what, kill == "kill")
        else:
            worker(sys.argv[-1])
        sys.exit(0)
    one_line = 'checkpoint { every_steps: 4 dir: "D" } timeouts { recovery_seconds: 60 }  # every_steps: 1'
    check(_config_fields(one_line) == {"checkpoint": None, "checkpoint.every_steps": ["4"],
                                       "checkpoint.dir": ["D"], "timeouts": None,
                                       "timeouts.recovery_seconds": ["60"]},
          f"morse-run read {_config_fields(one_line)} from {one_line!r}")
    if sys.argv[1:] in (["clamp"], ["save"]):  # this part alone
        clips(one_line, sys.argv[1])
        sys.exit(0)
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
    clips(one_line, "whole")
    clips(one_line, "part")
    clips(one_line, "clamp")
    clips(one_line, "save")
    slow_to_stop()
    launcher_tidies()
