"""morse-run across hosts, each node in a network stack of its own: two
network namespaces on a virtual link (deploy/experiments/experiment.py's
VirtualCluster, addresses from 198.18.0.0/15, removed on exit) stand for
two machines, which loopback cannot: an address that works only on the
host that gave it fails here as on a real cluster.

The same command on both, as docs/python.md ("Across several machines")
gives it: `morse-run --nnodes 2 --node-rank i --nproc-per-node 2 --rdzv
198.18.0.1:PORT --servers 2 --insecure`. Node 0 starts the two shards on
its address and hands them out; the four ranks form one gloo process group
through MASTER_ADDR (as Trainer, Accelerate and DDP scripts do) with no
GLOO_SOCKET_IFNAME given (this host's name maps to 127.0.0.1, which gloo
would hand the other node: morse-run names the interface of each node's
address on the rendezvous), and train OneBitAdam through its freeze, bit-identical
to the simulator with N = 4 after every step. Then the same by name
over TLS (`--rdzv node-a:PORT`, deploy/make-certs.sh's credentials for
node-a) with --node-aggregation=sharded, where each host has its own
/etc/hosts as Debian writes it (its own name at 127.0.1.1, the other's at
its address): node 0 listens on every interface where its name is
loopback, starts each slice's shards, and the ranks that step the same
slice on the two hosts hold the same bits after every step.

`test_multihost.py trainer`: Hugging Face Trainer across the two hosts
(worker/python/examples/hf_trainer.py, OneBitAdam, one rank a host, by
name), which starts its own gloo group: both ranks end with the same
parameters and the loss falls. Runs on the torch 2.x venv
($MORSE_TORCH2_PYTHON).

Needs root (ip netns, tc); skipped (exit 77, which ctest shows as skipped)
otherwise."""
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BUILD = os.environ.get("MORSE_BUILD_DIR", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(ROOT, "deploy", "experiments"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(BUILD, "python"))
SCRIPT = os.path.join(ROOT, "tests", "python", "test_multinode.py")  # its worker: env, then 8 steps


def run_nodes(vc, out, flags=("--insecure",), rdzv="198.18.0.1", nproc=2, command=None):
    """Node 1 first (as happens on clusters), then node 0, each with
    `flags`, --rdzv RDZV:29400 and `nproc` ranks of `command` (default
    test_multinode.py's worker); [(code, output)]."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(BUILD, "python"), os.path.join(ROOT, "tests", "python")]),
               MORSE_RUN=os.path.join(BUILD, "bin", "morse-run"), PYTHONFAULTHANDLER="1")
    procs = []
    for node in (1, 0):
        argv = ["ip", "netns", "exec", vc.ns(node), os.path.join(BUILD, "bin", "morse-run"),
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc),
                "--rdzv", f"{rdzv}:29400", "--rdzv-timeout", "60", "--servers", "2", *flags,
                "--", *(command(node) if command else ["/usr/bin/python3", SCRIPT, "--worker", out, "env"])]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env))
        time.sleep(0.3)
    results = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n(killed: no end within 240 s)"
        results.append((p.returncode, text))
    return list(reversed(results))


@contextlib.contextmanager
def debian_hosts(vc):
    """Each host's /etc/hosts (ip netns exec mounts /etc/netns/NS/hosts
    over it) as Debian writes it: its own name at 127.0.1.1, the other's
    at its address. node-a is host 0, node-b host 1."""
    folders = []
    try:
        for i, (me, other) in enumerate((("node-a", "node-b"), ("node-b", "node-a"))):
            folder = f"/etc/netns/{vc.ns(i)}"
            os.makedirs(folder)
            folders.append(folder)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {me}\n{vc.address(1 - i)} {other}\n")
        yield
    finally:
        for folder in folders:
            shutil.rmtree(folder)


def trainer():
    from experiment import VirtualCluster  # noqa: E402
    from harness import check  # noqa: E402
    python = os.environ.get("MORSE_TORCH2_PYTHON", os.path.join(BUILD, "venv-torch2", "bin", "python"))
    if not os.access(python, os.X_OK):
        print(f"SKIPPED: no torch 2.x venv at {python} (see python_torch2_venv)")
        sys.exit(77)
    out = tempfile.mkdtemp(prefix="morse-multihost-trainer-")
    example = os.path.join(ROOT, "worker", "python", "examples", "hf_trainer.py")
    with VirtualCluster(2, 10) as vc, debian_hosts(vc):
        results = run_nodes(vc, out, rdzv="node-a", nproc=1, command=lambda node: [
            python, example, "--steps", "20", "--output-dir", os.path.join(out, f"node{node}"),
            "--losses", os.path.join(out, "losses.json")])
    for node, (code, text) in enumerate(results):
        print(f"----- node {node} -----\n{text}")
        check(code == 0, f"node {node} exited with {code}")
    sums = [re.findall(r"rank \d: parameters checksum (\w+)", text) for _, text in results]
    check(len(sums[0]) == 1 and sums[0] == sums[1], f"the two hosts' parameters differ: {sums}")
    losses = json.load(open(os.path.join(out, "losses.json")))
    first, last = losses[min(losses, key=int)], losses[max(losses, key=int)]
    check(len(losses) == 20 and last < 0.8 * first, f"Trainer's loss did not fall: {losses}")
    shutil.rmtree(out)
    print(f"PASS: Hugging Face Trainer on 2 hosts by name (Debian's /etc/hosts): the same parameters on "
          f"both, loss {first:.3f} -> {last:.3f} in 20 OneBitAdam steps")


if __name__ == "__main__":
    if os.geteuid() != 0:
        print("SKIPPED: two hosts in network namespaces need root for ip netns and tc")
        sys.exit(77)
    if sys.argv[1:] == ["trainer"]:
        trainer()
        sys.exit(0)
    from experiment import VirtualCluster  # noqa: E402
    from harness import check, check_ranks_match_simulator  # noqa: E402
    out = tempfile.mkdtemp(prefix="morse-multihost-")
    start = time.time()
    sharded_out = tempfile.mkdtemp(prefix="morse-multihost-sharded-")
    creds = os.path.join(tempfile.mkdtemp(prefix="morse-multihost-creds-"), "creds")
    subprocess.run([os.path.join(ROOT, "deploy", "make-certs.sh"), creds, "node-a"], check=True,
                   stdout=subprocess.DEVNULL)
    with VirtualCluster(2, 10) as vc:
        results = run_nodes(vc, out)
        with debian_hosts(vc):
            sharded = run_nodes(vc, sharded_out, ("--tls-dir", creds, "--node-aggregation=sharded"),
                                rdzv="node-a")
        tags = [f"{vc.tag}a0", f"{vc.tag}a1"]
    for node, (code, text) in enumerate(results):
        print(f"----- node {node} -----\n{text}")
    for node, (code, text) in enumerate(results):
        check(code == 0, f"node {node} exited with {code}")
        check(f"GLOO_SOCKET_IFNAME={tags[node]} (the interface of 198.18.0.{node + 1}" in text,
              f"node {node} does not name the interface of its address on the rendezvous")
    both = results[0][1] + results[1][1]
    check("[server 0]" in results[0][1] and "[server" not in results[1][1],
          "node 0 starts the shards, node 1 none")
    check(len(re.findall(r"GLOO SUM 6 MASTER 198\.18\.0\.1:", both)) == 4,
          "the 4 ranks on 2 hosts do not form one gloo group through MASTER_ADDR")
    check_ranks_match_simulator(out, 4, 8)
    for node, (code, text) in enumerate(sharded):
        print(f"----- node {node}, TLS, --node-aggregation=sharded -----\n{text}")
        check(code == 0, f"node {node} exited with {code} (TLS, sharded)")
    check("node-a is a loopback address on this host (/etc/hosts): the rendezvous and the shards "
          "listen on every interface" in sharded[0][1], "node 0 does not say it listens on every interface")
    for k in range(2):
        check(len(re.findall(rf"\[slice {k} server \d\] morse-server shard \d: stopped after 8 steps",
                             sharded[0][1])) == 2 and "[slice" not in sharded[1][1],
              f"node 0 does not run slice {k}'s two shards through 8 steps")
        on_hosts = [json.load(open(f"{sharded_out}/checksums-{k + 2 * node}.json")) for node in range(2)]
        check(len(on_hosts[0]) == 8 and on_hosts[0] == on_hosts[1],
              f"slice {k}: the owners on the two hosts differ: {on_hosts}")
    leftover = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    check(vc.tag not in leftover, f"namespaces left behind: {leftover}")
    print(f"PASS: 2 hosts x 2 ranks (separate network stacks): node 0's shards on 198.18.0.1, one gloo "
          f"group across the hosts, 8 OneBitAdam steps bit-identical to the simulator with N = 4"
          f"; by name (node 0's own name at 127.0.1.1) over TLS with --node-aggregation=sharded each "
          f"slice's owners on the two hosts identical "
          f"({time.time() - start:.1f} s)")
