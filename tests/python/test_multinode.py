"""A job across nodes, launched the way torchrun users launch one, on this
machine:

1. `morse-run --nnodes 2 --node-rank i --nproc-per-node 2 --rdzv ... --servers 2`
   run as two separate invocations make one 4-rank job: RANK 0-3,
   WORLD_SIZE 4, LOCAL_RANK and LOCAL_WORLD_SIZE 2, GROUP_RANK the node;
   OneBitAdam through the freeze is bit-identical on every rank and to the
   simulator with N = 4 after every step; both invocations exit 0.
2. Bad topology fails fast on every node with a clear error: nodes that
   disagree on --nproc-per-node, a node that never comes (--rdzv-timeout),
   no node 0 at all.
3. A rank that fails on node 1 stops node 0 too (the other ranks would sleep
   900 s; the nodes must end within 300), and both exit with its code, node 0
   naming the rank and its error.
4. torchrun's environment as it is: `torch.distributed.run --standalone
   --nproc_per_node 2` with MORSE_SERVERS set (no MORSE_RANK or
   MORSE_WORLD_SIZE) trains against shards started apart, every rank
   bit-identical to the simulator.
5. `morse-run --servers HOST:PORT` uses shards that are already running.
6. deploy/slurm/morse.sbatch, with stand-ins for srun and scontrol that run
   its per-node command once per node here: 2 nodes x 2 ranks over TLS
   (--tls-dir from deploy/make-certs.sh), bit-identical to the simulator."""
import os
import re
import stat
import subprocess
import sys
import tempfile
import time

import torch

from harness import check, check_ranks_match_simulator, free_port, server, train_recorded  # noqa: E402
from harness import nodes as harness_nodes  # noqa: E402

STEPS = 8
RUN = os.environ.get("MORSE_RUN")


def worker(out, mode):
    if mode == "env":
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MORSE_RANK",
                 "MORSE_WORLD_SIZE", "MORSE_NODE_RANK", "MORSE_NNODES")
        print("ENV " + " ".join(f"{k}={os.environ.get(k)}" for k in names))
        # MASTER_ADDR/MASTER_PORT: one gloo process group across the nodes.
        import torch.distributed as dist
        dist.init_process_group("gloo")
        total = torch.tensor([float(os.environ["RANK"])])
        dist.all_reduce(total)
        print(f"GLOO SUM {int(total.item())} MASTER {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        dist.destroy_process_group()
    if mode == "fail":
        if os.environ["RANK"] == "3":
            time.sleep(1)
            print("MorseError: rank 3 stops on purpose")
            sys.exit(7)
        time.sleep(900)  # stopped by morse-run: nodes() waits 300 s at most
        return
    import morse.torch
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=3, block_elems=16,
                                 partition_elems=64)
    # morse.torch found its rank in RANK under torchrun; train_recorded
    # reads MORSE_RANK.
    os.environ.setdefault("MORSE_RANK", os.environ["RANK"])
    train_recorded(opt, model, out, STEPS, features=10, classes=4)


def nodes(nnodes, nproc, out, mode, **kwargs):
    return harness_nodes(__file__, nnodes, nproc, out, mode, **kwargs)


def env_of(text):
    ranks = {}
    for line in text.splitlines():
        if "ENV " in line:
            fields = dict(kv.split("=") for kv in line.split("ENV ", 1)[1].split())
            ranks[int(fields["RANK"])] = fields
    return ranks


