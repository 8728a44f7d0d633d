#!/usr/bin/env python3
"""A training step of a GPT-like model with each optimizer, side by side.

    tests/bench/step_bench.py [--model gpt21m] [--device cpu|cuda] [--ranks 2]
        [--shards 2] [--modes torch,onebit_adam,adam,ddp,onebit_peer] [--steps 10]

For each mode this starts `morse-run --servers S --workers N` with this
script as the ranks' command, times --steps steps after --skip untimed ones
(each step's clock stops after a device synchronize), and prints one JSON
line per mode and phase ({"bench": "step", ...}): the median step over the
steps (the slowest rank's median), its parts (forward + backward, then
optimizer.step() after the gradient is ready; for Morse, the time
backward()'s hooks spend handing partitions to Morse (send_ms) and the
encode and apply seconds the session reports) and the ratios to
torch-alone and to each peer measured in the same run. Every rank starts
its timed steps together (ranks sharing a GPU time-slice it). Modes:

  torch          torch.optim.Adam on each rank's own gradient, no
                 communication (the compute the others are compared with)
  onebit_adam    morse.torch.OneBitAdam: phases "warmup" (fp32 exchange,
                 before freeze_step) and "compression" (1-bit) timed apart
  adam           morse.torch.Adam (fp32; what every warmup step costs)
  zero_one_adam  morse.torch.ZeroOneAdam (its variance and 1-bit steps)
  onebit_lamb    morse.torch.OneBitLamb, warmup and compression
  ddp            DistributedDataParallel over gloo, fp32 all-reduce, +
                 torch.optim.Adam
  ddp_nccl       the same over NCCL (CUDA, one rank per GPU only)
  onebit_peer    DeepSpeed's compressed all-reduce for 1-bit Adam (its
                 `compressed_allreduce`: worker and server error buffers,
                 one scale per chunk, all-to-all then all-gather of packed
                 signs) over gloo, after fp32 warmup steps as DDP's

The ranks share the host's cores (torch.set_num_threads(cores / ranks)) and,
on CUDA, GPU r % count. Models: --model gpt134m (12 layers, d 768, vocab
32000, seq 256, batch 8: issue 35's GPU model), gpt21m (4 layers, d 512,
vocab 8192, seq 128, batch 8: its CPU model), tiny (for CI); or --layers,
--d-model, --vocab, --seq, --batch. --window sets the job's partitions in
flight per worker; --checkpoint-every K has shards and ranks checkpoint
every K steps. --trace-dir DIR: each Morse mode's ranks and shards
write their step timelines there (MORSE_TRACE; MODE-RANK.json and
MODE-server-S.json; tests/bench/trace_summary.py reads them).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {
    "gpt134m": dict(layers=12, d_model=768, vocab=32000, seq=256, batch=8),
    "gpt21m": dict(layers=4, d_model=512, vocab=8192, seq=128, batch=8),
    "tiny": dict(layers=2, d_model=64, vocab=512, seq=32, batch=4),
}
MODES = ("torch", "onebit_adam", "adam", "zero_one_adam", "onebit_lamb", "ddp", "ddp_nccl",
         "onebit_peer")
PEERS = ("ddp", "ddp_nccl", "onebit_peer")
MORSE = ("onebit_adam", "adam", "zero_one_adam", "onebit_lamb")
TIMES = ("step_s", "fwd_bwd_s", "opt_s", "send_s", "encode_s", "apply_s")  # per step, seconds


def gpt(torch, layers, d_model, vocab, seq):
    """Token and position embeddings, pre-norm causal transformer blocks,
    an untied output layer."""
    nn = torch.nn

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(vocab, d_model)
            self.positions = nn.Embedding(seq, d_model)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d_model, max(1, d_model // 64), 4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
                for _ in range(layers))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1),
                                 persistent=False)

        def forward(self, tokens):
            h = self.tokens(tokens) + self.positions.weight[:tokens.shape[1]]
            for block in self.blocks:
                h = block(h, src_mask=self.mask)
            return self.head(self.norm(h))

    return Gpt()


class OneBitPeer:
    """1-bit Adam with DeepSpeed's compressed all-reduce of the momentum
    (deploy/experiments/onebit_peer.py's algorithm, on torch tensors): the
    first `freeze` steps are Adam on the fp32 all-reduced gradient; then the
    momentum goes through the compressed all-reduce and v stays frozen.
    Collectives over gloo on the host (the packed signs are D/8 bytes)."""

    def __init__(self, torch, dist, params, lr, freeze):
        self.torch, self.dist = torch, dist
        self.params = list(params)
        self.lr, self.freeze, self.step_index = lr, freeze, 0
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        dim = sum(p.numel() for p in self.params)
        unit = 8 * self.world
        self.padded = (dim + unit - 1) // unit * unit
        device = self.params[0].device
        self.m = torch.zeros(self.padded, device=device)
        self.v = torch.zeros(self.padded, device=device)
        self.worker_error = torch.zeros(self.padded, device=device)
        self.server_error = torch.zeros(self.padded // self.world, device=device)
        self.weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
        self.shifts = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=device)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def pack(self, u):
        return ((u >= 0).to(self.torch.uint8).view(-1, 8) * self.weights).sum(1, dtype=self.torch.uint8)

    def unpack(self, bits, scale):
        signs = ((bits.unsqueeze(1) >> self.shifts) & 1).view(-1).to(self.torch.float32)
        return (signs * 2 - 1) * scale

    def compress(self, u, error):
        """u + error -> (packed signs, scale); error keeps what was lost."""
        u = u + error
        scale = u.norm() / (u.numel() ** 0.5)
        bits = self.pack(u)
        error.copy_(u - self.unpack(bits, scale))
        return bits, scale

    def compressed_allreduce(self, m):
        torch, dist, n = self.torch, self.dist, self.world
        bits, scale = self.compress(m, self.worker_error)
        chunks = bits.cpu().view(n, -1)
        scales = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(scales, scale.reshape(1).cpu())
        got = [chunks[j].clone() if j == self.rank else torch.empty_like(chunks[j]) for j in range(n)]
        work = []
        for j in range(n):
            if j != self.rank:
                work.append(dist.isend(chunks[j].contiguous(), j))
                work.append(dist.irecv(got[j], j))
        for w in work:
            w.wait()
        device = m.device
        mean = sum(self.unpack(got[j].to(device), float(scales[j])) for j in range(n)) / n
        server_bits, server_scale = self.compress(mean, self.server_error)
        all_bits = [torch.empty_like(chunks[0]) for _ in range(n)]
        dist.all_gather(all_bits, server_bits.cpu())
        server_scales = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(server_scales, server_scale.reshape(1).cpu())
        return torch.cat([self.unpack(all_bits[j].to(device), float(server_scales[j]))
                          for j in range(n)])

    def step(self):
        torch = self.torch
        with torch.no_grad():
            g = torch.zeros(self.padded, device=self.m.device)
            offset = 0
            for p in self.params:
                g[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                offset += p.numel()
            b1, b2 = 0.9, 0.999
            if self.step_index < self.freeze:
                self.dist.all_reduce(g)
                g /= self.world
                self.m.mul_(b1).add_(g, alpha=1 - b1)
                self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
            else:
                self.m.mul_(b1).add_(g, alpha=1 - b1)
                self.m.copy_(self.compressed_allreduce(self.m))
            update = self.m / (self.v.sqrt() + 1e-8)
            offset = 0
            for p in self.params:
                p.add_(update[offset:offset + p.numel()].view_as(p), alpha=-self.lr)
                offset += p.numel()
        self.step_index += 1


def rank_main(a):
    """One rank of one mode under morse-run: prints its timings as one JSON
    line (prefixed STEP_BENCH)."""
    import torch
    rank = int(os.environ.get("MORSE_RANK", os.environ.get("RANK", "0")))
    world = int(os.environ.get("MORSE_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if a.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = gpt(torch, a.layers, a.d_model, a.vocab, a.seq).to(device)
    params = sum(p.numel() for p in model.parameters())
    freeze = a.skip + a.steps
    total = a.skip + a.steps if a.mode in ("torch", "adam", "ddp", "ddp_nccl") else 2 * (a.skip + a.steps)
    lr = 1e-4
    dist = None
    if a.mode in ("ddp", "ddp_nccl", "onebit_peer"):
        import torch.distributed as dist
        backend = "nccl" if a.mode == "ddp_nccl" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    if a.mode == "torch":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif a.mode in ("ddp", "ddp_nccl"):
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif a.mode == "onebit_peer":
        opt = OneBitPeer(torch, dist, model.parameters(), lr, freeze)
    else:
        import morse.torch
        kwargs = dict(partition_elems=a.partition_elems) if a.partition_elems else {}
        if a.mode == "onebit_adam":
            opt = morse.torch.OneBitAdam(model, lr=lr, freeze_step=freeze, **kwargs)
        elif a.mode == "adam":
            opt = morse.torch.Adam(model, lr=lr, **kwargs)
        elif a.mode == "zero_one_adam":
            opt = morse.torch.ZeroOneAdam(model, lr=lr, var_freeze_step=freeze, var_update_scaler=1,
                                          **kwargs)
        else:
            opt = morse.torch.OneBitLamb(model, lr=lr, freeze_step=freeze, **kwargs)
    send_seconds = [0.0]
    if a.mode in MORSE:
        # The time backward()'s hooks spend handing partitions to Morse.
        send = opt._send

        def timed_send(q):
            start = time.perf_counter()
            try:
                send(q)
            finally:
                send_seconds[0] += time.perf_counter() - start

        opt._send = timed_send
    if a.mode == "torch" and world > 1:
        # Ranks sharing a device time-slice it only if they run together.
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for step in range(total):
        if dist is not None and step == a.skip:
            dist.barrier()
        send_seconds[0] = 0.0
        sync()
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, a.vocab),
                                                 targets.reshape(-1))
        loss.backward()
        sync()
        ready = time.perf_counter()
        opt.step()
        sync()
        end = time.perf_counter()
        last = getattr(opt, "last_step", None) or {}
        rows.append({"step": step, "step_s": end - start, "fwd_bwd_s": ready - start,
                     "opt_s": end - ready, "send_s": send_seconds[0], "encode_s": last.get("encode_seconds", 0.0),
                     "apply_s": last.get("apply_seconds", 0.0), "bytes_up": last.get("bytes_up", 0),
                     "loss": float(loss)})
    if a.mode in ("onebit_adam", "onebit_lamb", "onebit_peer"):
        phases = {"warmup": rows[a.skip:freeze], "compression": rows[freeze + a.skip:]}
    else:
        phases = {"all": rows[a.skip:]}
    for phase, timed in phases.items():
        out = {"rank": rank, "mode": a.mode, "phase": phase, "params": params, "steps": len(timed)}
        for key in TIMES:
            out[key] = statistics.median(r[key] for r in timed)
        out["bytes_up"] = statistics.median(r["bytes_up"] for r in timed)
        out["loss"] = timed[-1]["loss"]
        print("STEP_BENCH " + json.dumps(out), flush=True)
    if dist is not None:
        dist.destroy_process_group()


def morse_run_command():
    run = os.environ.get("MORSE_RUN")
    if run:
        return [run]
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "..", "..", "build", "bin", "morse-run"),
                      os.path.join(here, "..", "bin", "morse-run")):
        if os.path.exists(candidate):
            return [candidate]
    return ["morse-run"]


def run_mode(a, mode, shape):
    """Runs one mode under morse-run; returns its ranks' JSON lines."""
    args = [sys.executable, os.path.abspath(__file__), "--rank-mode", mode, "--device", a.device,
            "--steps", str(a.steps), "--skip", str(a.skip)]
    for key, value in shape.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    if a.partition_elems:
        args += ["--partition-elems", str(a.partition_elems)]
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if a.trace_dir and mode in MORSE:
        os.makedirs(a.trace_dir, exist_ok=True)
        env["MORSE_TRACE"] = os.path.join(a.trace_dir, f"{mode}-{{rank}}.json")
    config = []
    job_lines = ([f"window: {a.window}"] if a.window else []) + (
        [f"checkpoint {{ every_steps: {a.checkpoint_every} }}"] if a.checkpoint_every else [])
    if job_lines:
        path = os.path.join(tempfile.mkdtemp(prefix="morse-step-bench-"), "job.textproto")
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in job_lines))
        config = ["--config", path]
    command = (morse_run_command() + ["--servers", str(a.shards), "--workers", str(a.ranks)] + config
               + ["--"] + args)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=a.timeout)
    # morse-run prefixes each rank's lines with "[rank R] ".
    lines = [json.loads(line.split("STEP_BENCH ", 1)[1]) for line in done.stdout.splitlines()
             if "STEP_BENCH " in line]
    if done.returncode != 0 or len({l["rank"] for l in lines}) != a.ranks:
        sys.stderr.write(done.stdout[-4000:])
        print(f"step_bench: mode {mode} failed (exit {done.returncode}, {len(lines)} result lines) "
              f"after {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        return None
    return lines


def summarize(lines):
    """Per phase: the slowest rank's medians."""
    out = {}
    for line in lines:
        phase = out.setdefault(line["phase"], dict(line))
        for key in TIMES:
            phase[key] = max(phase[key], line[key])
    for phase in out.values():
        phase.pop("rank", None)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt21m",
                   help="preset shape (default gpt21m); the shape flags override it")
    for key in ("layers", "d_model", "vocab", "seq", "batch"):
        p.add_argument("--" + key.replace("_", "-"), type=int, help=f"the model's {key}")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks train")
    p.add_argument("--ranks", type=int, default=2, help="ranks (Morse workers) on this host")
    p.add_argument("--shards", type=int, default=2, help="Morse server shards")
    p.add_argument("--modes", default="torch,onebit_adam,adam,ddp,onebit_peer",
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per phase (default 10)")
    p.add_argument("--skip", type=int, default=3, help="untimed steps before each phase (default 3)")
    p.add_argument("--partition-elems", type=int, default=0,
                   help="Morse partition size in elements (default: the job's)")
    p.add_argument("--window", type=int, default=0,
                   help="partitions in flight per Morse worker (JobConfig window; default the engine's: 32 on the host, every partition on a GPU)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="shards and ranks checkpoint every K steps (checkpoint { every_steps: K } "
                        "in the job's config; default 0: never)")
    p.add_argument("--trace-dir", help="where each Morse mode's ranks and shards write their step "
                   "timelines (MORSE_TRACE)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per mode (default 1800)")
    p.add_argument("--rank-mode", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    a = p.parse_args()
    shape = dict(MODELS[a.model])
    for key in shape:
        if getattr(a, key) is not None:
            shape[key] = getattr(a, key)
    for key, value in shape.items():
        setattr(a, key, value)
    if a.steps < 1 or a.skip < 1:
        p.error("--steps and --skip are at least 1 (the first step joins the job)")
    if a.mode:
        return rank_main(a)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r} (of {', '.join(MODES)})")
    if "ddp_nccl" in modes and a.device != "cuda":
        p.error("ddp_nccl trains CUDA tensors: pass --device cuda")
    results, failed = {}, []
    for mode in modes:
        print(f"step_bench: {mode} ...", file=sys.stderr, flush=True)
        lines = run_mode(a, mode, shape)
        if lines is None:
            failed.append(mode)
        else:
            results[mode] = summarize(lines)
    modes = [m for m in modes if m in results]
    base = results.get("torch", {}).get("all")
    for mode in modes:
        for phase, r in results[mode].items():
            r.update({"bench": "step", "device": a.device, "ranks": a.ranks, "shards": a.shards,
                      "model": shape, "cpus": os.cpu_count()})
            if base:
                r["ratio_to_torch"] = round(r["step_s"] / base["step_s"], 3)
            for peer in PEERS:
                if peer in results and peer != mode:
                    # The peer's phase of the same name, else its only one.
                    theirs = results[peer].get(phase) or results[peer].get("all") \
                        or results[peer].get("warmup" if phase == "all" else phase)
                    if theirs:
                        r[f"ratio_to_{peer}"] = round(r["step_s"] / theirs["step_s"], 3)
    for mode in modes:
        for phase, r in results[mode].items():
            for key in TIMES:
                r[key.replace("_s", "_ms")] = round(1000 * r.pop(key), 2)
            print(json.dumps({k: r[k] for k in ["bench", "mode", "phase"] + sorted(
                set(r) - {"bench", "mode", "phase"})}), flush=True)
    if failed:
        print(f"step_bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
