"""MORSE_TRACE: a job run under morse-run with MORSE_TRACE=DIR/trace-{rank}.json
leaves one Chrome trace-event file per rank and per shard, valid JSON, with
every phase of every step: on each rank the step, each partition's
gradient ready, encode, round trip, receive and apply, the wait for the
replies; on each shard each push, the sum and recompression, the replies
and the mirror. The traced ranks stay bit-identical to the simulator (the
OneBitAdam job of test_onebit_identical, across the freeze). A trace file
that cannot be written is a clear error at construction, and
morse-server --trace with one exits with its configuration error."""
import json
import os
import subprocess
import sys
import tempfile

import torch

from harness import check, check_ranks_match_simulator, morse_run, train_recorded  # noqa: E402

STEPS = 6
RANK_PHASES = {"step", "ready", "encode", "round trip", "receive", "apply", "wait for replies"}
SHARD_PHASES = {"push", "sum and recompress", "reply", "mirror"}
PER_PARTITION = {"ready", "encode", "round trip", "receive", "apply"}


def worker(out):
    import morse.torch
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    rank = int(os.environ["MORSE_RANK"])
    opt = morse.torch.OneBitAdam(model.parameters(), lr=0.01, freeze_step=3, block_elems=16,
                                 partition_elems=64, overlap=rank == 0)
    train_recorded(opt, model, out, STEPS, features=10, classes=4)
    json.dump(opt._partitions, open(os.path.join(out, f"partitions-{rank}.json"), "w"))


def events(path):
    with open(path) as f:
        data = json.load(f)  # valid JSON, or this raises
    check(isinstance(data.get("traceEvents"), list), f"{path}: no traceEvents list")
    check(data.get("otherData", {}).get("dropped") == 0, f"{path}: events were dropped")
    out = []
    for e in data["traceEvents"]:
        check({"name", "ph", "pid", "tid"} <= set(e), f"{path}: an event without name/ph/pid/tid: {e}")
        if e["ph"] == "M":
            continue
        check(e["ph"] in ("X", "i") and isinstance(e.get("ts"), int) and e["ts"] >= 0,
              f"{path}: a bad event {e}")
        if e["ph"] == "X":
            check(isinstance(e.get("dur"), int) and e["dur"] >= 0, f"{path}: a bad span {e}")
        out.append(e)
    return out


def check_rank(path, partitions):
    got = events(path)
    names = {e["name"] for e in got}
    check(RANK_PHASES <= names, f"{path}: phases {sorted(RANK_PHASES - names)} missing")
    steps = sorted(e["args"]["step"] for e in got if e["name"] == "step")
    check(steps == list(range(STEPS)), f"{path}: step spans for steps {steps}")
    for name in PER_PARTITION:
        for step in range(STEPS):
            seen = sorted({e["args"]["partition"] for e in got
                           if e["name"] == name and e["args"]["step"] == step})
            check(seen == list(range(partitions)),
                  f"{path}: '{name}' of step {step} for partitions {seen}, not all {partitions}")
    spans = {e["args"]["step"]: e for e in got if e["name"] == "step"}
    for e in got:
        if e["ph"] == "X" and e["name"] in ("encode", "apply", "wait for replies"):
            s = spans[e["args"]["step"]]
            check(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1,
                  f"{path}: {e} lies outside its step {s}")


def check_shard(path):
    got = events(path)
    names = {e["name"] for e in got}
    check(SHARD_PHASES <= names, f"{path}: phases {sorted(SHARD_PHASES - names)} missing")
    replied = {e["args"]["step"] for e in got if e["name"] == "reply"}
    check(replied == set(range(STEPS)), f"{path}: replies for steps {sorted(replied)}")


def main():
    run = tempfile.mkdtemp(prefix="morse-trace-run-")  # removed by the simulator check
    out = tempfile.mkdtemp(prefix="morse-trace-")
    os.environ["MORSE_TRACE"] = os.path.join(out, "trace-{rank}.json")
    code, output = morse_run(__file__, 2, 2, run)
    del os.environ["MORSE_TRACE"]
    if code != 0:
        print(output)
    check(code == 0, "the traced job failed")
    partitions = len(json.load(open(os.path.join(run, "partitions-0.json"))))
    check_ranks_match_simulator(run, 2, STEPS)
    check(partitions >= 2, f"{partitions} partitions; the test wants several")
    for rank in range(2):
        check_rank(os.path.join(out, f"trace-{rank}.json"), partitions)
    for shard in range(2):
        check_shard(os.path.join(out, f"trace-server-{shard}.json"))
    # trace_summary.py reads them: a median per step for every phase.
    summary = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "..", "bench", "trace_summary.py"),
                              os.path.join(out, "trace-0.json"),
                              os.path.join(out, "trace-server-0.json"), "--skip", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    check(summary.returncode == 0, f"trace_summary.py failed:\n{summary.stdout}")
    rows = [json.loads(line) for line in summary.stdout.splitlines() if line.startswith("{")]
    check([r["process"] for r in rows] == ["rank 0", "shard 0"] and
          RANK_PHASES - {"ready", "receive"} <= set(rows[0]["phases_ms"]) and
          SHARD_PHASES <= set(rows[1]["phases_ms"]),
          f"trace_summary.py's lines: {rows}")
    print(f"PASS every rank's and shard's trace holds every phase of {STEPS} steps, "
          f"{partitions} partitions; the ranks equal the simulator")

    # A file that cannot be written: the optimizer says so.
    os.environ["MORSE_TRACE"] = os.path.join(out, "no-such-folder", "trace-{rank}.json")
    failed = subprocess.run([os.environ["MORSE_RUN"], "--servers", "1", "--workers", "1", "--",
                             sys.executable, "-c",
                             "import torch, morse.torch; "
                             "morse.torch.OneBitAdam(torch.nn.Linear(2, 2).parameters())"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    del os.environ["MORSE_TRACE"]
    check(failed.returncode != 0 and "cannot write the trace file" in failed.stdout,
          f"an unwritable MORSE_TRACE was not reported:\n{failed.stdout[-2000:]}")
    server = os.path.join(os.environ.get("MORSE_BIN_DIR", ""), "server", "morse-server")
    if os.path.exists(server):
        config = os.path.join(out, "job.textproto")
        with open(config, "w") as f:
            f.write("workers: 1\nshards: 1\nexternal {}\n")
        bad = subprocess.run([server, "--config", config, "--shard", "0", "--listen", "127.0.0.1:0",
                              "--insecure", "--trace", os.path.join(out, "no-such-folder", "t.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        check(bad.returncode != 0 and "--trace" in bad.stdout,
              f"morse-server --trace to an unwritable file: exit {bad.returncode}\n{bad.stdout}")
    print("PASS an unwritable trace file is an error on a rank and on a shard")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-1])
        sys.exit(0)
    main()
