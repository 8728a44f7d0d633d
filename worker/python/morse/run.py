"""morse-run: start a Morse job's servers and N copies of a training script.

    morse-run --servers S --workers N [--config F] -- python3 train.py [args...]
    morse-run --stages K --servers S --workers N -- python3 train.py [args...]

Starts S morse-server shards on free loopback ports and N copies of the
command with MORSE_RANK, MORSE_WORLD_SIZE, MORSE_SERVERS and MORSE_CONFIG in
their environment (morse.torch's optimizers read them). Output is streamed
with [rank i] / [server s] prefixes. Ctrl-C, or any copy exiting non-zero,
stops everything; the exit code is then non-zero (the failing copy's, or 130).
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
"""
import socket
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


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


def _base_config(path, workers, shards):
    text = ""
    if path:
        with open(path) as f:
            text = f.read()
    for field, value in (("workers", workers), ("shards", shards)):
        m = re.search(rf"^\s*{field}\s*:\s*(\d+)", text, re.M)
        if m and int(m.group(1)) != value:
            raise SystemExit(f"morse-run: {path} sets {field}: {m.group(1)} but --{field if field == 'workers' else 'servers'} is {value}")
        if not m:
            text += f"\n{field}: {value}\n"
    if not re.search(r"^\s*(external|synthetic|mlp)\s*[:{]", text, re.M):
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


