"""morse-run: start a Morse job's servers and N copies of a training script.

    morse-run --servers S --workers N [--config F] -- python3 train.py [args...]
    morse-run --stages K --servers S --workers N -- python3 train.py [args...]
    morse-run --nnodes M --node-rank i --nproc-per-node L --rdzv HOST:PORT \
              --servers S -- python3 train.py [args...]      (on every node)

Starts S morse-server shards on free loopback ports and N copies of the
command with MORSE_RANK, MORSE_WORLD_SIZE, MORSE_SERVERS and MORSE_CONFIG in
their environment (morse.torch's optimizers read them), with torchrun's
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(for scripts, samplers and stacks that start a gloo group). Output is streamed
with [rank i] / [server s] prefixes. Ctrl-C, or any copy exiting non-zero,
stops everything; the exit code is then non-zero (the failing copy's, or 130).
With --rank-restarts R (and checkpoints), a copy that fails or is killed is
started again alone with MORSE_REJOIN=1, up to R times in all: it rejoins
from its last checkpoint while the others wait.
A server that dies is restarted on its address from its last checkpoint when
the job checkpoints (checkpoint { every_steps: N } in --config; the workers
wait for it and replay what it lost), up to --restarts times; otherwise it
ends the job.
--config is a base JobConfig (timeouts, checkpoints, layout...); the
optimizer's arguments are merged over it, and workers/shards/the model come
from the flags and the script.

With --stages K (pipeline parallelism, morse.torch.pipeline), the job is K
stages of N data-parallel replicas each: every stage gets its own S shards
(its parameters are its own Morse job) and N copies of the command, with
MORSE_STAGE, MORSE_STAGES, MORSE_STAGE_LISTEN (where stage s > 0 listens for
replica r of stage s - 1) and MORSE_STAGE_NEXT (where replica r of stage s
connects to stage s + 1) in their environment; output lines are prefixed
[stage s rank r]. Checkpoints go to a folder per stage (stage-<s>/).

With --node-aggregation each node is one Morse worker (the shards see
--nnodes workers): its ranks average their gradients over gloo and local
rank 0 steps for the node; with --node-aggregation=sharded the parameters
are cut into --nproc-per-node slices, each its own job with its own S
shards (output [slice k server s]; checkpoints in slice-<k>/), and local
rank k steps slice k and holds its optimizer state alone.

Across nodes, the same command runs on every node with its own --node-rank
(torchrun's flags). Node 0 listens on --rdzv HOST:PORT (HOST: its address as
the others reach it; every interface where HOST is a name this host gives
loopback alone) until all M nodes have joined and agree on M, L,
--servers and --config, then starts the S shards on HOST and hands every node
their addresses and the config; node i runs ranks i*L .. i*L+L-1 (RANK,
LOCAL_RANK, WORLD_SIZE = M*L, LOCAL_WORLD_SIZE = L, GROUP_RANK = i). A
rank that fails, or a node that drops out, stops the job on every node.
Off loopback the shards need --tls-dir (deploy/make-certs.sh) or --insecure.
--servers HOST:PORT,... uses shards that are already running instead.
"""
import socket
import argparse
import errno
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

from morse import rendezvous as _rendezvous


def _stream(pipe, prefix, sink, marker=None, errors=None, lines=None):
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace")
        if lines is not None:
            lines.append(line.rstrip())
            del lines[:-20]
        if errors is not None and ("Error" in line or "error:" in line):
            errors.append(line.rstrip())  # the rank's errors, for the summary at a failure
        if marker is not None and "listening on" in line:
            marker["address"] = line.rsplit("listening on", 1)[1].strip()
            marker["event"].set()
        sink.write(f"{prefix}{line}")
        sink.flush()
    if marker is not None:
        marker["event"].set()


_TEXT_TOKEN = re.compile(r"""\s+|\#[^\n]*|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s{}<>\[\]:;,"'\#]+|.""")


def _config_fields(text):
    """What morse-run reads of a JobConfig in text format: {path: [values]}
    for the scalar fields it sets ("workers", "checkpoint.dir"; strings
    unquoted), and {path: None} for the messages it opens ("external").
    Comments, one-line messages and either quote are read as protobuf
    reads them; the shards parse the whole and report its errors."""
    tokens = [t for t in _TEXT_TOKEN.findall(text) if t.strip() and not t.startswith("#")]
    fields, path, i = {}, [], 0
    while i < len(tokens):
        t = tokens[i]
        if t in ("}", ">"):
            path = path[:-1]
            i += 1
            continue
        if t in (";", ","):
            i += 1
            continue
        name = ".".join(path + [t])
        i += 1
        if i < len(tokens) and tokens[i] == ":":
            i += 1
        if i < len(tokens) and tokens[i] in ("{", "<"):
            path.append(t)
            fields.setdefault(name, None)
            i += 1
            continue
        values = fields.setdefault(name, []) or []
        items = []
        if i < len(tokens) and tokens[i] == "[":
            i += 1
            while i < len(tokens) and tokens[i] != "]":
                items.append(tokens[i])
                i += 1
            i += 1
        elif i < len(tokens):
            items.append(tokens[i])
            i += 1
            while i < len(tokens) and tokens[i][:1] in "\"'" and items[-1][:1] in "\"'":
                items[-1] = items[-1][:-1] + tokens[i][1:]  # "a" "b" is "ab"
                i += 1
        for item in items:
            if item == ",":
                continue
            if item[:1] in "\"'":
                item = re.sub(r"\\(.)", r"\1", item[1:-1])
            values.append(item)
        fields[name] = values
    return fields


def _config_int(fields, name):
    """The last value of an integer field of _config_fields, or None."""
    values = fields.get(name) or []
    try:
        return int(values[-1], 0) if values else None
    except ValueError:
        return None


