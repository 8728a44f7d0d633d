"""Node-local aggregation: one Morse worker per node (morse-run
--node-aggregation; issue 37, part 1).

The L ranks of a node form a local group (gloo, through torch.distributed;
tensors on a GPU are staged through the host). Each step every rank sends
its flat gradient to the node's leader (local rank 0), which averages them
in local-rank order, (sum of ranks 0, 1, ..., L-1, then / L), steps as the
node's one Morse worker (rank = the node, N = nodes) and sends the new
parameters back to the node. The shards see one push per node per
partition, so the node's link carries one worker's payload instead of L;
only the leader holds m, v and the error buffers. Every rank of the node
ends each step with the leader's bits, and the job is bit-identical to the
simulator with N = nodes fed the nodes' averaged gradients.

With --node-aggregation=sharded the node's optimizer state is sharded over
its ranks instead (ZeRO stage 1 inside the node): the trained parameters
are cut into L slices of whole parameters (`slices`), and local rank k
owns slice k. Each slice is a Morse job of its own, with its own shards,
whose N = nodes workers are the nodes' local ranks k. Each step every rank
sends each slice's gradients to its owner (a reduce to the owner, summed in
local-rank order), each owner steps its slice as its node's worker, and
each broadcasts its slice's new parameters to the node. A rank holds m, v
and the error buffers of its slice alone, and every slice's job is
bit-identical to the simulator with N = nodes over that slice.
"""
import atexit
import datetime
import os
import pickle

import torch

from .._native import MorseError


