"""Shared by the Python tests: run this test file as N workers under
morse-run, and small helpers. Tests run with Debian's /usr/bin/python3 and
PYTHONPATH pointing at the built morse package (ctest sets it)."""
import contextlib
import glob
import json
import os
import subprocess
import time
import sys


def morse_run(script, workers, servers, *args, config=None, timeout=300, extra=()):
    command = [os.environ["MORSE_RUN"], "--servers", str(servers), "--workers", str(workers)]
    if config:
        command += ["--config", config]
    command += list(extra)
    command += ["--", sys.executable, script, "--worker", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=timeout, text=True)
    return result.returncode, result.stdout


def shard_pid(config, shard):
    """The morse-server of this job's shard (its command line names the
    job's own config file, so no other job's server matches)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if (argv and argv[0].endswith(b"morse-server") and config.encode() in argv
                and b"--shard" in argv and argv[argv.index(b"--shard") + 1] == str(shard).encode()):
            return int(pid)
    return None


def check(condition, message):
    if not condition:
        print("FAIL:", message)
        sys.exit(1)


def expect(exception, words, call):
    """call() raises `exception` with `words` in its message (printed)."""
    try:
        call()
    except exception as e:
        check(words in str(e), f"{exception.__name__} without '{words}': {e}")
        print(f"ok: {exception.__name__}: {e}")
        return
    check(False, f"no {exception.__name__} ({words})")


@contextlib.contextmanager
def shown_on_failure(log):
    """A job's output (`log`), printed only if a check inside fails, after
    that check's FAIL line: where only the head of a failing test's output
    is kept (CI's excerpt), the reason comes before the long log."""
    try:
        yield
    except SystemExit as e:
        if e.code:
            print(f"the job's output:\n{log}", flush=True)
        raise


def modes_of(parts):
    """The modes a test script runs: those of each part named on its
    command line (a name that is no part is a mode of its own), or every
    part's. `parts` maps each part's name to its modes; ctest runs each part
    as a test of its own (tests/python/CMakeLists.txt)."""
    return [m for arg in sys.argv[1:] or list(parts) for m in parts.get(arg, [arg])]


def has_cuda(what):
    """Whether torch sees a GPU; where it does not, says that `what` is
    skipped (this part only), and why."""
    import torch
    if torch.cuda.is_available():
        return True
    print(f"SKIPPED (this part only): {what}; no GPU here (torch {torch.__version__}: "
          "torch.cuda.is_available() is False)")
    return False


def flat_layout(opt, model, tensors):
    """One tensor per parameter of `model` (its weights or gradients) as the
    simulator takes them: concatenated, or, with parameter groups trained
    apart, laid out as the optimizer's flat buffer (groups in order, padding
    zero)."""
    import torch
    if not getattr(opt, "_groups_apart", False):
        return torch.cat([t.reshape(-1) for t in tensors])
    where = {id(p): r for p, r in zip(opt._params, opt._ranges)}
    flat = torch.zeros(opt._flat.numel())
    for p, t in zip(model.parameters(), tensors):
        begin, end = where[id(p)]
        flat[begin:end] = t.reshape(-1)
    return flat


def train_recorded(opt, model, out, steps, features, classes, on_gradient=None, on_step=None,
                   record_hypers=False, first=0, name="checksums"):
    """This rank (MORSE_RANK) trains `model` with `opt` for `steps` steps of
    cross-entropy on 8 random samples of `features` inputs and `classes`
    labels, drawn from seed 100 * step + rank, and writes to `out` what
    check_ranks_match_simulator reads: rank 0 the job (job.json: base config
    and overrides) and x0.npy, every rank grad-<rank>-<step>.npy and
    checksums-<rank>.json. on_gradient(step, flat) sees each step's
    gradient before step(), on_step(step) runs after it. With parameter
    groups trained apart, x0 and the gradients are laid out as the
    optimizer's flat buffer (groups in order, padding zero) and rank 0 also
    writes each step's groups' (lr, weight_decay) to hypers.json; with
    record_hypers, what each step sent instead, betas and eps included
    where it sent them (a scheduler that changes lr or betas). first > 0:
    steps first..steps-1 of a run that goes on (or resumed), the job and
    x0 not written, the checksums to <name>-<rank>.json. Returns the
    checksums."""
    import numpy as np
    import torch
    rank = int(os.environ["MORSE_RANK"])
    grouped = getattr(opt, "_groups_apart", False)

    if rank == 0 and first == 0:
        with open(os.environ["MORSE_CONFIG"]) as f:
            base = f.read()
        json.dump({"base": base, "overrides": opt.job_overrides}, open(f"{out}/job.json", "w"))
        np.save(f"{out}/x0.npy", flat_layout(opt, model, [p.detach() for p in model.parameters()]).numpy())
    checksums, hypers = [], []
    for step in range(first, steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, features, generator=g), torch.randint(0, classes, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        # A parameter the loss did not reach has no .grad once torch 2's
        # zero_grad sets it to None; missing_grads="zero" trains it on zeros.
        flat = flat_layout(opt, model, [p.grad if p.grad is not None else torch.zeros_like(p)
                                        for p in model.parameters()])
        np.save(f"{out}/grad-{rank}-{step}.npy", flat.numpy())
        if on_gradient is not None:
            on_gradient(step, flat)
        if grouped and not record_hypers:
            hypers.append(opt._group_hyper())
        opt.step()
        if record_hypers:  # what the step's pushes carried
            moments = opt._sent_moments or [()] * len(opt._sent_hyper)
            hypers.append([(*h, *m) for h, m in zip(opt._sent_hyper, moments)])
        checksums.append(opt.checksum())
        if on_step is not None:
            on_step(step)
    json.dump(checksums, open(f"{out}/{name}-{rank}.json", "w"))
    if (grouped or record_hypers) and rank == 0 and first == 0:
        json.dump(hypers, open(f"{out}/hypers.json", "w"))
    return checksums


def clip_each_step(model, max_norm):
    """train_recorded's on_gradient for a script that calls
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) after
    every backward(); each step's gradient norm must be above 2 * max_norm,
    so that the clip acts."""
    import torch

    def clip(step, flat):
        check(flat.norm().item() > 2 * max_norm, f"step {step}: the clip would not act")
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return clip


def one_cycle(opt, steps):
    """train_recorded's on_step for a script under torch's OneCycleLR as
    users build it (lr up and down, betas[0] the other way: its default
    cycle_momentum), and a function to call after training that checks
    betas[0] took a new value in all but 2 of the steps."""
    import torch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=steps)
    betas = []

    def on_step(step):
        betas.append(opt.param_groups[0]["betas"][0])
        sched.step()

    def check_moved():
        check(len(set(betas)) >= steps - 2, f"OneCycleLR moved betas[0] in too few steps: {betas}")
    return on_step, check_moved


def check_one_cycle_hypers(out, steps):
    """What the pushes of a job under one_cycle() carried (hypers.json): each
    of two groups' lr, weight_decay, betas and eps, the first group's beta2
    0.99, the second's eps 1e-6, and betas[0] changing every step but 2."""
    with open(f"{out}/hypers.json") as f:
        hypers = json.load(f)
    check(all(len(h) == 2 and len(h[0]) == 5 for h in hypers)
          and hypers[3][0][3] == 0.99 and hypers[3][1][4] == 1e-6
          and len({h[0][2] for h in hypers}) >= steps - 2,
          f"the pushes' betas and eps: {hypers}")


def clip_in_job(out, max_norm):
    """Adds clip_grad_norm: max_norm to the job train_recorded wrote to
    `out`, for the simulator: the script's clip_grad_norm_(..., max_norm)
    after backward() must give the bits of that setting."""
    with open(f"{out}/job.json") as f:
        job = json.load(f)
    job["overrides"] += f"\nclip_grad_norm: {max_norm!r}"
    with open(f"{out}/job.json", "w") as f:
        json.dump(job, f)


def check_ranks_match_simulator(out, ranks, steps, ranks_may_differ=False):
    """The job wrote checksums-<rank>.json (one checksum per step), job.json
    (base config and overrides), x0.npy and grad-<rank>-<step>.npy to `out`
    (train_recorded), and x-<step>.npy where the weights were changed
    before that step (x-<step>-<rank>.npy: rank's own, inside a
    zero_one_adam local interval): after every step every rank must hold the bits the
    simulator fed the same gradients (and changes) gives that rank, and, unless
    `ranks_may_differ` (zero_one_adam's local steps), rank 0's bits.
    Returns the number of steps after which all ranks agreed; removes
    `out`."""
    import numpy as np
    from morse import _native
    checksums = [json.load(open(f"{out}/checksums-{r}.json")) for r in range(ranks)]
    if not ranks_may_differ:
        for r in range(1, ranks):
            check(checksums[r] == checksums[0], f"rank {r} differs from rank 0: {checksums[r]} vs {checksums[0]}")
    job = json.load(open(f"{out}/job.json"))
    sim = _native.Simulator(job["base"], job["overrides"], np.load(f"{out}/x0.npy"))
    hypers = (json.load(open(f"{out}/hypers.json")) if os.path.exists(f"{out}/hypers.json")
              else [()] * steps)
    together = 0
    for step in range(steps):
        if os.path.exists(f"{out}/x-{step}.npy"):
            sim.replace_x(np.load(f"{out}/x-{step}.npy"))
        for r in range(ranks):  # inside a zero_one_adam interval: a rank's own
            if os.path.exists(f"{out}/x-{step}-{r}.npy"):
                sim.replace_worker_x(r, np.load(f"{out}/x-{step}-{r}.npy"))
        sim.step([np.load(f"{out}/grad-{r}-{step}.npy") for r in range(ranks)],
                 hypers=hypers[step])
        for r in range(ranks):
            check(sim.worker_checksum(r) == checksums[r][step],
                  f"step {step}: rank {r} {checksums[r][step]}, simulator {sim.worker_checksum(r)}")
        together += len({checksums[r][step] for r in range(ranks)}) == 1
    for f in glob.glob(f"{out}/*"):
        os.remove(f)
    os.rmdir(out)
    return together


def nodes(script, nnodes, nproc, out, mode, extra=(), per_node=None, timeout=240):
    """Starts one morse-run per node on this machine (node 0 last, as
    happens on real clusters), each running `script --worker out mode`;
    waits for all; returns [(exit code, output)] by node. `extra`: more
    morse-run flags, the same on every node, or a list of them by node."""
    port = free_port()
    procs = []
    for node in reversed(range(nnodes)):
        flags = extra[node] if extra and isinstance(extra[0], (list, tuple)) else extra
        command = [os.environ["MORSE_RUN"], "--nnodes", str(nnodes), "--node-rank", str(node),
                   "--nproc-per-node", str(per_node[node] if per_node else nproc),
                   "--rdzv", f"127.0.0.1:{port}", *flags,
                   "--", sys.executable, script, "--worker", out, mode]
        # A rank that dies of a signal prints where every thread was.
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
        time.sleep(0.2)
    results = []  # a node that does not end by `timeout` raises TimeoutExpired: a hang fails
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        results.append((p.returncode, text))
    return list(reversed(results))


_given_ports = set()


def free_port():
    """A port on 127.0.0.1 that was free a moment ago, below the ephemeral
    range (morse-run's choice), and that no earlier call in this process
    returned."""
    from morse.run import _free_ports
    port = _free_ports(1, taken=_given_ports)[0]
    _given_ports.add(port)
    return port


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


def cpu_grad_scaler(init_scale, growth_interval):
    """A GradScaler for CPU tensors: torch.amp.GradScaler("cpu") where
    torch has it (2.3 and later), else torch 1.13's torch.cuda.amp one,
    which runs on CUDA alone, with its CUDA kernels written out
    (_Torch113CpuScaler)."""
    import torch
    if getattr(getattr(torch, "amp", None), "GradScaler", None) is not None:
        return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    return _torch113_cpu_scaler()(init_scale, growth_interval)


def _torch113_cpu_scaler():
    """torch 1.13's GradScaler on the CPU, where it disables itself: the
    same class, its two CUDA kernels (the unscale with its check for Inf
    and NaN, the scale's update) written out in torch, as torch 2's CPU
    GradScaler computes them, and scale()'s multiplication without its
    assert of a CUDA tensor, behind morse.torch's hook of that class's
    scale(). All else (unscale_(), step(grad_scaler=) for an optimizer that
    _step_supports_amp_scaling, the per-optimizer states update() reads)
    is torch 1.13's own."""
    import collections

    import morse.torch
    import torch
    from torch.cuda.amp import grad_scaler

    class _Torch113CpuScaler(torch.cuda.amp.GradScaler):
        def __init__(self, init_scale, growth_interval):
            super().__init__(enabled=False)
            self._enabled = True
            self._init_scale, self._scale = init_scale, None
            self._growth_factor, self._backoff_factor = 2.0, 0.5
            self._growth_interval = growth_interval
            self._init_growth_tracker, self._growth_tracker = 0, None
            self._per_optimizer_states = collections.defaultdict(
                grad_scaler._refresh_per_optimizer_state)

        def scale(self, outputs):
            if morse.torch._TORCH_SCALE is None:  # not hooked (no optimizer needs to hear)
                return self._multiply(outputs)
            base = torch.cuda.amp.GradScaler.scale
            own, morse.torch._TORCH_SCALE = morse.torch._TORCH_SCALE, type(self)._multiply
            try:
                return base(self, outputs)  # morse.torch's notice, then _multiply
            finally:
                morse.torch._TORCH_SCALE = own

        def _multiply(self, outputs):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device)

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            if not bool(torch.isfinite(p.grad).all()):
                                found_inf.fill_(1.0)
                            p.grad.mul_(inv_scale)
            return {found_inf.device: found_inf}

        def update(self, new_scale=None):
            found = sum(t.item() for state in self._per_optimizer_states.values()
                        for t in state["found_inf_per_device"].values())
            if found:
                self._scale.mul_(self._backoff_factor)
                self._growth_tracker.zero_()
            elif int(self._growth_tracker) + 1 == self._growth_interval:
                self._scale.mul_(self._growth_factor)
                self._growth_tracker.zero_()
            else:
                self._growth_tracker += 1
            self._per_optimizer_states = collections.defaultdict(
                grad_scaler._refresh_per_optimizer_state)

    return _Torch113CpuScaler