def _free_ports(count):
    """Loopback ports nothing listens on now (the stages bind them next)."""
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="morse-run", description=__doc__.split("\n\n")[0],
        epilog="Everything after -- is the command each worker runs.")
    parser.add_argument("--servers", type=int, default=1,
                        help="server shards to start (default 1), per stage with --stages")
    parser.add_argument("--workers", type=int, required=True,
                        help="copies of the command (ranks), per stage with --stages")
    parser.add_argument("--stages", type=int, default=1,
                        help="pipeline stages (morse.torch.pipeline; default 1: data parallel only)")
    parser.add_argument("--config", help="base JobConfig file (text format)")
    parser.add_argument("--token-file", default=None,
                        help="bearer-token file the servers require and the workers send "
                             "(the servers listen on 127.0.0.1 in plaintext: morse-run is for one host)")
    parser.add_argument("--server-bin", default=None,
                        help="morse-server to run (default: the one next to this package)")
    parser.add_argument("--restarts", type=int, default=3,
                        help="how many times to restart a server that dies, from its checkpoint, "
                             "when the job checkpoints (default 3; 0: a dead server ends the job)")
    args = parser.parse_args(own)
    if not command:
        parser.error("give the command to run after --, e.g. -- python3 train.py")
    if args.workers < 1 or args.servers < 1 or args.stages < 1:
        parser.error("--workers, --servers and --stages must be at least 1")
    server_bin = args.server_bin or _find_server()
    if not os.access(server_bin, os.X_OK):
        raise SystemExit(f"morse-run: no morse-server at {server_bin} (build Morse, or pass --server-bin)")

    if args.restarts < 0:
        parser.error("--restarts must be at least 0")
    workdir = tempfile.mkdtemp(prefix="morse-run-")
    config_path = os.path.join(workdir, "job.textproto")
    base = _base_config(args.config, args.workers, args.servers)
    with open(config_path, "w") as f:
        f.write(base)
    every = re.search(r"every_steps\s*:\s*(\d+)", base)
    checkpointing = bool(every and int(every.group(1)) > 0)
    # Checkpoints go to the config's checkpoint.dir, or else beside the config;
    # with stages, to a folder per stage inside it (shards of different
    # stages have the same indices).
    configured_dir = re.search(r"^\s*dir\s*:\s*\"([^\"]*)\"", base, re.M)

    def checkpoint_args(stage):
        if not checkpointing:
            return []
        if args.stages == 1:
            return [] if configured_dir else ["--checkpoint_dir", workdir]
        folder = os.path.join(configured_dir.group(1) if configured_dir else workdir, f"stage-{stage}")
        os.makedirs(folder, exist_ok=True)
        return ["--checkpoint_dir", folder]

    procs, threads = [], []
    def stop_all():
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 5
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()

    def on_signal(signum, frame):
        sys.stderr.write("morse-run: interrupted, stopping every process\n")
        stop_all()
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    # Servers are listed stage by stage: index stage * S + shard.
    addresses, servers, server_lines = [], [], []
    staged = args.stages > 1

    def server_name(i):
        stage, shard = divmod(i, args.servers)
        return f"stage {stage} server {shard}" if staged else f"server {shard}"

    def start_server(i, listen):
        stage, shard = divmod(i, args.servers)
        # Loopback only, so plaintext is asked for explicitly.
        p = subprocess.Popen([server_bin, "--config", config_path, "--shard", str(shard),
                              "--listen", listen, "--insecure"] + checkpoint_args(stage) +
                             (["--token_file", args.token_file] if args.token_file else []),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        marker = {"event": threading.Event()}
        lines = []
        t = threading.Thread(target=_stream, args=(p.stdout, f"[{server_name(i)}] ", sys.stdout, marker,
                                                   None, lines),
                             daemon=True)
        t.start()
        threads.append(t)
        if not marker["event"].wait(30) or "address" not in marker:
            stop_all()
            raise SystemExit(f"morse-run: {server_name(i)} did not start (see its output above)")
        return p, marker["address"], lines

    for i in range(args.stages * args.servers):
        p, address, lines = start_server(i, "127.0.0.1:0")
        servers.append(p)
        addresses.append(address)
        server_lines.append(lines)

    # MORSE_* for morse.torch, and torch.distributed's names (RANK,
    # WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) for samplers and scripts that
    # read them; every rank is on this host.
    env = dict(os.environ, MORSE_WORLD_SIZE=str(args.workers),
               MORSE_CONFIG=config_path, MORSE_INSECURE="1", WORLD_SIZE=str(args.workers),
               LOCAL_WORLD_SIZE=str(args.workers))
    if args.token_file:
        env["MORSE_TOKEN_FILE"] = os.path.abspath(args.token_file)
    package_root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    env["PYTHONPATH"] = package_root + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    problem = _check_interpreter(command, env)
    if problem:
        stop_all()
        raise SystemExit(problem)
    # Worker w is replica r of stage s: w = s * N + r. Stage s > 0 listens
    # on listen_ports[(s - 1) * N + r] for replica r of stage s - 1.
    listen_ports = _free_ports((args.stages - 1) * args.workers)
    workers, errors, names = [], [], []
    for w in range(args.stages * args.workers):
        stage, r = divmod(w, args.workers)
        own = dict(env, MORSE_RANK=str(r), RANK=str(r), LOCAL_RANK=str(r),
                   MORSE_SERVERS=",".join(addresses[stage * args.servers:(stage + 1) * args.servers]))
        if staged:
            own.update(MORSE_STAGE=str(stage), MORSE_STAGES=str(args.stages), MORSE_JOB=workdir)
            if stage > 0:
                own["MORSE_STAGE_LISTEN"] = f"127.0.0.1:{listen_ports[(stage - 1) * args.workers + r]}"
            if stage < args.stages - 1:
                own["MORSE_STAGE_NEXT"] = f"127.0.0.1:{listen_ports[stage * args.workers + r]}"
        names.append(f"stage {stage} rank {r}" if staged else f"rank {r}")
        p = subprocess.Popen(command, env=own, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(p)
        workers.append(p)
        errors.append([])
        t = threading.Thread(target=_stream, args=(p.stdout, f"[{names[w]}] ", sys.stdout, None, errors[w]),
                             daemon=True)
        t.start()
        threads.append(t)

    status = 0
    restarts = 0
    remaining = set(range(len(workers)))
    while remaining:
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
                sys.stderr.write(f"morse-run: {server_name(s)} exited with {code}; restarting it on "
                                 f"{addresses[s]} from its checkpoint ({restarts} of --restarts "
                                 f"{args.restarts}); the workers wait for it\n")
                servers[s], _, server_lines[s] = start_server(s, addresses[s])
                continue
            sys.stderr.write(f"morse-run: {server_name(s)} exited with {code}; stopping every rank"
                             + ("" if checkpointing else
                                " (with checkpoint { every_steps: N } in --config it would be "
                                "restarted and the job would go on)")
                             + "\n" + "".join(f"morse-run: {server_name(s)}: {line}\n" for line in last))
            status = 3
            break
        for r in sorted(remaining):
            code = workers[r].poll()
            if code is None:
                continue
            remaining.discard(r)
            if code != 0:
                time.sleep(0.2)  # the rank's last lines
                first = next((e for e in errors[r] if "MorseError" in e), errors[r][-1] if errors[r] else "")
                sys.stderr.write(f"morse-run: {names[r]} exited with {code}; stopping the job"
                                 + (f"\nmorse-run: {names[r]}'s error: {first}" if first else "") + "\n")
                status = code
                remaining.clear()
                break
        time.sleep(0.05)
    stop_all()
    for t in threads:
        t.join(timeout=2)
    return status


if __name__ == "__main__":
    sys.exit(main())