def flat_grads(params):
    """The parameters' gradients one after another (zeros where one has
    none), as a rank sends them to the rank that steps for them."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                      for p in params])


def node_of_job(rank, world):
    """This rank's NodeGroup under morse-run --node-aggregation, from
    LOCAL_RANK, LOCAL_WORLD_SIZE, MORSE_NNODES and MORSE_NODE_RANK (or
    torchrun's GROUP_RANK)."""
    from . import _env
    local_size = _env("LOCAL_WORLD_SIZE", None, int)
    nnodes = _env("MORSE_NNODES", None, int)
    if world != local_size * nnodes:
        raise MorseError(f"INVALID_ARGUMENT: node aggregation with {world} ranks, but "
                         f"{nnodes} nodes of {local_size}")
    return NodeGroup(rank, _env("LOCAL_RANK", None, int), local_size,
                     _env("MORSE_NODE_RANK", None, int, torchrun="GROUP_RANK"), nnodes)


class NodeGroup:
    """This rank's node: its group, its leader, and the step's exchanges.

    The group is the node's own gloo process group (torch's
    ProcessGroupGloo over a FileStore at MORSE_NODE_STORE, a file in
    morse-run's folder, new for each start of the node),
    not a subgroup of torch.distributed's world: a node whose ranks are
    restarted (--rank-restarts) forms it again alone while the other nodes
    wait in the shards' exchange, and the script's own torch.distributed
    group, if it makes one, is left to it."""

    def __init__(self, rank, local_rank, local_size, node, nnodes):
        import torch.distributed as dist
        if not dist.is_available():
            raise MorseError("FAILED_PRECONDITION: node aggregation needs torch.distributed, which "
                             "this torch lacks")
        if local_size * nnodes < 1 or rank != node * local_size + local_rank:
            raise MorseError(
                f"INVALID_ARGUMENT: node aggregation needs ranks laid out node by node (as "
                f"morse-run does): rank {rank} is local rank {local_rank} of {local_size} on node "
                f"{node} of {nnodes}")
        path = os.environ.get("MORSE_NODE_STORE", "")
        if not path:
            raise MorseError("FAILED_PRECONDITION: node aggregation needs MORSE_NODE_STORE (a file "
                             "on this host where the node's ranks meet, new for each start of the "
                             "node; morse-run sets it)")
        timeout = datetime.timedelta(seconds=float(os.environ.get("MORSE_NODE_TIMEOUT", "1800")))
        store = dist.FileStore(path, local_size)
        store.set_timeout(timeout)
        self._store = store
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"morse-node-{node}", store), local_rank,
                                        local_size, timeout)
        self.dist = dist
        # Let go of the group while the interpreter is whole: the gradient
        # hooks (overlap) keep the optimizer, and with it the group, alive
        # until the end, where gloo's threads would otherwise be torn down
        # unjoined (std::terminate).
        atexit.register(self.close)
        self.rank, self.local_rank, self.size = rank, local_rank, local_size
        self.node, self.nnodes = node, nnodes
        self.leader = node * local_size
        self.is_leader = local_rank == 0
        self.checksum = None  # the leader's, after the last step
        self.members = None  # the nodes the last step averaged (None: every node)
        self.steps = 0

    def close(self):
        """Ends this rank's part in the node's group (at exit)."""
        self.pg = None
        self._store = None

    def _wait(self, work):
        """Waits for one of the group's operations; a rank of the node gone
        (its connection reset, or the group's timeout) is a MorseError
        that says so, not gloo's own words alone."""
        try:
            work.wait()
        except RuntimeError as e:
            self._wait_failed(e)

    def _wait_failed(self, e):
        raise MorseError(f"UNAVAILABLE: node {self.node}'s group lost a rank (local rank "
                         f"{self.local_rank} of {self.size} here): {e}; the node's ranks share "
                         "its step, so they stop with it (morse-run restarts the node with "
                         "--rank-restarts, or an elastic job goes on without it)") from e

    def _broadcast(self, tensor, owner):
        opts = self.dist.BroadcastOptions()
        opts.rootRank = owner
        self._wait(self.pg.broadcast([tensor], opts))

    def objects(self, value):
        """Every local rank's picklable `value`, by local rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        sizes = [[torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]]
        self._wait(self.pg.allgather(sizes, [torch.tensor([data.numel()], dtype=torch.int64)]))
        most = max(int(t) for t in sizes[0])
        padded = torch.zeros(most, dtype=torch.uint8)
        padded[:data.numel()] = data
        parts = [[torch.empty(most, dtype=torch.uint8) for _ in range(self.size)]]
        self._wait(self.pg.allgather(parts, [padded]))
        return [pickle.loads(part[:int(n)].numpy().tobytes()) for part, n in zip(parts[0], sizes[0])]

    def share(self, flat, owner=0):
        """Every rank of the node takes local rank `owner`'s `flat` values."""
        host = flat.detach().cpu() if flat.is_cuda else flat.detach()
        if not host.is_contiguous():
            host = host.contiguous()
        self._broadcast(host, owner)
        if host.data_ptr() != flat.data_ptr():
            with torch.no_grad():
                flat.copy_(host)

    def _mean(self, parts, end=None):
        """The node's average of the ranks' `parts` (each [:end]), summed in
        local-rank order, so that every run sums alike: ((g0 + g1) + ...) / L."""
        total = parts[0][:end].clone()
        for part in parts[1:]:
            total += part[:end]
        total /= self.size
        return total

    def gather_async(self, values, owner):
        """Starts sending `values` (host float32, not written again) to
        local rank `owner`; collect() waits for it and returns the node's
        average there (None elsewhere). Every rank of the node starts the
        same gathers in the same order (a bucket of the step's gradient,
        during backward(); see _MorseOptimizer._node_bucket_ready)."""
        owns = self.local_rank == owner
        parts = [[torch.empty_like(values) for _ in range(self.size)]] if owns else []
        opts = self.dist.GatherOptions()
        opts.rootRank = owner
        try:
            work = self.pg.gather(parts, [values], opts)
        except RuntimeError as e:
            self._wait_failed(e)
        return work, parts

    def collect(self, handle):
        work, parts = handle
        self._wait(work)
        return self._mean(parts[0]) if parts else None

    def settings(self, edited, hyper, digests):
        """What average() sends beside the gradient, to every rank at once
        (one all-gather, after the step's buckets): whether this rank
        `edited` its gradients after they left, its (a, b) pairs and its
        digest of each slice's parameters (`digests`, by slice: None where
        it wrote none). Returns whether any rank edited, every rank's
        pairs and, by slice, every rank's digest."""
        values = [1.0 if edited else 0.0] + _packed(hyper, None)[:-5]
        for digest in digests:
            values += _packed((), digest)
        mine = torch.tensor(values, dtype=torch.float32)
        got = [[torch.empty_like(mine) for _ in range(self.size)]]
        self._wait(self.pg.allgather(got, [mine]))
        rows = [[float(f) for f in t.tolist()] for t in got[0]]
        k = 2 * len(hyper)
        pairs = [_unpacked(row[1:1 + k] + [0.0] * 5)[0] for row in rows]
        by_slice = [[_unpacked(row[1 + k + 5 * n:1 + k + 5 * n + 5])[1] for row in rows]
                    for n in range(len(digests))]
        return any(row[0] != 0 for row in rows), pairs, by_slice

    def average(self, flat_grad, hyper, digest=None, owner=0):
        """Sends this rank's gradient, (lr, weight_decay) pairs (one per
        parameter group) and `digest` (a 64-bit hash of its parameters
        where it changed them since the last step, else None) to local rank
        `owner` (the leader, or a slice's owner); there returns the node's
        average (host), every rank's pairs and every rank's digest,
        elsewhere (None, None, None)."""
        values = _packed(hyper, digest)
        k = len(values)
        mine = torch.cat([flat_grad.detach().reshape(-1).cpu().float(),
                          torch.tensor(values, dtype=torch.float32)])
        owns = self.local_rank == owner
        parts = [[torch.empty_like(mine) for _ in range(self.size)]] if owns else []
        opts = self.dist.GatherOptions()
        opts.rootRank = owner
        self._wait(self.pg.gather(parts, [mine], opts))
        if not owns:
            return None, None, None
        parts = parts[0]
        total = self._mean(parts, -k)
        pairs, digests = [], []
        for part in parts:
            pair, digest = _unpacked([float(f) for f in part[-k:].tolist()])
            pairs.append(pair)
            digests.append(digest)
        return total, pairs, digests

    def finish(self, failure=None, checksum=None, buffers=None, members=None):
        """The leader's outcome of the step to the node: (failure, checksum,
        buffers, members: the nodes the step averaged) broadcast; returns
        what the leader sent."""
        outcome = self.objects((failure, checksum, buffers, members) if self.is_leader else None)[0]
        self.steps += 1
        self.checksum = outcome[1]
        self._learn_members([outcome[3]])
        return outcome

    def finish_all(self, failure=None, checksum=None, buffers=None, members=None):
        """Every rank's outcome of the step to every rank of the node (each
        owner stepped its slice): [(failure, checksum, buffers, members)]
        by local rank."""
        outcomes = self.objects((failure, checksum, buffers, members))
        self.steps += 1
        self._learn_members([o[3] for o in outcomes])
        return outcomes

    def _learn_members(self, by_job):
        """The nodes every job of the node (the leader's, or each slice's)
        averaged in the step: an elastic job's steps may leave nodes out."""
        known = [set(m) for m in by_job if m is not None]
        if known:
            self.members = sorted(set.intersection(*known))

    def member_ranks(self, nodes=None):
        """The ranks of `nodes`, by default those the last step averaged
        (every node before the first step), ascending."""
        if nodes is None:
            nodes = range(self.nnodes) if self.members is None else self.members
        return [n * self.size + k for n in nodes for k in range(self.size)]