def two_nodes_are_one_job():
    out = tempfile.mkdtemp(prefix="morse-multinode-")
    results = nodes(2, 2, out, "env", extra=("--servers", "2"))
    for node, (code, text) in enumerate(results):
        print(text)
        check(code == 0, f"node {node} exited with {code}")
    ranks = {**env_of(results[0][1]), **env_of(results[1][1])}
    check(sorted(ranks) == [0, 1, 2, 3], f"ranks {sorted(ranks)}, not 0-3")
    for r, fields in ranks.items():
        expected = {"WORLD_SIZE": "4", "MORSE_WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                    "LOCAL_RANK": str(r % 2), "GROUP_RANK": str(r // 2), "MORSE_NODE_RANK": str(r // 2),
                    "MORSE_RANK": str(r), "MORSE_NNODES": "2"}
        for key, value in expected.items():
            check(fields[key] == value, f"rank {r}: {key}={fields[key]}, not {value}")
    check("[server 0]" in results[0][1] and "[server" not in results[1][1],
          "node 0 starts the shards, node 1 none")
    masters = set(re.findall(r"GLOO SUM 6 MASTER (\S+)", results[0][1] + results[1][1]))
    check(len(re.findall(r"GLOO SUM 6 MASTER", results[0][1] + results[1][1])) == 4 and len(masters) == 1,
          f"the 4 ranks form one gloo group through MASTER_ADDR/MASTER_PORT ({masters})")
    check_ranks_match_simulator(out, 4, STEPS)
    print(f"PASS: 2 nodes x 2 ranks: torchrun's variables, {STEPS} OneBitAdam steps bit-identical "
          "to the simulator with N = 4")


def bad_topology():
    start = time.time()
    results = nodes(2, 2, "-", "env", per_node=[2, 3], timeout=60)
    for node, (code, text) in enumerate(results):
        print(text)
        check(code != 0, f"node {node} ran with a topology its peer disagrees with")
        check("--nproc-per-node 3, node 0 2: every node must give the same" in text,
              f"node {node} does not say what disagrees")
    # A node that never comes: node 0 gives up at --rdzv-timeout.
    port = free_port()
    alone = subprocess.run([RUN, "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                            "--rdzv", f"127.0.0.1:{port}", "--rdzv-timeout", "3", "--",
                            sys.executable, __file__, "--worker", "-", "env"],
                           capture_output=True, text=True, timeout=60)
    print(alone.stderr)
    check(alone.returncode != 0 and "node 1 of 2 did not join" in alone.stderr,
          "node 0 alone does not fail with a clear error at the timeout")
    orphan = subprocess.run([RUN, "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
                             "--rdzv", f"127.0.0.1:{port}", "--rdzv-timeout", "3", "--",
                             sys.executable, __file__, "--worker", "-", "env"],
                            capture_output=True, text=True, timeout=60)
    print(orphan.stderr)
    check(orphan.returncode != 0 and "no rendezvous at" in orphan.stderr,
          "node 1 without node 0 does not fail with a clear error")
    print(f"PASS: bad topology fails on every node with a clear error ({time.time() - start:.1f} s)")


def rank_failure_stops_every_node():
    results = nodes(2, 2, "-", "fail", extra=("--servers", "1"), timeout=300)
    for node, (code, text) in enumerate(results):
        print(text)
        check(code == 7, f"node {node} exited with {code}, not the failed rank's 7")
    check("node 1 ended with 7: rank 3 exited with 7: MorseError: rank 3 stops on purpose" in results[0][1],
          "node 0 does not name the failed rank and its error")
    print("PASS: a rank failing on node 1 stops both nodes with its exit code")


