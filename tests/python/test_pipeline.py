"""morse.torch.pipeline in real processes over real sockets
(worker/python/examples/digits_pipeline.py):

1. fp32 boundaries: 2 stages (GPipe) and 3 stages (1F1B) train bit for bit
   like one process running the whole model on the same micro-batches.
2. Every boundary codec round-trips real activations within its bound, and
   the bytes on the wire shrink as the codec says.
3. AQ-SGD's per-sample buffers survive a restart of every stage from its
   checkpoint: the resumed run equals the uninterrupted one bit for bit.
4. morse-run --stages 2 --workers 2 with Morse's Adam per stage: replicas
   agree and the model learns.
5. A stage that dies makes the others fail with a clear error; a stage that
   stops answering makes them fail after their timeout; neither hangs.
6. Wrong use is refused with a clear message.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from harness import check, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "worker", "python", "examples", "digits_pipeline.py")
sys.path.insert(0, os.path.dirname(EXAMPLE))
import digits_pipeline as example  # noqa: E402
from morse import _native  # noqa: E402
from morse._native import MorseError  # noqa: E402
from morse.torch import pipeline  # noqa: E402


# torch's intra-op threads change how a matmul adds up (torch 2.x splits
# its reductions by thread): the copies morse-run starts and the reference
# in this process run with one each, so that "bit for bit" compares the
# same arithmetic (morse-run would otherwise give each copy its share of
# the cores, and this process keeps all of them).
THREADS = 1
torch.set_num_threads(THREADS)


def run_staged(stages, workers, *args, timeout=300):
    command = [os.environ["MORSE_RUN"], "--stages", str(stages), "--workers", str(workers), "--",
               sys.executable, EXAMPLE, *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS=str(THREADS)))
    results = {}
    for line in result.stdout.splitlines():
        if line.startswith("[stage ") and "] {" in line:
            r = json.loads(line.split("] ", 1)[1])
            results[(r["stage"], r["replica"])] = r
    if result.returncode != 0:
        print(result.stdout[-4000:])
    check(result.returncode == 0, f"morse-run --stages {stages} {' '.join(args)} failed")
    return results


def reference(stages, steps, schedule_micro, hidden=128, batch=32, lr=0.003):
    """One process, the whole model, the same micro-batches, Adam."""
    blocks = example.make_model(stages, hidden, 0)
    model = torch.nn.Sequential(*blocks)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_x, train_y, _, _ = example.load_digits()
    for step in range(steps):
        rows = example.batch_rows(len(train_y), 0, 1, step, batch)
        optimizer.zero_grad()
        for x, y in zip(pipeline.split_microbatches(train_x[rows], schedule_micro),
                        pipeline.split_microbatches(train_y[rows], schedule_micro)):
            (torch.nn.functional.cross_entropy(model(x), y) / schedule_micro).backward()
        optimizer.step()
    return blocks


def saved_blocks(prefix, stages):
    return [torch.load(f"{prefix}.stage-{s}")["module"] for s in range(stages)]


def same_bits(blocks, states):
    for s, (block, state) in enumerate(zip(blocks, states)):
        for name, value in block.state_dict().items():
            if not torch.equal(value, state[name]):
                return f"stage {s} {name} differs by up to {(value - state[name]).abs().max().item():.3g}"
    return None


def test_matches_one_process(tmp):
    for stages, schedule, micro in ((2, "gpipe", 4), (3, "1f1b", 5)):
        prefix = os.path.join(tmp, f"exact-{stages}")
        run_staged(stages, 1, "--optimizer", "local", "--steps", "25", "--microbatches", str(micro),
                   "--schedule", schedule, "--save", prefix)
        problem = same_bits(reference(stages, 25, micro), saved_blocks(prefix, stages))
        check(problem is None, f"{stages} stages ({schedule}) against one process: {problem}")
        print(f"{stages} stages, {schedule}, {micro} micro-batches: bit-identical to one process")


def test_codecs_on_real_activations(tmp):
    blocks = reference(2, 20, 4)
    train_x, _, _, _ = example.load_digits()
    with torch.no_grad():
        activations = blocks[0](train_x[:64]).contiguous()
    x = activations.numpy().reshape(-1)
    rows, n = 64, x.size
    sizes = {}
    for spec, bound in (("fp32", 0.0), ("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8), ("int8/128", None),
                        ("int4/128", None), ("topk:0.1", None), ("topk:0.3+ef", None)):
        sender, receiver = _native.Boundary(spec), _native.Boundary(spec)
        payload = sender.encode(x, rows)
        out = receiver.decode(payload, np.empty_like(x), rows)
        sizes[spec] = len(payload)
        err = np.abs(out - x)
        if spec == "fp32":
            check(np.array_equal(out, x), "fp32 is not exact")
        elif bound is not None:
            # fp16 rounds values below 2^-14 on its subnormal grid (steps of 2^-24).
            check(np.all(err <= bound * np.abs(x) + 2.0 ** -25), f"{spec}: error above its bound")
        elif spec.startswith("int"):
            levels = 127 if spec.startswith("int8") else 7
            blocks_x = x.reshape(-1, 128)
            scale = np.abs(blocks_x).max(axis=1, keepdims=True) / levels
            check(np.all(err.reshape(-1, 128) <= scale / 2 * (1 + 1e-6) + 1e-12),
                  f"{spec}: error above half a step")
        else:
            k = int(np.ceil(float(spec.split(":")[1].split("+")[0]) * n))
            kept = np.nonzero(out)[0]
            check(len(kept) <= k and np.array_equal(out[kept], x[kept]), f"{spec}: kept values changed")
            threshold = np.sort(np.abs(x))[-k]
            check(np.all(np.abs(x[kept]) >= threshold), f"{spec}: did not keep the largest")
    check(sizes["fp16"] * 2 == sizes["fp32"] and sizes["int8/128"] < sizes["fp32"] / 3.8
          and sizes["int4/128"] < sizes["fp32"] / 7.4 and sizes["topk:0.1"] < sizes["fp32"] / 4.9,
          f"payload sizes {sizes}")
    print(f"codecs on real activations ({rows}x{n // rows}): bytes {sizes}")
    # The wire: what int8 saves per step is exactly what its payloads save
    # (4 micro-batches of 8 x 128 activations: 4096 bytes in fp32, 1024 +
    # 8 block scales in int8); the rest of a frame (meta, targets) is the same.
    fp32 = run_staged(2, 1, "--optimizer", "local", "--steps", "10")
    int8 = run_staged(2, 1, "--optimizer", "local", "--steps", "10", "--forward", "int8/128")
    saved = fp32[(0, 0)]["bytes_forward_per_step"] - int8[(0, 0)]["bytes_forward_per_step"]
    check(abs(saved - 4 * (4096 - 1056)) <= 8, f"int8 saved {saved} bytes per step, not {4 * (4096 - 1056)}")
    # (the backward frames' meta carries the loss, whose digits vary)
    check(abs(int8[(1, 0)]["bytes_backward_per_step"] - fp32[(1, 0)]["bytes_backward_per_step"]) <= 40,
          "the fp32 backward changed size")
    ratio = int8[(0, 0)]["bytes_forward_per_step"] / fp32[(0, 0)]["bytes_forward_per_step"]
    print(f"on the wire: int8 activations {ratio:.3f} of fp32's bytes per step")


def test_aq_sgd_survives_a_restart(tmp):
    common = ["--optimizer", "local", "--steps", "20", "--forward", "int4/128+aq", "--backward", "int8+ef"]
    whole = os.path.join(tmp, "aq-whole")
    part = os.path.join(tmp, "aq-part")
    results = run_staged(2, 1, *common, "--save", whole)
    run_staged(2, 1, *common, "--save", part, "--save-at", "8")
    state = torch.load(f"{part}.stage-1")["pipeline"]
    check(state["step"] == 8 and len(state["boundaries"]["recv_forward"]["state"]) > 1000,
          "the checkpoint holds no AQ-SGD buffers")
    resumed = run_staged(2, 1, *common, "--resume", part, "--save", part + "-resumed")
    problem = same_bits([_Loaded(state) for state in saved_blocks(whole, 2)],
                        saved_blocks(part + "-resumed", 2))
    check(problem is None, f"the resumed AQ-SGD run differs from the whole one: {problem}")
    n = len(example.load_digits()[1])
    distinct = len({int(r) for step in range(20) for r in example.batch_rows(n, 0, 1, step, 32)})
    check(results[(1, 0)]["samples_seen"] == distinct == resumed[(1, 0)]["samples_seen"],
          f"AQ-SGD buffers: {results[(1, 0)]['samples_seen']} and {resumed[(1, 0)]['samples_seen']}, "
          f"{distinct} distinct samples")
    print(f"AQ-SGD: {distinct} per-sample buffers; resumed at step 8, bit-identical at step 20")
    # Restoring only one stage leaves the two ends out of step, and says so.
    procs = launch_by_hand(2, *common[2:], "--timeout", "30", per_stage=[["--resume", part], []])
    outs = [p.communicate(timeout=120)[0] for p in procs]
    check(procs[1].returncode != 0 and "FAILED_PRECONDITION" in outs[1] and "same step" in outs[1],
          "a stage restarted without its checkpoint was not refused clearly:\n" + outs[1][-2000:])
    check(procs[0].returncode != 0 and "stage 1 failed" in outs[0], "stage 0:\n" + outs[0][-2000:])
    print("a stage restarted without its checkpoint: refused (FAILED_PRECONDITION, restore every stage)")


class _Loaded:
    """A saved module state where same_bits wants a module."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