def _packed(hyper, digest):
    """(a, b) pairs and a digest as float32-exact values: the pairs, then
    the digest as a flag and four 16-bit pieces."""
    values = [v for pair in hyper for v in pair]
    return values + ([0.0] * 5 if digest is None else [1.0] + [
        float((digest >> shift) & 0xFFFF) for shift in (0, 16, 32, 48)])


def _unpacked(v):
    """_packed's (pairs, digest) from its values."""
    k = len(v)
    pairs = tuple(zip(v[0:k - 5:2], v[1:k - 5:2]))
    digest = None if v[k - 5] == 0 else sum(int(piece) << shift
                                            for piece, shift in zip(v[k - 4:], (0, 16, 32, 48)))
    return pairs, digest


def buckets(sizes, starts, elems):
    """The node's gathers during backward() (a rank's hooks start each
    once its gradients are final, in this order on every rank): the
    parameters of `sizes` from the last to the first, as backward()
    reaches them, in buckets of at least `elems` elements, none across a
    slice (`starts`: each slice's first parameter and len(sizes) at the
    end, as slices() gives; [0, len(sizes)] when the leader steps for the
    whole node). Returns [(slice, [parameter indices])]."""
    out = []
    for k in reversed(range(len(starts) - 1)):
        run, total = [], 0
        for j in reversed(range(starts[k], starts[k + 1])):
            run.append(j)
            total += sizes[j]
            if total >= elems:
                out.append((k, run))
                run, total = [], 0
        if run:
            out.append((k, run))
    return out


def slices(sizes, count):
    """Cuts parameters of `sizes` elements (in order) into `count` runs of
    whole parameters, each at least one, as even in elements as may be: the
    cut after slice k falls on the parameter boundary nearest k+1 count-ths
    of the total. Returns the index of each slice's first parameter, and
    len(sizes) at the end."""
    if len(sizes) < count:
        raise MorseError(f"INVALID_ARGUMENT: --node-aggregation=sharded cuts the trained "
                         f"parameters into {count} slices of whole parameters, one per local "
                         f"rank, but there are {len(sizes)}: use fewer ranks per node, or "
                         "--node-aggregation (the leader holds the state)")
    total, ends = sum(sizes), [0]
    running = [0]
    for n in sizes:
        running.append(running[-1] + n)
    for k in range(1, count):
        target = total * k / count
        lo, hi = ends[-1] + 1, len(sizes) - (count - k)
        ends.append(min(range(lo, hi + 1), key=lambda i: (abs(running[i] - target), i)))
    return ends + [len(sizes)]
