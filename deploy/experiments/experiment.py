#!/usr/bin/python3
"""Network-bandwidth experiments: Morse against the physical ceiling and the
peers on a virtual Ethernet cluster built inside this machine.

    sudo deploy/experiments/experiment.py --quick            # < 5 minutes
    sudo deploy/experiments/experiment.py --out out/experiments/full

Every host (server shard, worker) is a network namespace with a veth link to
a bridge in a switch namespace, shaped both ways with tc (tbf for the rate;
netem for --delay/--jitter/--loss), addressed from 198.18.0.0/15. Before the
runs at each link rate, morse-netprobe measures the raw TCP ceiling on the
same links. Each Morse scheme and each peer (PyTorch DDP over gloo: fp32,
fp16 hook, PowerSGD hook; DeepSpeed's 1-bit compressed all-reduce written on
gloo, onebit_peer.py) runs a few steps of the synthetic workload of D
parameters; results go to OUT/results.csv, OUT/*.png and OUT/report.md
(report.py). Everything the harness creates is removed on exit, failure and
Ctrl-C; every process is bounded in time. Needs root (ip netns, tc).
"""
import argparse
import csv
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import report  # noqa: E402

SCHEMES = {
    "fp32": 'optimizer: "adam"',
    "fp16": 'optimizer: "adam" up_codec { codec: "fp16" }',
    "bf16": 'optimizer: "adam" up_codec { codec: "bf16" }',
    "int8": 'optimizer: "adam" up_codec { codec: "int8" } worker_feedback { mode: "ef" }',
    "loco": 'optimizer: "adam" up_codec { codec: "int4" } worker_feedback { mode: "ema" beta: 0.5 }',
    "topk": 'optimizer: "adam" up_codec { codec: "topk" topk_ratio: 0.01 } worker_feedback { mode: "ef" }',
    "onebit_warmup": 'optimizer: "onebit_adam" freeze_step: {steps}',
    "onebit": 'optimizer: "onebit_adam" freeze_step: 1',
    # 0/1 Adam's local phase from the second step, the interval doubling
    # every step up to 4: per step, a quarter of onebit's exchanges.
    "zero_one": 'optimizer: "zero_one_adam" zero_one_adam { var_freeze_step: 1 local_step_scaler: 1 '
                'local_step_clipper: 4 }',
    # 1-bit LAMB after its first step, over layers of 2^20 elements
    # (LAYER_ELEMS): onebit's exchange plus each step's layer commit.
    "onebit_lamb": 'optimizer: "onebit_lamb" freeze_step: 1',
    # DiLoCo (design.md 2.11): 10 inner Adam steps per outer step, the
    # pseudo-gradient in int4 with error feedback. A morse-worker step is an
    # outer step; the report gives it per inner step (INNER_STEPS).
    "diloco": 'optimizer: "diloco" diloco { sync_every: 10 } up_codec { codec: "int4" } '
              'worker_feedback { mode: "ef" }',
    # Streaming DiLoCo: the same, in 2 fragments (half the partitions each),
    # one synced every 5 inner steps. D must give an even partition count.
    "diloco_streaming": 'optimizer: "diloco" diloco { sync_every: 10 fragments: 2 } '
                        'up_codec { codec: "int4" } worker_feedback { mode: "ef" }',
    # diloco with an overlap: each exchange runs during the next outer step's
    # first 2 inner steps, its reply mixed in (mixing 0.5) after them.
    "diloco_overlap": 'optimizer: "diloco" diloco { sync_every: 10 overlap_steps: 2 } '
                      'up_codec { codec: "int4" } worker_feedback { mode: "ef" }',
}
LAYER_ELEMS = {"onebit_lamb": 1 << 20}
INNER_STEPS = {"diloco": 10, "diloco_streaming": 5, "diloco_overlap": 10}
PEERS = {"ddp_fp32": "none", "ddp_fp16": "fp16", "ddp_powersgd": "powersgd",
         # DeepSpeed's 1-bit compressed all-reduce (onebit_peer.py), the
         # exchange users would otherwise pick for 1-bit Adam.
         "onebit_allreduce": None}