def _error_line(lines):
    """A failed rank's error, from its last lines of output: the
    exception's own line ("...MorseError: why"), not a traceback's source
    line that raises it, without the "[rank0]: " that torch.distributed's
    exception hook puts before each line; "" where it printed none."""
    line = next((e for e in lines if "MorseError:" in e),
                next((e for e in lines if "MorseError" in e), lines[-1] if lines else ""))
    return re.sub(r"^\[rank\d+\]: ", "", line)


def _base_config(path, workers, shards, min_workers=None):
    text = ""
    if path:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise SystemExit(f"morse-run: cannot read --config {path}: {e.strerror}")
    given = _config_fields(text)
    fields = [("workers", workers), ("shards", shards)]
    if min_workers is not None:
        fields.append(("min_workers", min_workers))
    for field, value in fields:
        set_to = _config_int(given, field)
        if set_to is not None and set_to != value:
            flag = {"workers": "the job's Morse workers (--workers, or --nnodes x --nproc-per-node; "
                               "--nnodes with --node-aggregation) are",
                    "shards": "--servers gives",
                    "min_workers": "--min-workers is"}[field]
            raise SystemExit(f"morse-run: {path} sets {field}: {set_to} but {flag} {value}")
        if field not in given:
            text += f"\n{field}: {value}\n"
    if not any(w in given for w in ("external", "synthetic", "mlp")):
        text += "\nexternal {}\n"
    return text


def _check_interpreter(command, env):
    """When COMMAND runs a Python, check that it can import morse.torch, and
    if not, say which Python it is and why: the usual mistake is a python3
    first on PATH that is not the one with torch."""
    program = os.path.basename(command[0])
    if not program.startswith("python"):
        return None
    found = shutil.which(command[0], path=env.get("PATH")) or command[0]
    check = subprocess.run([found, "-c", "import morse.torch"], env=env, capture_output=True, text=True)
    if check.returncode == 0:
        return None
    why = (check.stderr.strip().splitlines() or ["(no message)"])[-1]
    return (f"morse-run: {command[0]} is {found}, which cannot import morse.torch: {why}\n"
            f"morse-run: name the Python that has torch (e.g. -- /usr/bin/python3 train.py)")


