"""Shard loss under morse.torch is a pause: morse-run starts 2 shards for a
job that checkpoints every 4 steps; rank 0 kills shard 1 with SIGKILL after
step 9 and morse-run restarts it on its address from its checkpoint (step 8).
The restarted shard has no model until a worker joins again (an external
job), so the workers Join it again, replay their retained pushes of the steps
it lost, check that it recomputes the replies they applied, and go on. After
every step every rank holds the same bits as the undisturbed simulator."""
import os
import signal
import sys
import tempfile

import torch

from harness import (check, check_ranks_match_simulator, morse_run, shard_pid,  # noqa: E402
                     train_recorded)

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


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    out = tempfile.mkdtemp(prefix="morse-restart-")
    config = os.path.join(out, "base.textproto")
    with open(config, "w") as f:
        f.write("checkpoint { every_steps: 4 }\ntimeouts { recovery_seconds: 60 }\n")
    code, log = morse_run(__file__, 2, 2, out, config=config)
    print(log)
    os.remove(config)
    check(code == 0, "the job failed")
    check("killed shard 1" in log, "the shard was not killed")
    check("restarting it on" in log, "morse-run did not restart the shard")
    check("restarted from its checkpoint at step 8" in log, "the workers did not replay from step 8")
    check_ranks_match_simulator(out, 2, STEPS)
    print(f"PASS: shard 1 killed after step {KILL_AFTER} and restarted; {STEPS} steps, both ranks "
          "bit-identical to each other and to the simulator")