def torchrun(command, env):
    """Runs 2 copies of command as `torchrun --standalone --nproc_per_node 2`
    does. torch 1.13's torchrun fails on Python 3.11 before it starts
    anything (AttributeError in elastic's to_map: Std.from_str returns None),
    so with torch < 2 the copies get the variables torchrun sets, by hand."""
    if int(torch.__version__.split(".")[0]) >= 2:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", "2", *command[1:]], env=env, capture_output=True,
                                text=True, timeout=240)
        return result.returncode, result.stdout + result.stderr
    procs = []
    for r in range(2):
        own = dict(env, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0", ROLE_RANK=str(r),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ROLE_WORLD_SIZE="2", ROLE_NAME="default",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCHELASTIC_RUN_ID="none",
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
        procs.append(subprocess.Popen(command, env=own, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    return max(p.returncode for p in procs), "".join(outputs)


def torchrun_environment():
    config = tempfile.NamedTemporaryFile("w", suffix=".textproto", delete=False)
    config.write("workers: 2\nshards: 1\nexternal {}\n")
    config.close()
    for launcher in ("torchrun", "morse-run"):
        out = tempfile.mkdtemp(prefix="morse-torchrun-")
        with server(config.name) as address:
            worker = [sys.executable, __file__, "--worker", out, "train"]
            if launcher == "torchrun":
                env = {k: v for k, v in os.environ.items() if not k.startswith("MORSE_") or k == "MORSE_BIN_DIR"}
                env.update(MORSE_SERVERS=address, MORSE_INSECURE="1", MORSE_CONFIG=config.name)
                code, stdout = torchrun(worker, env)
            else:
                result = subprocess.run([RUN, "--servers", address, "--insecure", "--workers", "2",
                                         "--config", config.name, "--", *worker],
                                        capture_output=True, text=True, timeout=240)
                code, stdout = result.returncode, result.stdout + result.stderr
        print(stdout[-3000:])
        check(code == 0, f"{launcher} against running shards failed")
        if launcher == "morse-run":
            check("[server" not in result.stdout, "morse-run started shards of its own")
        check_ranks_match_simulator(out, 2, STEPS)
        how = "" if launcher != "torchrun" or torch.__version__ >= "2" else " (torch 1.13: its variables by hand)"
        print(f"PASS: {launcher}{how} against shards started apart: 2 ranks bit-identical to the simulator")
    os.remove(config.name)


SRUN = """#!/usr/bin/env bash
# srun for this test: runs the command once per node, SLURM_NODEID set.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def slurm_script():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    work = tempfile.mkdtemp(prefix="morse-slurm-")
    subprocess.run([os.path.join(root, "deploy", "make-certs.sh"), f"{work}/creds"], check=True,
                   stdout=subprocess.DEVNULL)
    os.makedirs(f"{work}/bin")
    for tool, text in (("srun", SRUN), ("scontrol", "#!/bin/sh\nprintf '127.0.0.1\\nnode-b\\n'\n")):
        with open(f"{work}/bin/{tool}", "w") as f:
            f.write(text)
        os.chmod(f"{work}/bin/{tool}", stat.S_IRWXU)
    out = tempfile.mkdtemp(prefix="morse-slurm-out-")
    env = dict(os.environ, PATH=f"{work}/bin:" + os.environ["PATH"], SLURM_JOB_NODELIST="127.0.0.1,node-b",
               SLURM_NNODES="2", GPUS_PER_NODE="2", MORSE_SHARDS="1", MORSE_CREDS=f"{work}/creds",
               RDZV_PORT=str(free_port()))
    result = subprocess.run(["bash", os.path.join(root, "deploy", "slurm", "morse.sbatch"), sys.executable,
                             __file__, "--worker", out, "train"],
                            env=env, capture_output=True, text=True, timeout=240)
    print(result.stdout[-3000:], result.stderr[-3000:])
    check(result.returncode == 0, "the sbatch script's job failed")
    check("TLS with client certificates" in result.stdout, "the shards did not run with TLS")
    check_ranks_match_simulator(out, 4, STEPS)
    subprocess.run(["rm", "-rf", work])
    print("PASS: deploy/slurm/morse.sbatch: 2 nodes x 2 ranks over TLS, bit-identical to the simulator")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-2], sys.argv[-1])
        sys.exit(0)
    if not RUN:
        print("FAIL: MORSE_RUN is not set (ctest sets it)")
        sys.exit(1)
    two_nodes_are_one_job()
    bad_topology()
    rank_failure_stops_every_node()
    torchrun_environment()
    slurm_script()