def _below_ephemeral():
    """The ports this host does not hand out to connections and bind(0):
    those below net.ipv4.ip_local_port_range (Linux's default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low) if low > 2048 else range(0)


def _free_ports(count, host="127.0.0.1", taken=()):
    """Ports on `host` nothing listens on now (the stages, or rank 0's
    torch.distributed store, bind them next), none of them in `taken`.

    They are drawn below the ephemeral range where the host has one, so
    that no connection's own port (gloo's, gRPC's: every outgoing socket
    takes one) can fill one before its owner binds it; bind(0) would give
    one from that range, which other processes race for. The draw is the
    system's entropy, never the random module's shared state: a script
    that seeds it (a fault campaign's schedule) would otherwise draw the
    same ports as another copy of itself starting beside it."""
    sockets, ports = [], []
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = list(_below_ephemeral())
    random.SystemRandom().shuffle(candidates)
    for _ in range(count):
        while True:
            port = candidates.pop() if candidates else 0
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                try:
                    sock.bind((host, port))
                except OSError as e:
                    if port and e.errno == errno.EADDRINUSE:
                        sock.close()
                        continue
                    # HOST is how the other nodes reach this one and may not
                    # be an address of this machine (a name behind NAT), as
                    # for the rendezvous (rendezvous.Store._listen): free on
                    # every address.
                    sock.bind(("", port))
            except OSError:
                sock.close()
                if port:
                    continue
                raise
            if sock.getsockname()[1] in taken:
                sock.close()
                continue
            break
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


def _find_server():
    """morse-server: in $MORSE_BIN_DIR (a build folder or a bundle), else
    beside this package in a build folder (build/python/morse) or a bundle
    (morse/python/morse), else on PATH."""
    roots = [os.environ["MORSE_BIN_DIR"]] if os.environ.get("MORSE_BIN_DIR") else []
    roots.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    candidates = [os.path.join(root, sub, "morse-server") for root in roots for sub in ("server", "bin", "")]
    for c in candidates:
        if os.access(c, os.X_OK):
            return os.path.normpath(c)
    on_path = shutil.which("morse-server")  # an installed package beside installed daemons
    return on_path or os.path.normpath(candidates[0])


def _parse(argv):
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="morse-run", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after -- is the command each rank runs. Across hosts:\n"
               "  morse-run --nnodes M --node-rank i --nproc-per-node L --rdzv HOST:PORT "
               "--servers S -- CMD\non every node (node 0 at HOST); see docs/python.md.\n"
               "With MORSE_TRACE=DIR/trace-{rank}.json in the environment every rank and shard\n"
               "writes its step timeline there (Chrome trace-event JSON; docs/operations.md).")
    parser.add_argument("--servers", default="1",
                        help="server shards to start (default 1; per stage with --stages, per slice "
                             "with --node-aggregation=sharded; across nodes, node 0 starts them), or "
                             "the HOST:PORT,... of shards already running (slice by slice where sharded)")
    parser.add_argument("--workers", type=int, default=None,
                        help="ranks on this host (copies of the command; per stage with --stages); "
                             "with --nnodes, the job's ranks, which must be nnodes x nproc-per-node")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks on each node (torchrun's name; on one host the same as --workers)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes in the job (default 1); every node runs the same morse-run command "
                             "with its own --node-rank")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's index, 0 to nnodes - 1 (default 0); node 0 hosts the "
                             "rendezvous and starts the shards")
    parser.add_argument("--rdzv", default=None, metavar="HOST:PORT",
                        help="with --nnodes > 1: node 0's address as the other nodes reach it, and a "
                             "free port there; the shards listen on HOST too (on every interface "
                             "where HOST is node 0's name and /etc/hosts gives it loopback)")
    parser.add_argument("--rdzv-timeout", type=float, default=300,
                        help="seconds to wait for every node to join (default 300); a node missing "
                             "by then fails the job on every node that came")
    parser.add_argument("--node-aggregation", nargs="?", const="leader", default=None,
                        choices=("leader", "sharded"),
                        help="one Morse worker per node (morse.torch; gloo inside the node). "
                             "leader (the default): each step the node's ranks average their "
                             "gradients on local rank 0, which pushes for the node (the shards see "
                             "--nnodes workers, and only it holds the optimizer state) and sends the "
                             "new parameters back. sharded: the parameters are cut into "
                             "--nproc-per-node slices of whole parameters, each its own Morse job "
                             "with its own --servers shards; local rank k averages, steps and "
                             "holds the optimizer state of slice k alone and sends the node its "
                             "parameters")
    parser.add_argument("--stages", type=int, default=1,
                        help="pipeline stages (morse.torch.pipeline; default 1: data parallel only; "
                             "one host only)")
    parser.add_argument("--config", help="base JobConfig file (text format); across nodes, the same on each")
    parser.add_argument("--token-file", default=None,
                        help="bearer-token file the servers require and the workers send")
    parser.add_argument("--tls-dir", default=None,
                        help="a folder from deploy/make-certs.sh (ca.pem, server.pem/.key, client.pem/.key) "
                             "for TLS between ranks and shards; its server certificate must name the "
                             "shards' host (--rdzv HOST across nodes, 127.0.0.1 on one)")
    parser.add_argument("--insecure", action="store_true",
                        help="across hosts, let the shards and ranks talk plaintext on the network "
                             "(a private one); on one host they always may, on loopback")
    parser.add_argument("--check-config", "--check_config", action="store_true",
                        help="check the flags, the config and the credential files, print what this "
                             "node would start, and exit (0 if all is well) without starting anything")
    parser.add_argument("--server-bin", default=None,
                        help="morse-server to run (default: the one next to this package)")
    parser.add_argument("--rank-restarts", type=int, default=0,
                        help="how many times in all to restart a rank that exits with an error or is "
                             "killed, alone, while the others wait for it (default 0: a failing rank "
                             "stops the job). Needs checkpoint { every_steps: N } in --config: each "
                             "rank then saves its state every N steps and, restarted, rejoins from "
                             "it (MORSE_REJOIN=1, MORSE_RESTART_COUNT) and replays the steps since; "
                             "the script must go on from opt.step_index (DiLoCo: opt.inner_steps) with "
                             "the same batches. With --node-aggregation a failed rank restarts its "
                             "whole node (its ranks share the node's group and step). Not for "
                             "scripts whose ranks share torch.distributed's default group (their "
                             "own, Trainer's, Accelerate's, fp16 loss scaling's): a restarted rank "
                             "cannot join it again, so a lost rank stops the job")
    parser.add_argument("--min-workers", type=int, default=None, metavar="M",
                        help="an elastic job (docs/python.md, \"Elastic jobs\"): a rank that dies "
                             "(and is not restarted) does not stop the job, and the shards complete "
                             "each step without a rank missing past timeouts.step_seconds as long as "
                             "M ranks pushed; fewer than M fails the step after "
                             "timeouts.recovery_seconds. Sets min_workers in the job config "
                             "(default: the config's, or every rank). With --node-aggregation the "
                             "workers are the nodes: M nodes, and a node whose rank dies leaves "
                             "with all its ranks")
    parser.add_argument("--stop-timeout", type=float, default=120, metavar="SECONDS",
                        help="how long the shards get to stop when the job ends or is interrupted "
                             "(each writes its checkpoint as it stops, which takes seconds for a "
                             "large model) before they are killed (default 120; the ranks get 5 s). "
                             "A second Ctrl-C kills them at once")
    parser.add_argument("--restarts", type=int, default=3,
                        help="how many times to restart a server that dies, from its checkpoint, "
                             "when the job checkpoints (default 3; 0: a dead server ends the job)")
    args = parser.parse_args(own)
    if not command:
        parser.error("give the command to run after --, e.g. -- python3 train.py")
    if shutil.which(command[0]) is None:  # before any shard starts
        parser.error(f"cannot run {command[0]}: no such program on PATH, or not an executable file")
    if args.nnodes < 1:
        parser.error(f"--nnodes {args.nnodes}: the nodes of the job, at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: "
                     f"the node rank must be 0 to nnodes - 1")
    if args.nproc_per_node is None:
        if args.workers is None:
            parser.error("give the ranks to start: --workers N (or --nproc-per-node L)")
        if args.nnodes > 1:
            parser.error("across nodes give --nproc-per-node L, the ranks on each node")
        args.nproc_per_node = args.workers
    elif args.workers is not None and args.workers != args.nnodes * args.nproc_per_node:
        parser.error(f"--workers {args.workers} but --nnodes {args.nnodes} x --nproc-per-node "
                     f"{args.nproc_per_node} is {args.nnodes * args.nproc_per_node}")
    args.world = args.nnodes * args.nproc_per_node
    if args.nnodes > 1 and not args.rdzv:
        parser.error("--nnodes > 1 needs --rdzv HOST:PORT, node 0's address and a free port there")
    if args.nnodes == 1 and args.rdzv:
        parser.error("--rdzv joins nodes: give --nnodes (more than 1) with it, or leave it out on one host")
    if args.tls_dir and args.insecure:
        parser.error("--tls-dir and --insecure: give one (TLS, or plaintext on a private network)")
    if args.nnodes > 1 and args.stages > 1:
        parser.error("--stages runs on one host: --nnodes > 1 with --stages is not supported")
    if args.node_aggregation and args.stages > 1:
        parser.error("--node-aggregation with --stages is not supported")
    # The shards' workers: the nodes with --node-aggregation, else the ranks.
    args.morse_workers = args.nnodes if args.node_aggregation else args.world
    # The Morse jobs this run is made of, each with its own shards: the
    # stages, the slices of a sharded node, or one.
    args.jobs = (args.stages if args.stages > 1 else
                 args.nproc_per_node if args.node_aggregation == "sharded" else 1)
    if args.rdzv_timeout <= 0:
        parser.error("--rdzv-timeout must be positive")
    if re.fullmatch(r"\d+", args.servers):
        args.shards, args.external = int(args.servers), None
    else:
        args.external = [s for s in args.servers.split(",") if s]
        bad = [s for s in args.external if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", s)]
        if bad or not args.external:
            parser.error(f"--servers {args.servers!r}: a shard count, or HOST:PORT,... of running shards")
        if args.stages > 1:
            parser.error("--stages starts its shards itself: give --servers as a count")
        if len(args.external) % args.jobs:
            parser.error(f"--node-aggregation=sharded: --servers lists {len(args.external)} shards, "
                         f"which do not split into the {args.jobs} slices' jobs (one per local "
                         "rank, each with the same number of shards; list them slice by slice)")
        args.shards = len(args.external) // args.jobs
    if args.nproc_per_node < 1 or args.shards < 1 or args.stages < 1:
        parser.error("--workers (--nproc-per-node), --servers and --stages must be at least 1")
    if args.restarts < 0:
        parser.error("--restarts must be at least 0")
    if not args.stop_timeout > 0:
        parser.error(f"--stop-timeout {args.stop_timeout}: give the seconds the shards get to stop, above 0")
    if args.rank_restarts < 0:
        parser.error("--rank-restarts must be at least 0")
    if args.rank_restarts and args.stages > 1:
        parser.error("--rank-restarts with --stages is not supported (a pipeline's stages wait on "
                     "each other's activations)")
    if args.min_workers is not None:
        if args.stages > 1:
            parser.error("--min-workers with --stages is not supported")
        if not 1 <= args.min_workers <= args.morse_workers:
            parser.error(f"--min-workers {args.min_workers}: give 1 to the job's "
                         f"{args.morse_workers} workers"
                         + (" (one per node with --node-aggregation)" if args.node_aggregation
                            else ""))
    if args.tls_dir:
        # The ranks' side always; the shards' only where this node starts them.
        needed = ["ca.pem", "client.pem", "client.key"]
        if args.external is None and args.node_rank == 0:
            needed += ["server.pem", "server.key"]
        missing = [f for f in needed if not os.path.isfile(os.path.join(args.tls_dir, f))]
        if missing:
            parser.error(f"--tls-dir {args.tls_dir} lacks {', '.join(missing)} (make it with "
                         f"deploy/make-certs.sh DIR HOST)")
        args.tls_dir = os.path.abspath(args.tls_dir)
    args.host = "127.0.0.1"
    if args.nnodes > 1:
        args.host = _rendezvous.split_address(args.rdzv)[0]
        if not _rendezvous.loopback(args.host) and not (args.tls_dir or args.insecure):
            parser.error(f"the shards would listen on {args.host} in plaintext: pass --tls-dir DIR "
                         f"(deploy/make-certs.sh DIR {args.host}) or, on a private network, --insecure")
    return args, command


def _stop_ranks(workers):
    """Terminates the ranks still running (killed after 10 s) and waits for
    every one."""
    for w in workers:
        if w.poll() is None:
            w.terminate()
    for w in workers:
        try:
            w.wait(10)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def _min_workers(base, workers):
    """The job's min_workers (docs/design.md 4, "Membership"): the config's, or all."""
    m = _config_int(_config_fields(base), "min_workers")
    return workers if m is None else m


_RANK_RESTARTS_NEED = ("--rank-restarts needs checkpoint { every_steps: N } in --config: a "
                       "restarted rank rejoins from its last checkpoint, and the shards keep the "
                       "replies of the steps since")


def _checkpoints(base):
    """Whether the job config text checkpoints (checkpoint.every_steps > 0)."""
    every = _config_int(_config_fields(base), "checkpoint.every_steps")
    return bool(every and every > 0)


def _tidy_workdir(workdir, node):
    """At the end, removes morse-run's folder (the config it wrote, the
    node's store files) unless the job's checkpoints are in it (checkpoints
    without checkpoint.dir), which it then names."""
    try:
        names = os.listdir(workdir)
    except OSError:
        return
    if any(n != "job.textproto" and not n.startswith("node-store-") for n in names):
        sys.stderr.write(f"{node}: this job's checkpoints are in {workdir} (checkpoint.dir in "
                         "--config chooses the folder)\n")
        return
    shutil.rmtree(workdir, ignore_errors=True)


def _check_only(args, command, server_bin, starts_servers, node):
    """--check-config: what main() would check before starting anything,
    and the plan, printed."""
    base = _base_config(args.config, args.morse_workers, args.shards, args.min_workers)
    if args.token_file and not os.access(args.token_file, os.R_OK):
        raise SystemExit(f"{node}: cannot read --token-file {args.token_file}")
    if args.rank_restarts and not _checkpoints(base):
        raise SystemExit(f"{node}: {_RANK_RESTARTS_NEED}")
    first = args.node_rank * args.nproc_per_node
    if starts_servers:
        shards = f"{args.jobs * args.shards} started here on {args.host} ({server_bin})"
    elif args.external:
        shards = ",".join(args.external) + " (running)"
    else:
        shards = f"{args.jobs * args.shards}, started by node 0"
    print(f"{node}: ok: node {args.node_rank} of {args.nnodes}, ranks {first}..{first + args.nproc_per_node - 1} "
          f"of {args.world}; shards: {shards}; "
          + (f"node aggregation ({args.nnodes} Morse workers"
             + (f"; {args.jobs} slices, each with {args.shards} shards" if args.jobs > 1 and
                args.stages == 1 else "") + "); " if args.node_aggregation else "")
          + (f"rendezvous {args.rdzv} (timeout {args.rdzv_timeout:g} s); " if args.nnodes > 1 else "")
          + ("TLS from " + args.tls_dir if args.tls_dir else "plaintext") + "; config "
          + (args.config or "(counts only)") + f" ({len(base.splitlines())} lines); command: "
          + " ".join(command))
    return 0


def _interface_holding(address):
    """The name of this host's network interface whose (primary IPv4)
    address is `address`, or None: loopback, IPv6, or none found."""
    import fcntl
    import struct
    if _rendezvous.loopback(address) or ":" in address:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None


def main(argv=None):
    try:
        args, command = _parse(sys.argv[1:] if argv is None else argv)
    except _rendezvous.RendezvousError as e:
        raise SystemExit(f"morse-run: {e}")
    server_bin = args.server_bin or _find_server()
    starts_servers = args.external is None and args.node_rank == 0
    if starts_servers and not os.access(server_bin, os.X_OK):
        raise SystemExit(f"morse-run: no morse-server at {server_bin} (build Morse, or pass --server-bin)")
    multi = args.nnodes > 1
    node = f"morse-run (node {args.node_rank})" if multi else "morse-run"
    if args.check_config:
        return _check_only(args, command, server_bin, starts_servers, node)

    workdir = tempfile.mkdtemp(prefix="morse-run-")
    config_path = os.path.join(workdir, "job.textproto")
    try:
        base = _base_config(args.config, args.morse_workers, args.shards, args.min_workers)
    except SystemExit:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    checkpointing = _checkpoints(base)
    if args.rank_restarts and not checkpointing:
        shutil.rmtree(workdir, ignore_errors=True)
        raise SystemExit(f"morse-run: {_RANK_RESTARTS_NEED}")
    # Checkpoints go to the config's checkpoint.dir, or else beside the config;
    # with stages (or a sharded node's slices), to a folder per stage (slice)
    # inside it (shards of different jobs have the same indices).
    configured_dir = (_config_fields(base).get("checkpoint.dir") or [None])[-1]
    job_kind = "stage" if args.stages > 1 else "slice"

    def checkpoint_args(job):
        if not checkpointing:
            return []
        if args.jobs == 1:
            return [] if configured_dir else ["--checkpoint_dir", workdir]
        folder = os.path.join(configured_dir if configured_dir else workdir, f"{job_kind}-{job}")
        os.makedirs(folder, exist_ok=True)
        return ["--checkpoint_dir", folder]

    # Across nodes: node 0 holds the store the others join; they learn the
    # shards' addresses and the config from it once every node is there.
    store = member = None
    if multi:
        try:
            if args.node_rank == 0:
                sys.stderr.write(f"{node}: waiting for {args.nnodes - 1} more node(s) at {args.rdzv} "
                                 f"(up to {args.rdzv_timeout:g} s)\n")
                store = _rendezvous.Store(args.rdzv, args.nnodes, args.nproc_per_node, base,
                                          args.servers, args.rdzv_timeout, args.node_aggregation)
                store.wait_for_nodes()
            else:
                sys.stderr.write(f"{node}: joining the rendezvous at {args.rdzv}\n")
                member = _rendezvous.Member(args.rdzv, args.node_rank, args.nnodes, args.nproc_per_node,
                                            base, args.servers, args.rdzv_timeout, args.node_aggregation)
                base = member.job["config"]
        except (_rendezvous.RendezvousError, KeyboardInterrupt) as e:
            if store:
                if isinstance(e, KeyboardInterrupt):
                    store.abort("node 0 was interrupted before the job started")
                store.close()
            if isinstance(e, KeyboardInterrupt):
                sys.stderr.write(f"{node}: interrupted while waiting for the other nodes\n")
                sys.exit(130)
            raise SystemExit(f"{node}: {e}")
    with open(config_path, "w") as f:
        f.write(base)

    procs, threads = [], []
    server_procs = set()  # of procs, the shards (restarted ones too)
    stopping = []

    def kill_all():
        for p in procs:
            if p.poll() is None:
                p.kill()

    def stop_all():
        """Terminates every process: the ranks get 5 s, the shards
        --stop-timeout (a shard writes its checkpoint as it stops), then
        they are killed."""
        stopping.append(True)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        started = time.time()
        for p in procs:
            if p in server_procs:
                continue
            try:
                p.wait(max(0.1, started + 5 - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        told = False
        for p in procs:
            if p not in server_procs:
                continue
            try:
                p.wait(max(0.1, started + 5 - time.time()))
                continue
            except subprocess.TimeoutExpired:
                pass
            if not told:
                sys.stderr.write(f"{node}: waiting for the shards to stop (each writes its "
                                 f"checkpoint as it stops; killed after --stop-timeout "
                                 f"{args.stop_timeout:g} s, or at a second Ctrl-C)\n")
                told = True
            try:
                p.wait(max(0.1, started + args.stop_timeout - time.time()))
            except subprocess.TimeoutExpired:
                sys.stderr.write(f"{node}: a shard did not stop within --stop-timeout "
                                 f"{args.stop_timeout:g} s; killing it (its last checkpoint "
                                 "is the one before)\n")
                p.kill()

    def fail_before_start(why):
        stop_all()
        _tidy_workdir(workdir, node)
        if member:
            member.report(1, f"node {args.node_rank}: {why}")
        if store:
            store.abort(f"node 0: {why}")
            store.close()
        raise SystemExit(f"{node}: {why}")

    def on_signal(signum, frame):
        if stopping:
            sys.stderr.write(f"{node}: interrupted again, killing every process\n")
            kill_all()
            os._exit(130)
        sys.stderr.write(f"{node}: interrupted, stopping every process\n")
        if store:
            store.abort("node 0 was interrupted", 130)
        if member:
            member.report(130, f"node {args.node_rank} was interrupted")
        stop_all()
        _tidy_workdir(workdir, node)
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    # Servers are listed job by job (stage or slice): index job * S + shard.
    addresses, servers, server_lines = [], [], []
    staged = args.stages > 1
    security = (["--tls_ca", os.path.join(args.tls_dir, "ca.pem"),
                 "--tls_cert", os.path.join(args.tls_dir, "server.pem"),
                 "--tls_key", os.path.join(args.tls_dir, "server.key")] if args.tls_dir else ["--insecure"])

    def server_name(i):
        job, shard = divmod(i, args.shards)
        return f"{job_kind} {job} server {shard}" if args.jobs > 1 else f"server {shard}"

    def start_server(i, listen):
        stage, shard = divmod(i, args.shards)
        p = subprocess.Popen([server_bin, "--config", config_path, "--shard", str(shard),
                              "--listen", listen] + security + checkpoint_args(stage) +
                             (["--token_file", args.token_file] if args.token_file else []) +
                             # MORSE_TRACE: the shards' timelines beside the ranks'.
                             (["--trace", os.environ["MORSE_TRACE"].replace(
                                 "{rank}", server_name(i).replace(" ", "-"))]
                              if os.environ.get("MORSE_TRACE") else []),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        server_procs.add(p)
        marker = {"event": threading.Event()}
        lines = []
        t = threading.Thread(target=_stream, args=(p.stdout, f"[{server_name(i)}] ", sys.stdout, marker,
                                                   None, lines),
                             daemon=True)
        t.start()
        threads.append(t)
        if not marker["event"].wait(30) or "address" not in marker:
            fail_before_start(f"{server_name(i)} did not start on {listen} (see its output above)")
        return p, marker["address"], lines

    listens = []  # where each shard listens (its restarts too)
    if starts_servers:
        listen = f"[{args.host}]:0" if ":" in args.host else f"{args.host}:0"
        # A name this host gives loopback alone (/etc/hosts' 127.0.1.1): the
        # shards listen on every interface and are known by the name, which
        # the other nodes resolve to this host's address (and TLS checks).
        widened = multi and _rendezvous.loopback_only(args.host)
        if widened:
            listen = "0.0.0.0:0"
            sys.stderr.write(f"{node}: {args.host} is a loopback address on this host (/etc/hosts): "
                             "the rendezvous and the shards listen on every interface, and the "
                             f"other nodes reach them as {args.host}\n")
        for i in range(args.jobs * args.shards):
            p, address, lines = start_server(i, listen)
            port = address.rsplit(":", 1)[1]
            listens.append(f"{listen.rsplit(':', 1)[0]}:{port}")
            if widened:
                address = f"{args.host}:{port}"
            servers.append(p)
            addresses.append(address)
            server_lines.append(lines)
    elif member:
        addresses = member.job["servers"]
    else:
        addresses = args.external
    # torch.distributed's env:// rendezvous (MASTER_ADDR, MASTER_PORT), as
    # torchrun sets it: Hugging Face Trainer and Accelerate start a gloo
    # process group for their own bookkeeping (Morse exchanges the
    # gradients). Rank 0 listens there, on node 0. Given ones are kept.
    if member:
        master_port = member.job["master_port"]
    else:
        master_port = _free_ports(1, args.host)[0]
    if store:
        store.publish(addresses, args.world, master_port)

    # MORSE_* for morse.torch, and torch.distributed's names (RANK,
    # WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) for samplers and
    # scripts that read them.
    L = args.nproc_per_node
    env = dict(os.environ, MORSE_WORLD_SIZE=str(args.world), MORSE_CONFIG=config_path,
               WORLD_SIZE=str(args.world), LOCAL_WORLD_SIZE=str(L), GROUP_RANK=str(args.node_rank),
               MORSE_NODE_RANK=str(args.node_rank), MORSE_NNODES=str(args.nnodes))
    if args.node_aggregation:
        env["MORSE_NODE_AGGREGATION"] = "1" if args.node_aggregation == "leader" else "sharded"
        # The node's own gloo group meets in a file store in this run's
        # folder, a fresh file for each start of the node (a restarted node
        # forms it anew): a file, not a port, so that nothing else on the
        # host can take it between morse-run's choice and the ranks' start.
        env["MORSE_NODE_STORE"] = os.path.join(workdir, "node-store-0")
    else:
        env.pop("MORSE_NODE_AGGREGATION", None)
    env.setdefault("MASTER_ADDR", args.host)
    env.setdefault("MASTER_PORT", str(master_port))
    # gloo (a script's process group across the nodes, Trainer's and
    # Accelerate's) gives its peers the address of this host's name unless
    # told an interface, and the name often maps to 127.0.0.1 or 127.0.1.1
    # (/etc/hosts): every connection from another node is then refused.
    # Across hosts the ranks get the interface of this node's address on
    # the rendezvous's connection (node 0's as the first node reached it);
    # a given GLOO_SOCKET_IFNAME is kept.
    rendezvous = store or member
    if rendezvous and rendezvous.local_address and "GLOO_SOCKET_IFNAME" not in env:
        interface = _interface_holding(rendezvous.local_address)
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
            sys.stderr.write(f"{node}: GLOO_SOCKET_IFNAME={interface} (the interface of "
                             f"{rendezvous.local_address}, this node's address on the rendezvous, for "
                             "the ranks' gloo groups; set it to choose)\n")
    # torch's intra-op threads: a share of this host's cores per copy, not
    # every core in each (torch 2.x then spins its OpenMP threads against
    # the other copies': the digits example with 4 ranks on 2 cores took
    # 55 s a run instead of 16). torchrun sets 1 when it starts several
    # copies; a given OMP_NUM_THREADS is kept.
    copies = args.stages * L
    if "OMP_NUM_THREADS" not in env and copies > 1:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // copies))
        sys.stderr.write(f"{node}: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} for each of the "
                         f"{copies} copies on this host (this host's cores shared out; set it "
                         "to choose)\n")
    if args.tls_dir:
        env.update(MORSE_TLS_CA=os.path.join(args.tls_dir, "ca.pem"),
                   MORSE_TLS_CERT=os.path.join(args.tls_dir, "client.pem"),
                   MORSE_TLS_KEY=os.path.join(args.tls_dir, "client.key"))
        env.pop("MORSE_INSECURE", None)
    elif args.external is None or args.insecure:
        env["MORSE_INSECURE"] = "1"
    if args.token_file:
        env["MORSE_TOKEN_FILE"] = os.path.abspath(args.token_file)
    env.pop("MORSE_REJOIN", None)
    env.pop("MORSE_RESTART_COUNT", None)
    if args.rank_restarts:
        # Each rank's checkpoint beside the shards' (morse.torch saves it
        # every checkpoint.every_steps steps).
        env["MORSE_CHECKPOINT_DIR"] = configured_dir if configured_dir else workdir
    package_root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    env["PYTHONPATH"] = package_root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    problem = _check_interpreter(command, env)
    if problem:
        fail_before_start(problem.replace("morse-run: ", "", 1).replace("\nmorse-run: ", "; "))
    # Worker w is replica r of stage s: w = s * L + r. Stage s > 0 listens
    # on listen_ports[(s - 1) * L + r] for replica r of stage s - 1.
    listen_ports = _free_ports((args.stages - 1) * L)
    workers, errors, names, envs = [], [], [], []

    def start_rank(w, own):
        try:
            p = subprocess.Popen(command, env=own, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except OSError as e:
            fail_before_start(f"cannot run {command[0]}: {e.strerror}")
        procs.append(p)
        t = threading.Thread(target=_stream, args=(p.stdout, f"[{names[w]}] ", sys.stdout, None, errors[w]),
                             daemon=True)
        t.start()
        threads.append(t)
        return p

    for w in range(args.stages * L):
        stage, local = divmod(w, L)
        r = args.node_rank * L + local
        job = stage if staged else local if args.jobs > 1 else 0  # its stage's, or its slice's
        own = dict(env, MORSE_RANK=str(r), RANK=str(r), LOCAL_RANK=str(local),
                   MORSE_SERVERS=",".join(addresses[job * args.shards:(job + 1) * args.shards]))
        if staged:
            own.update(MORSE_STAGE=str(stage), MORSE_STAGES=str(args.stages), MORSE_JOB=workdir)
            if stage > 0:
                own["MORSE_STAGE_LISTEN"] = f"127.0.0.1:{listen_ports[(stage - 1) * L + local]}"
            if stage < args.stages - 1:
                own["MORSE_STAGE_NEXT"] = f"127.0.0.1:{listen_ports[stage * L + local]}"
        names.append(f"stage {stage} rank {r}" if staged else f"rank {r}")
        errors.append([])
        envs.append(own)
        workers.append(start_rank(w, own))

    status, why = 0, ""
    restarts = rank_restarts = 0
    restarted = [0] * len(workers)  # each rank's restarts (MORSE_RESTART_COUNT)
    remaining = set(range(len(workers)))
    min_workers = _min_workers(base, args.morse_workers)
    lost = []  # ranks an elastic job went on without
    others = set(range(1, args.nnodes)) if store else set()
    while remaining or others:
        # A server that dies is restarted from its checkpoint if the job has
        # them (the workers wait and replay); otherwise it ends the job at
        # once, with its last words.
        dead = [(s, servers[s].poll()) for s in range(len(servers)) if servers[s].poll() is not None]
        if dead:
            s, code = dead[0]
            time.sleep(0.2)
            last = server_lines[s][-5:]
            if checkpointing and restarts < args.restarts:
                restarts += 1
                sys.stderr.write(f"{node}: {server_name(s)} exited with {code}; restarting it on "
                                 f"{addresses[s]} from its checkpoint ({restarts} of --restarts "
                                 f"{args.restarts}); the workers wait for it\n")
                servers[s], _, server_lines[s] = start_server(s, listens[s])
                continue
            why = f"{server_name(s)} exited with {code}"
            sys.stderr.write(f"{node}: {why}; stopping every rank"
                             + ("" if checkpointing else
                                " (with checkpoint { every_steps: N } in --config it would be "
                                "restarted and the job would go on)")
                             + "\n" + "".join(f"{node}: {server_name(s)}: {line}\n" for line in last))
            status = 3
            break
        for r in sorted(remaining):
            code = workers[r].poll()
            if code is None:
                continue
            if code != 0 and rank_restarts < args.rank_restarts and args.node_aggregation:
                # The node's ranks share its group and its step: they all
                # start again, from their checkpoints, while the other
                # nodes wait for the node's worker(s) in the exchange.
                rank_restarts += 1
                # Every rank already gone, by rank (the one that failed first
                # is not always the first found: its peers may fail on it).
                gone = ", ".join(f"{names[w]} exited with {workers[w].poll()}"
                                 for w in range(len(workers))
                                 if workers[w].poll() not in (None, 0))
                sys.stderr.write(f"{node}: {gone}; restarting this node's "
                                 f"{L} ranks ({rank_restarts} of --rank-restarts "
                                 f"{args.rank_restarts}); they rejoin from their checkpoints and "
                                 + ("the other nodes wait for them\n"
                                    if min_workers == args.morse_workers else
                                    "the other nodes go on, until it catches up (min_workers)\n"))
                _stop_ranks(workers)
                store_at = os.path.join(workdir, f"node-store-{rank_restarts}")
                for w in range(len(workers)):
                    restarted[w] += 1
                    envs[w] = dict(envs[w], MORSE_REJOIN="1", MORSE_RESTART_COUNT=str(restarted[w]),
                                   MORSE_NODE_STORE=store_at)
                    workers[w] = start_rank(w, envs[w])
                remaining = set(range(len(workers)))
                break
            if code != 0 and rank_restarts < args.rank_restarts:
                # Alone, from its checkpoint; the others wait for it (up to
                # the job's timeouts.recovery_seconds).
                rank_restarts += 1
                restarted[r] += 1
                sys.stderr.write(f"{node}: {names[r]} exited with {code}; restarting it "
                                 f"({rank_restarts} of --rank-restarts {args.rank_restarts}); it "
                                 f"rejoins from its checkpoint and the other ranks "
                                 + ("wait for it\n" if min_workers == args.morse_workers else
                                    "go on, until it catches up (min_workers)\n"))
                workers[r] = start_rank(r, dict(envs[r], MORSE_REJOIN="1",
                                                MORSE_RESTART_COUNT=str(restarted[r])))
                continue
            if code != 0 and min_workers < args.morse_workers and args.node_aggregation:
                # The node is one worker of the job: it leaves with every
                # rank (they share its group and its step), and the shards
                # complete the steps without it.
                gone = ", ".join(f"{names[w]} exited with {workers[w].poll()}"
                                 for w in range(len(workers))
                                 if workers[w].poll() not in (None, 0))
                _stop_ranks(workers)
                lost.extend(w for w in sorted(remaining) if w not in lost)
                remaining.clear()
                sys.stderr.write(f"{node}: {gone}; this node's {L} ranks leave the job, which "
                                 f"goes on without the node (min_workers {min_workers} of "
                                 f"{args.morse_workers} nodes)\n")
                break
            remaining.discard(r)
            if code != 0 and min_workers < args.morse_workers:
                # An elastic job goes on: the shards complete its steps
                # without this rank, and fail them if fewer than
                # min_workers are left.
                lost.append(r)
                if len(lost) > args.morse_workers - min_workers:
                    # Fewer than min_workers ranks are left: no step can
                    # complete any more, and the job has failed.
                    why = (f"{names[r]} exited with {code}, and {len(lost)} of the job's "
                           f"{args.morse_workers} ranks have left it: fewer than min_workers "
                           f"({min_workers}) remain")
                    time.sleep(0.2)  # the rank's last lines
                    first = _error_line(errors[r]) if code > 0 else ""
                    sys.stderr.write(f"{node}: {why}; stopping the job\n"
                                     + (f"{node}: {names[r]}'s error: {first}\n" if first else ""))
                    status = code
                    break
                sys.stderr.write(f"{node}: {names[r]} exited with {code}; the job goes on without "
                                 f"it (min_workers {min_workers} of {args.morse_workers})\n")
                continue
            if code != 0:
                time.sleep(0.2)  # the rank's last lines
                # A rank that failed only because its node's group lost
                # another rank is named after that one, the cause.
                for w in sorted(remaining):
                    if (w != r and workers[w].poll() not in (None, 0)
                            and any("group lost a rank" in e for e in errors[r])
                            and not any("group lost a rank" in e for e in errors[w])):
                        r, code = w, workers[w].poll()
                        break
                first = _error_line(errors[r])
                # Ranks that went too by now (one killed, another failing
                # for its loss: which went first is not known): all named.
                also = [f"{names[w]} exited with {workers[w].poll()}" for w in sorted(remaining)
                        if w != r and workers[w].poll() not in (None, 0)]
                why = (f"{names[r]} exited with {code}" + (f": {first}" if first else "")
                       + (f" (and {', '.join(also)})" if also else ""))
                sys.stderr.write(f"{node}: {names[r]} exited with {code}"
                                 + (f", {', '.join(also)}" if also else "") + "; stopping the job"
                                 + (f"\n{node}: {names[r]}'s error: {first}" if first else "") + "\n")
                status = code
                break
        if status:
            break
        event = store.next_event() if store else None
        if event:
            other, code, reason = event
            others.discard(other)
            if code != 0:
                why = f"node {other}: {reason}" if code is None else f"node {other} ended with {code}: {reason}"
                sys.stderr.write(f"{node}: {why}; stopping the job\n")
                status = code or 1
                break
        stopped = member.stopped() if member else None
        if stopped:
            why, status = stopped
            sys.stderr.write(f"{node}: the job stopped: {why}\n")
            status = status or 1
            break
        time.sleep(0.05)
    if store:
        if status:
            store.abort(f"node 0: {why}" if not why.startswith("node ") else why, status)
        store.close()
    if member:
        member.report(status, why)
        member.close()
    stop_all()
    for t in threads:
        t.join(timeout=2)
    _tidy_workdir(workdir, node)
    if not status and lost:
        sys.stderr.write(f"{node}: the job finished without {', '.join(names[r] for r in lost)}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