def test_data_parallel_stages(tmp):
    results = run_staged(2, 2, "--steps", "150", "--forward", "int8", "--backward", "fp16")
    for s in range(2):
        check(results[(s, 0)]["parameters_checksum"] == results[(s, 1)]["parameters_checksum"],
              f"stage {s}'s replicas differ")
    accuracy = results[(1, 0)]["test_accuracy_compressed"]
    check(accuracy > 0.9, f"test accuracy {accuracy:.3f} after 150 steps")
    print(f"2 stages x 2 replicas (Morse adam): replicas agree, test accuracy {accuracy:.3f}")


def launch_by_hand(stages, *args, per_stage=None):
    """The stages as plain processes (no morse-run, which would stop the
    others when one fails), each with --optimizer local."""
    ports = [free_port() for _ in range(stages - 1)]
    procs = []
    for s in range(stages):
        env = dict(os.environ, MORSE_STAGE=str(s), MORSE_STAGES=str(stages), MORSE_INSECURE="1")
        if s > 0:
            env["MORSE_STAGE_LISTEN"] = f"127.0.0.1:{ports[s - 1]}"
        if s < stages - 1:
            env["MORSE_STAGE_NEXT"] = f"127.0.0.1:{ports[s]}"
        own = per_stage[s] if per_stage else []
        procs.append(subprocess.Popen([sys.executable, EXAMPLE, "--optimizer", "local", *args, *own], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def test_failures_do_not_hang(tmp):
    start = time.time()
    procs = launch_by_hand(3, "--steps", "100000", "--die-at", "5", "--die-stage", "2")
    outs = [p.communicate(timeout=120)[0] for p in procs]
    took = time.time() - start
    check(procs[2].returncode == 9, "stage 2 did not die as told")
    check(procs[1].returncode != 0 and "UNAVAILABLE" in outs[1] and "next stage" in outs[1],
          "stage 1 did not fail clearly when stage 2 died:\n" + outs[1][-1500:])
    check(procs[0].returncode != 0 and "stage 1 failed" in outs[0],
          "stage 0 did not learn that stage 1 failed:\n" + outs[0][-1500:])
    print(f"a dead stage 2: stages 1 and 0 failed clearly within {took:.1f} s")

    procs = launch_by_hand(2, "--steps", "100000", "--timeout", "4")
    # Silence stage 1 once the two are connected and training (stage 0's
    # first progress line), not after a fixed sleep: on a loaded host stage
    # 1 may not listen yet, and stage 0 then fails to connect instead.
    first = []
    while True:
        line = procs[0].stdout.readline()
        first.append(line)
        if not line or line.startswith("step "):
            break
    procs[1].send_signal(signal.SIGSTOP)
    try:
        out0 = "".join(first) + procs[0].communicate(timeout=90)[0]
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate()
    check(procs[0].returncode != 0 and "DEADLINE_EXCEEDED" in out0,
          "a silent stage 1 did not time stage 0 out:\n" + out0[-1500:])
    print("a silent stage 1: stage 0 failed with DEADLINE_EXCEEDED after its timeout")


def test_wrong_use(tmp):
    part = torch.nn.Linear(4, 4)
    for kwargs, want in (({"backward": "int8+aq"}, "AQ-SGD is for activations"),
                         ({"forward": "sign1"}, "sign1"),
                         ({"forward": ["int8", "int8"]}, "2 specs for 1 boundaries")):
        try:
            pipeline.Stage(part, stage=0, stages=2, next_stage="127.0.0.1:1", **kwargs)
            check(False, f"{kwargs} was accepted")
        except ValueError as e:
            check(want in str(e), f"{kwargs}: {e}")
    # Two ends given different specs refuse each other at the handshake.
    port = free_port()
    errors = {}

    def stage(s, spec):
        try:
            pipeline.Stage(part, stage=s, stages=2, forward=spec, listen=f"127.0.0.1:{port}",
                           next_stage=f"127.0.0.1:{port}", security={"insecure": True}, timeout=20)
        except MorseError as e:
            errors[s] = str(e)

    t = threading.Thread(target=stage, args=(1, "int4"))
    t.start()
    stage(0, "int8")
    t.join()
    check("FAILED_PRECONDITION" in errors.get(1, "") and "forward" in errors.get(1, ""),
          f"stage 1: {errors.get(1)}")
    check("refused" in errors.get(0, ""), f"stage 0: {errors.get(0)}")
    schedule_stage = pipeline.Stage(part, stage=0, stages=1)
    try:
        pipeline.GPipe(schedule_stage, 2, loss_fn=None)
        check(False, "a last stage without loss_fn was accepted")
    except ValueError as e:
        check("loss_fn" in str(e), str(e))
    print("wrong use: refused with clear messages")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for test in (test_wrong_use, test_matches_one_process, test_codecs_on_real_activations,
                     test_aq_sgd_survives_a_restart, test_data_parallel_stages, test_failures_do_not_hang):
            test(tmp)
    print("PASS")
