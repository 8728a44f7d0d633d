"""Shared by the Python tests: run this test file as N workers under
morse-run, and small helpers. Tests run with Debian's /usr/bin/python3 and
PYTHONPATH pointing at the built morse package (ctest sets it)."""
import contextlib
import glob
import json
import os
import socket
import subprocess
import sys


def morse_run(script, workers, servers, *args, config=None, timeout=300):
    command = [os.environ["MORSE_RUN"], "--servers", str(servers), "--workers", str(workers)]
    if config:
        command += ["--config", config]
    command += ["--", sys.executable, script, "--worker", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=timeout, text=True)
    return result.returncode, result.stdout


def check(condition, message):
    if not condition:
        print("FAIL:", message)
        sys.exit(1)


def check_ranks_match_simulator(out, ranks, steps):
    """The job wrote checksums-<rank>.json (one checksum per step), job.json
    (base config and overrides), x0.npy and grad-<rank>-<step>.npy to `out`:
    every rank must hold rank 0's bits after every step, and the simulator
    fed the same gradients must too. Removes `out` afterwards."""
    import numpy as np
    from morse import _native
    checksums = [json.load(open(f"{out}/checksums-{r}.json")) for r in range(ranks)]
    for r in range(1, ranks):
        check(checksums[r] == checksums[0], f"rank {r} differs from rank 0: {checksums[r]} vs {checksums[0]}")
    job = json.load(open(f"{out}/job.json"))
    sim = _native.Simulator(job["base"], job["overrides"], np.load(f"{out}/x0.npy"))
    for step in range(steps):
        sim.step([np.load(f"{out}/grad-{r}-{step}.npy") for r in range(ranks)])
        check(sim.checksum() == checksums[0][step],
              f"step {step}: workers {checksums[0][step]}, simulator {sim.checksum()}")
    for f in glob.glob(f"{out}/*"):
        os.remove(f)
    os.rmdir(out)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(config_path):
    """One morse-server shard (the build's or the bundle's) on a free
    loopback port, in plaintext, for the duration; yields its address."""
    from morse.run import _find_server
    port = free_port()
    proc = subprocess.Popen([_find_server(), "--config", config_path, "--shard", "0",
                             "--listen", f"127.0.0.1:{port}", "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()