FIELDS = ["kind", "scheme", "inner_steps", "rate_gbit", "dim", "workers", "local_ranks", "shards", "steps_measured",
          "step_median_s", "step_p25_s", "step_p75_s", "comm_median_s", "comm_rank0_median_s",
          "comm_round_median_s", "payload_bytes_per_step",
          "wire_bytes_per_step", "rounds_per_step", "step_over_compute", "floor_s", "ceiling_up_gbps",
          "ceiling_down_gbps", "status"]


def sh(*args, check=True, timeout=30):
    return subprocess.run(args, check=check, timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


class VirtualCluster:
    """Hosts 0..n-1 as namespaces on one shaped bridge. A context manager:
    everything is deleted on exit, whatever happened."""

    def __init__(self, hosts, rate_gbit, delay_ms=0.0, jitter_ms=0.0, loss_pct=0.0, queue_ms=200.0):
        self.tag = f"mx{random.randrange(16 ** 4):04x}"
        self.hosts, self.rate, self.netem = hosts, rate_gbit, (delay_ms, jitter_ms, loss_pct)
        self.queue_ms = queue_ms
        self.switch = f"{self.tag}sw"
        self.created = []

    def ns(self, i):
        return f"{self.tag}h{i}"

    @staticmethod
    def address(i):
        return f"198.18.0.{i + 1}"

    def _shape(self, ns, dev):
        rate = f"{self.rate}gbit"
        burst = max(64 * 1024, int(self.rate * 1e9 / 8 / 250))  # 4 ms of data
        delay, jitter, loss = self.netem
        parent = ["root"]
        if delay or jitter or loss:
            netem = ["netem"]
            if delay or jitter:
                netem += ["delay", f"{delay}ms"] + ([f"{jitter}ms"] if jitter else [])
            if loss:
                netem += ["loss", f"{loss}%"]
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
            parent = ["parent", "1:"]
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "2:",
           "tbf", "rate", rate, "burst", str(burst), "latency", f"{self.queue_ms:g}ms")

    def __enter__(self):
        try:
            sh("ip", "netns", "add", self.switch)
            self.created.append(self.switch)
            sh("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
            sh("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns = self.ns(i)
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
                host_dev, switch_dev = f"{self.tag}a{i}", f"{self.tag}b{i}"
                sh("ip", "link", "add", host_dev, "netns", ns, "type", "veth", "peer", "name",
                   switch_dev, "netns", self.switch)
                sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/16", "dev", host_dev)
                sh("ip", "netns", "exec", ns, "ip", "link", "set", host_dev, "up")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                sh("ip", "netns", "exec", self.switch, "ip", "link", "set", switch_dev, "master", "br0")
                sh("ip", "netns", "exec", self.switch, "ip", "link", "set", switch_dev, "up")
                self._shape(ns, host_dev)             # host -> switch: upload
                self._shape(self.switch, switch_dev)  # switch -> host: download
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *unused):
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)  # deleting a namespace deletes its veths
        self.created = []

    def popen(self, i, argv, log):
        # gloo picks its interface from the hostname (127.0.0.1 here) unless told.
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), "env",
                                 f"GLOO_SOCKET_IFNAME={self.tag}a{i}", *argv], stdout=log,
                                stderr=subprocess.STDOUT)

    def tx_rx(self, i):
        dev = f"{self.tag}a{i}"
        out = sh("ip", "netns", "exec", self.ns(i), "cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                 f"/sys/class/net/{dev}/statistics/rx_bytes").stdout.split()
        return int(out[0]), int(out[1])


def wait_all(procs, timeout):
    """Exit codes of every process; the first failure, or the timeout, stops
    the rest (a worker waiting on a dead peer would otherwise sit out the
    server's step timeout)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.05)
    codes = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append("stopped")
        else:
            codes.append(p.returncode)
    return codes


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    wait_all(procs, 5)


def netprobe(vc, bin_dir, a, b, streams=2):
    log = tempfile.TemporaryFile()
    server = vc.popen(a, [f"{bin_dir}/deploy/experiments/morse-netprobe", "--listen",
                          f"{vc.address(a)}:5201"], log)
    try:
        time.sleep(0.3)
        out = sh("ip", "netns", "exec", vc.ns(b), f"{bin_dir}/deploy/experiments/morse-netprobe",
                 "--connect", f"{vc.address(a)}:5201", "--streams", str(streams), "--seconds", "3",
                 "--warmup", "1", "--both", timeout=30).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        stop([server])


def morse_run(vc, bin_dir, scheme, dim, workers, shards, steps, colocate, work, window=8,
              channels=2, compute_threads=0, trace=None, rate=None, partition_elems=262144,
              local_ranks=1, uploads_per_shard=None):
    """One Morse job; returns a result row (without the link fields). With
    `trace` (a folder) every daemon writes its step timeline there; with
    `local_ranks` L > 1 each worker is a node of L local ranks (one worker,
    the average of its L ranks' gradients; design.md 2.10)."""
    def traced(name):
        return (["--trace", os.path.join(trace, f"{scheme}-{rate}g-{dim}-{name}.json")]
                if trace else [])
    config = os.path.join(work, f"{scheme}-{dim}.textproto")
    with open(config, "w") as f:
        f.write(f"""name: "{scheme}" workers: {workers} shards: {shards} local_ranks: {local_ranks}
synthetic {{ dim: {dim} noise: 0.1{f" layer_elems: {LAYER_ELEMS[scheme]}" if scheme in LAYER_ELEMS else ""} }}
lr {{ lr: 0.0001 }}
steps: {steps}
{SCHEMES[scheme].replace('{steps}', str(steps))}
timeouts {{ connect_seconds: 30 step_seconds: 300 rpc_seconds: 600 }}
channels_per_shard: {channels}
window: {window}
{f"partition_elems: {partition_elems}" if partition_elems else ""}
{f"uploads_per_shard: {uploads_per_shard}" if uploads_per_shard is not None else ""}
log_every: 1000
""")
    server_host = lambda s: s
    worker_host = (lambda r: r % max(workers, shards)) if colocate else (lambda r: shards + r)
    servers, procs = [], []
    try:
        for s in range(shards):
            log = open(os.path.join(work, f"{scheme}-server{s}.log"), "w")
            servers.append(vc.popen(server_host(s), [f"{bin_dir}/server/morse-server", "--config", config,
                                                     "--shard", str(s), "--insecure", "--listen",
                                                     f"{vc.address(server_host(s))}:7000",
                                                     "--compute_threads", str(compute_threads)]
                                           + traced(f"server-{s}"), log))
        time.sleep(0.5)
        addresses = ",".join(f"{vc.address(server_host(s))}:7000" for s in range(shards))
        before = vc.tx_rx(worker_host(0))
        for r in range(workers):
            log = open(os.path.join(work, f"{scheme}-worker{r}.log"), "w")
            procs.append(vc.popen(worker_host(r), [f"{bin_dir}/worker/morse-worker", "--config", config,
                                                   "--rank", str(r), "--servers", addresses, "--insecure", "--metrics",
                                                   os.path.join(work, f"{scheme}-worker{r}.jsonl"),
                                                   "--compute_threads", str(compute_threads)]
                                         + traced(f"rank-{r}"), log))
        codes = wait_all(procs, 60 + steps * (dim * 4 * 8 / (vc.rate * 1e9) * 6
                                              + 5 * INNER_STEPS.get(scheme, 1) * local_ranks))
        after = vc.tx_rx(worker_host(0))
    finally:
        stop(procs + servers)
    if any(c != 0 for c in codes):
        tail = open(os.path.join(work, f"{scheme}-worker0.log")).read()[-300:].replace("\n", " ")
        return {"status": f"failed ({codes}): {tail}"}
    rows = [json.loads(l) for l in open(os.path.join(work, f"{scheme}-worker0.jsonl"))]
    measured = [r for r in rows if r["step"] >= 2 and
                (scheme not in ("onebit", "onebit_lamb") or r["phase"] == "compression")]
    if not measured:
        return {"status": "failed: no steps to measure (use --steps >= 4)"}
    if scheme == "zero_one":
        # Local steps send nothing: per step means the mean over the local
        # phase (its whole intervals), not the median step.
        measured = [r for r in rows if r["phase"] in ("local", "sync")]
        last_sync = max((i for i, r in enumerate(measured) if r["phase"] == "sync"), default=-1)
        first_sync = min((i for i, r in enumerate(measured) if r["phase"] == "sync"), default=-1)
        measured = measured[first_sync + 1:last_sync + 1]
        if not measured:
            return {"status": "failed: no whole interval to measure (use --steps >= 12)"}
    steps_s = sorted(r["step_seconds"] for r in measured)
    # Communication per step: the least any worker waited in it. The worker
    # whose gradient was ready last waits only for the exchange; the others
    # also wait for it, which is skew between the workers' compute (two
    # hosts sharing 2 cores here), not communication. Rank 0's own wait is
    # kept beside it.
    comm = least_wait(measured, [os.path.join(work, f"{scheme}-worker{w}.jsonl")
                                              for w in range(1, workers)])
    # Interface bytes over the whole run against every payload byte pushed in
    # it: the framing overhead, free of timing; per step it scales the
    # measured phase's payload. Rank 0 also uploaded the initial parameters
    # (4 bytes a parameter), which are not a step's payload.
    overhead = (after[0] - before[0] - 4 * dim) / sum(r["bytes_up"] for r in rows)
    q = statistics.quantiles(steps_s, n=4) if len(steps_s) > 1 else [steps_s[0]] * 3
    center = statistics.mean if scheme == "zero_one" else statistics.median
    # The steps that exchange alone (zero_one's syncs; every step of the
    # others): what one round costs, beside the mean over the interval,
    # whose local steps count their own update as waiting.
    rounds = [c for c, r in zip(comm, measured) if r["phase"] != "local"]
    # diloco: a row is an outer step of `inner` inner steps; per step means
    # per inner step, and the step is also set against the step without
    # communication: `inner` inner steps as long as those that ran alone
    # (inner_step_seconds; the last inner step shares the host with the
    # exchange, which stretches it where shards and workers share cores).
    inner = INNER_STEPS.get(scheme, 1)
    alone = [inner * r["inner_step_seconds"] if "inner_step_seconds" in r else r["compute_seconds"]
             for r in measured]
    return {"inner_steps": inner if scheme in INNER_STEPS else "",
            "steps_measured": len(measured), "step_median_s": center(steps_s) / inner,
            "step_p25_s": q[0] / inner, "step_p75_s": q[2] / inner,
            "comm_median_s": center(comm) / inner,
            "comm_rank0_median_s": center(r["comm_seconds"] for r in measured) / inner,
            "comm_round_median_s": statistics.median(rounds) if rounds else "",
            "payload_bytes_per_step": center(r["bytes_up"] for r in measured) / inner,
            "wire_bytes_per_step": overhead * center(r["bytes_up"] for r in measured) / inner,
            "rounds_per_step": sum(r["phase"] not in ("local",) for r in measured) / len(measured) / inner,
            "step_over_compute": sum(r["step_seconds"] for r in measured) / sum(alone),
            "status": "ok"}


def ddp_run(vc, peer, dim, workers, steps, work):
    procs = []
    log_path = os.path.join(work, f"{peer}-rank0.log")
    try:
        for r in range(workers):
            log = open(log_path if r == 0 else os.path.join(work, f"{peer}-rank{r}.log"), "w")
            script, hook = ("onebit_peer.py", []) if PEERS[peer] is None else \
                ("ddp_peer.py", ["--hook", PEERS[peer]])
            procs.append(vc.popen(r, ["/usr/bin/python3", os.path.join(HERE, script), "--rank",
                                      str(r), "--world", str(workers), "--master",
                                      f"{vc.address(0)}:29500", "--dim", str(dim), "--steps", str(steps)]
                                  + hook, log))
        codes = wait_all(procs, 120 + steps * (dim * 4 * 8 * 2 / (vc.rate * 1e9) * 6 + 5))
    finally:
        stop(procs)
    if any(c != 0 for c in codes):
        return {"status": f"failed ({codes}): " + open(log_path).read()[-300:].replace("\n", " ")}
    rows = [json.loads(l) for l in open(log_path) if l.startswith("{")]
    measured = sorted(r["step_seconds"] for r in rows if r["step"] >= 2)
    if not measured:
        return {"status": "failed: no steps measured"}
    q = statistics.quantiles(measured, n=4) if len(measured) > 1 else [measured[0]] * 3
    out = {"steps_measured": len(measured), "step_median_s": statistics.median(measured),
           "step_p25_s": q[0], "step_p75_s": q[2], "comm_median_s": statistics.median(measured),
           "status": "ok"}
    if "bytes_per_step" in rows[-1]:
        out["payload_bytes_per_step"] = rows[-1]["bytes_per_step"]
    if "comm_seconds" in rows[-1]:  # the 1-bit peer: time inside its collectives
        mine = [r for r in rows if r["step"] >= 2]
        out["comm_rank0_median_s"] = statistics.median(r["comm_seconds"] for r in mine)
        # As for Morse: per step the least any rank waited in the collectives.
        out["comm_median_s"] = statistics.median(least_wait(mine, [
            os.path.join(work, f"{peer}-rank{r}.log") for r in range(1, workers)]))
    return out


def least_wait(rows, other_logs):
    """Per step of `rows` (rank 0's JSON lines), the least comm_seconds of
    any rank in that step; the other ranks' lines come from other_logs."""
    least = {r["step"]: r["comm_seconds"] for r in rows}
    for path in other_logs:
        for line in open(path):
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("step") in least and "comm_seconds" in r:
                    least[r["step"]] = min(least[r["step"]], r["comm_seconds"])
    return [least[r["step"]] for r in rows]


def floor_seconds(payload, workers, shards, rate_gbit):
    # DESIGN 7: max(P, N*P/S) bytes through one host link each way.
    return max(payload, workers * payload / shards) / (rate_gbit * 1e9 / 8)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="2 hosts, D=1M, 4 steps, 1 Gbit/s, fp32 and onebit, ddp_fp32 (< 5 min)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "experiments", "latest"))
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2.5, 10], help="Gbit/s")
    p.add_argument("--dims", type=int, nargs="+", default=[1_000_000, 25_000_000])
    p.add_argument("--workers", type=int, nargs="+", default=[2], help="N values to sweep")
    p.add_argument("--shards", type=int, nargs="+", default=[2], help="S values to sweep")
    p.add_argument("--local-ranks", type=int, nargs="+", default=[1], metavar="L",
                   help="L values to sweep (default 1): each Morse worker a node of L local ranks "
                        "(local_ranks in the job config: one push per node, its ranks' average); "
                        "the peers run N x L ranks, a host each")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--colocate", action="store_true", help="servers share hosts with workers")
    p.add_argument("--window", type=int, default=64, help="partitions each worker keeps in flight")
    p.add_argument("--channels", type=int, default=4, help="TCP connections per worker and shard")
    p.add_argument("--uploads-per-shard", type=int, metavar="U",
                   help="pushes a worker uploads to one shard at once (JobConfig uploads_per_shard; "
                        "default: the job's, 1; 0: the whole window at once)")
    p.add_argument("--partition-elems", type=int, default=262144,
                   help="elements per partition (default 262144; a positive multiple of the block size, "
                        "2048; 0: the job's own default, chosen from the model's size)")
    p.add_argument("--compute-threads", type=int, default=0,
                   help="every daemon's --compute_threads (0: one per core, the daemons' default)")
    p.add_argument("--delay", type=float, default=0.0, help="netem delay per link, ms")
    p.add_argument("--jitter", type=float, default=0.0, help="netem jitter, ms")
    p.add_argument("--loss", type=float, default=0.0, help="netem loss, percent")
    p.add_argument("--queue-ms", type=float, default=200.0,
                   help="the shaped link's FIFO in ms of data at its rate (tbf latency; default "
                        "200, a deep buffer; a switch port's is a few ms)")
    p.add_argument("--trace", metavar="DIR",
                   help="every Morse daemon writes its step timeline (--trace) to DIR, one file per "
                        "scheme, rate, D and daemon: tests/bench/trace_summary.py DIR/SCHEME-*.json "
                        "says where each step's time goes")
    p.add_argument("--sync-every", type=int, metavar="H",
                   help="the diloco schemes' sync_every (default 10): inner steps per outer step")
    p.add_argument("--build", default=os.environ.get("MORSE_BUILD_DIR", os.path.join(ROOT, "build")))
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("experiment.py: needs root for ip netns and tc; run it with sudo")
    if not a.queue_ms > 0:
        p.error("--queue-ms must be positive")
    if min(a.local_ranks) < 1:
        p.error("--local-ranks must be at least 1")
    if a.partition_elems < 0 or a.partition_elems % 2048:
        p.error("--partition-elems must be 0 (the job's default) or a positive multiple of 2048 "
                "(block_elems)")
    if a.sync_every is not None:
        for name in INNER_STEPS:
            fragments = 2 if name == "diloco_streaming" else 1
            least = 3 if name == "diloco_overlap" else fragments  # it overlaps 2 inner steps
            if name in a.schemes and (a.sync_every < least or a.sync_every % fragments):
                p.error(f"--sync-every {a.sync_every}: {name} needs at least {least} and a "
                        f"multiple of its {fragments} fragment(s)")
            SCHEMES[name] = SCHEMES[name].replace("sync_every: 10", f"sync_every: {a.sync_every}")
            INNER_STEPS[name] = a.sync_every // fragments
    if a.quick:
        a.rates, a.dims, a.workers, a.shards, a.steps = [1], [1_000_000], [1], [1], 4
        a.schemes, a.peers = ["fp32", "onebit"], ["ddp_fp32"]
    os.makedirs(a.out, exist_ok=True)
    if a.trace:
        a.trace = os.path.abspath(a.trace)
        os.makedirs(a.trace, exist_ok=True)
    work = tempfile.mkdtemp(prefix="morse-exp-")
    signal.signal(signal.SIGTERM, lambda *x: sys.exit(143))  # unwinds through the cluster's __exit__
    ranks = max(a.workers) * max(a.local_ranks)  # the peers' ranks, a host each
    hosts = max(ranks, max(a.shards)) if a.colocate else max(ranks, max(a.workers)) + max(a.shards)
    hosts = max(hosts, 2)
    rows = []
    started = time.time()
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for rate in a.rates:
            with VirtualCluster(hosts, rate, a.delay, a.jitter, a.loss, a.queue_ms) as vc:
                probe = netprobe(vc, a.build, 0, 1)
                print(f"== {rate} Gbit/s: netprobe {probe['up_gbps']:.3f} up, {probe['down_gbps']:.3f} down",
                      flush=True)
                shapes = [(dim, n, s, l) for dim in a.dims for n in a.workers for s in a.shards
                          for l in a.local_ranks]
                for dim, workers, shards, local in shapes:
                    runs = [("morse", s) for s in a.schemes]
                    if shards == a.shards[0]:  # peers have no servers: once per (D, N)
                        runs += [("peer", s) for s in a.peers]
                    for kind, scheme in runs:
                        row = {"kind": kind, "scheme": scheme, "rate_gbit": rate, "dim": dim,
                               "workers": workers, "local_ranks": local, "shards": shards,
                               "ceiling_up_gbps": probe["up_gbps"], "ceiling_down_gbps": probe["down_gbps"]}
                        try:
                            if kind == "morse":
                                row.update(morse_run(vc, a.build, scheme, dim, workers, shards, a.steps,
                                                     a.colocate, work, a.window, a.channels,
                                                     a.compute_threads, a.trace, rate,
                                                     a.partition_elems, local, a.uploads_per_shard))
                            else:
                                # A rank per host: a node's L ranks are L peers.
                                row["workers"], row["local_ranks"] = max(2, workers * local), 1
                                row.update(ddp_run(vc, scheme, dim, row["workers"], a.steps, work))
                        except Exception as e:  # a failed run is reported, never dropped
                            row["status"] = f"failed: {e}"
                        payload = row.get("payload_bytes_per_step") or (4 * dim if kind == "peer" else 0)
                        if kind == "peer" and not row.get("payload_bytes_per_step"):
                            row["payload_bytes_per_step"] = 2 * 4 * dim if scheme == "ddp_fp32" else ""
                        row["floor_s"] = floor_seconds(payload, workers, shards, rate) if kind == "morse" and payload else ""
                        writer.writerow({k: row.get(k, "") for k in FIELDS})
                        f.flush()
                        rows.append(row)
                        print(f"   D={dim:>11,} N={row['workers']}{f'x{local}' if kind == 'morse' and local > 1 else ''} S={shards} {scheme:<14} {row.get('status', '')[:60]:<12} "
                              f"step {row.get('step_median_s', float('nan')):.4f} s", flush=True)
    report.write(os.path.join(a.out, "results.csv"), a.out, {
        "command": " ".join(["deploy/experiments/experiment.py"] + sys.argv[1:]),
        "seconds": round(time.time() - started), "netem": [a.delay, a.jitter, a.loss],
        "colocate": a.colocate, "window": a.window, "partition_elems": a.partition_elems,
        "uploads_per_shard": a.uploads_per_shard, "queue_ms": a.queue_ms})
    print(f"results: {a.out}/results.csv, report: {a.out}/report.md ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
