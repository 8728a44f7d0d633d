#!/usr/bin/python3
"""A peer for the experiments: DeepSpeed's compressed all-reduce for 1-bit
Adam (its `compressed_allreduce`), written from the algorithm on
torch.distributed with gloo, exchanging D elements of momentum per step.

    onebit_peer.py --rank R --world N --master HOST:PORT --dim D --steps K

Each step, on every rank:
1. worker compression: u = m + e_w; one scale s = ||u|| / sqrt(D); send
   the signs of u packed 8 per byte; e_w = u - s * sign(u);
2. all-to-all: the packed signs cut into N chunks, chunk j to rank j (gloo
   has no all_to_all: N - 1 isend/irecv pairs), and an all-gather of the N
   worker scales;
3. server compression of chunk `rank`: the average of the N decoded chunks
   plus that chunk's server error e_s, recompressed the same way (its own
   scale; e_s = v - s_s * sign(v));
4. all-gather of the N recompressed chunks and their scales; every rank
   decodes the whole buffer.
Bytes per step and rank: (N - 1)/N * D/8 out (and as many in) in each of
the two phases, plus the scales; `bytes_per_step` is what a rank sends. `step_seconds` covers all four parts;
`comm_seconds` only the time inside the collectives (2 and 4), the part
comparable with Morse's `comm_seconds` (time waiting for replies).

Prints one JSON line per step ({"step", "time", "step_seconds",
"comm_seconds", "bytes_per_step"}) on every rank. torch.set_num_threads(1), as
the DDP peer. Decoding goes through a 256-entry table of 8 signs.
"""
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import peer


# Byte b -> its 8 signs as +-1 floats, most significant bit first (the order
# of numpy's packbits).
TABLE = torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)
                         .astype(np.float32) * 2 - 1)


def pack(signs):
    """bool tensor -> uint8 tensor, 8 signs per byte (numpy's bit order)."""
    return torch.from_numpy(np.packbits(signs.numpy()))


def unpack(bits, scale):
    """uint8 tensor -> +-scale floats."""
    return TABLE[bits.long()].reshape(-1) * scale


class Clock:
    """Seconds spent inside the collectives."""
    comm = 0.0

    @classmethod
    def time(cls, fn, *args):
        start = time.time()
        out = fn(*args)
        cls.comm += time.time() - start
        return out


def compress(u):
    """One scale for the buffer (RMS), the signs, and the new error."""
    scale = u.norm() / math.sqrt(u.numel())
    signs = u >= 0
    error = u - torch.where(signs, scale, -scale)
    return scale.reshape(1), signs, error


def compressed_allreduce(m, worker_error, server_error, rank, world):
    d = m.numel()
    chunk = d // world
    scale, signs, new_error = compress(m + worker_error)
    worker_error.copy_(new_error)
    bits = pack(signs)
    per = bits.numel() // world
    parts = [bits[j * per:(j + 1) * per].contiguous() for j in range(world)]
    received = [torch.empty(per, dtype=torch.uint8) for _ in range(world)]
    requests = []
    for j in range(world):
        if j == rank:
            received[j].copy_(parts[j])
            continue
        requests.append(dist.isend(parts[j], j))
        requests.append(dist.irecv(received[j], j))
    scales = [torch.empty(1) for _ in range(world)]
    Clock.time(dist.all_gather, scales, scale)
    for r in requests:
        Clock.time(r.wait)
    average = sum(unpack(received[j], scales[j]) for j in range(world)) / world
    s_scale, s_signs, s_error = compress(average + server_error)
    server_error.copy_(s_error)
    s_bits = pack(s_signs)
    gathered = [torch.empty_like(s_bits) for _ in range(world)]
    Clock.time(dist.all_gather, gathered, s_bits)
    s_scales = [torch.empty(1) for _ in range(world)]
    Clock.time(dist.all_gather, s_scales, s_scale)
    out = torch.cat([unpack(gathered[j], s_scales[j]) for j in range(world)])
    assert out.numel() == world * chunk
    return out


def main():
    a = peer.start(__doc__.split("\n\n")[0])
    # D rounded up so that every rank's chunk is whole bytes.
    unit = 8 * a.world
    d = (a.dim + unit - 1) // unit * unit
    gen = torch.Generator().manual_seed(a.rank)
    m = torch.randn(d, generator=gen)
    worker_error = torch.zeros(d)
    server_error = torch.zeros(d // a.world)
    # Bytes this rank sends per step: (N - 1)/N of the packed signs in each
    # of the two phases (as many come in); Morse's payload_bytes_per_step is
    # likewise what a worker pushes.
    sent = 2 * (a.world - 1) * d // 8 // a.world
    for step in range(a.steps):
        start = time.time()
        Clock.comm = 0.0
        out = compressed_allreduce(m, worker_error, server_error, a.rank, a.world)
        elapsed = time.time() - start
        if not torch.isfinite(out).all():
            print("non-finite result", file=sys.stderr)
            os._exit(1)
        m.mul_(0.9).add_(out, alpha=0.1)  # the next step sends something new
        print(json.dumps({"step": step, "time": time.time(), "step_seconds": elapsed,
                          "comm_seconds": Clock.comm, "bytes_per_step": sent}), flush=True)
    sys.stdout.flush()
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
