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
import warnings

import torch

from .._native import MorseError


def flat_grads(params, out=None):
    """The parameters' gradients one after another (zeros where one has
    none), as a rank sends them to the rank that steps for them; into
    `out` (a staging region, NodeGroup.staging) if given."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
             for p in params]
    if out is None:
        return torch.cat(grads)
    if out.device != grads[0].device:  # CUDA gradients into host memory: one copy
        return out.copy_(torch.cat(grads))
    return torch.cat(grads, out=out)


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
        # Shared memory (use_shared_memory): every rank's staging region
        # (`_staging`, what it sends to an owner) and outgoing region
        # (`_outgoing`, what it shares as an owner), by local rank; None:
        # the values go through gloo.
        self._staging = self._outgoing = None
        self._capacity = 0
        self._kept = {}  # by owner: how many values its last share() left in its region

    def close(self):
        """Ends this rank's part in the node's group (at exit)."""
        self.pg = None
        self._store = None
        self._staging = self._outgoing = None

    def use_shared_memory(self, elems):
        """Moves the node's gradients and parameters through shared memory
        (/dev/shm) instead of gloo's sockets, for exchanges of up to
        `elems` float32 values (larger ones, and a node where any rank
        could not map its regions, use gloo): each rank maps two regions of
        `elems` floats of its own and every other rank's, and a gloo
        message of a few bytes says when one holds a rank's values. Every
        rank of the node calls it, each with the most it will exchange (the
        node maps the largest). Returns whether the node uses it;
        MORSE_NODE_SHM=0 on any rank keeps gloo. A rank writes its
        staging region again only after a collective of the node that
        follows its owner's read (every step ends with finish(), which the
        ranks enter after the owners have read; share() ends with a
        barrier), so a region is never overwritten while being read."""
        if self.size < 2:
            return False
        wishes = self.objects((int(elems), os.environ.get("MORSE_NODE_SHM", "1") != "0"))
        elems = max(n for n, _ in wishes)
        if elems < 1 or not all(wanted for _, wanted in wishes):
            return False
        folder = os.environ.get("MORSE_NODE_SHM_DIR", "/dev/shm")
        path = os.path.join(folder, f"morse-node-{self.node}-{self.local_rank}-{os.getpid()}-"
                                    f"{os.urandom(4).hex()}")
        created, regions = False, None
        try:
            why, mine = None, None
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
                try:
                    # Reserved now: tmpfs would fault (SIGBUS) on a page it
                    # cannot give later, where this fails with ENOSPC.
                    os.posix_fallocate(fd, 0, 8 * elems)
                finally:
                    os.close(fd)
                mine = torch.from_file(path, shared=True, size=2 * elems, dtype=torch.float32)
                mine.zero_()  # its pages mapped here once, not in the first step
            except (OSError, RuntimeError) as e:
                why = f"could not map {8 * elems} bytes in {folder} ({e})"
            paths = self.objects(path if why is None else None)
            if all(paths):
                try:
                    regions = [mine if k == self.local_rank else
                               torch.from_file(other, shared=True, size=2 * elems,
                                               dtype=torch.float32)
                               for k, other in enumerate(paths)]
                except (OSError, RuntimeError) as e:
                    why = f"could not map the other ranks' regions ({e})"
            # Every rank has mapped every region (or knows why not): the
            # files can go, the mappings stay.
            whys = self.objects(why)
        finally:
            if created:
                os.unlink(path)
        failed = [(k, w) for k, w in enumerate(whys) if w is not None]
        if failed:
            if self.local_rank == 0:
                k, w = failed[0]
                warnings.warn(f"morse: node {self.node} exchanges its gradients through gloo's "
                              f"sockets, not shared memory: local rank {k} {w}; give /dev/shm "
                              "room (docker run --shm-size, an emptyDir of medium Memory on "
                              "Kubernetes), or set MORSE_NODE_SHM=0 to choose gloo",
                              RuntimeWarning, stacklevel=3)
            return False
        self._staging = [r[:elems] for r in regions]
        self._outgoing = [r[elems:] for r in regions]
        self._capacity = elems
        self._kept = {}  # (mapped again by a new layout: add_param_group)
        return True

    def staging(self, offset, n):
        """Where this rank puts `n` values to send at `offset` of the node's
        exchange (gather_async, average): its staging region there, or None
        without shared memory."""
        if self._staging is None or offset + n > self._capacity:
            return None
        return self._staging[self.local_rank][offset:offset + n]

    def _shared_at(self, values, offset):
        """`values` in this rank's staging region at `offset` (copied there
        unless staging() gave them), or None where they go through gloo."""
        region = self.staging(offset, values.numel())
        if region is not None and region.data_ptr() != values.data_ptr():
            region.copy_(values.reshape(-1))
        return region

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
        n = flat.numel()
        if self._outgoing is not None and n <= self._capacity and flat.is_contiguous():
            region = self._outgoing[owner][:n]
            if self.local_rank == owner:
                region.copy_(flat.detach().reshape(-1))
            self._broadcast(torch.zeros(1), owner)  # the owner's values are in place
            if self.local_rank != owner:
                with torch.no_grad():
                    flat.view(-1).copy_(region)
            self._wait(self.pg.barrier())  # every rank has them: the region may change again
            self._kept[owner] = n
            return
        self._kept[owner] = None
        host = flat.detach().cpu() if flat.is_cuda else flat.detach()
        if not host.is_contiguous():
            host = host.contiguous()
        self._broadcast(host, owner)
        if host.data_ptr() != flat.data_ptr():
            with torch.no_grad():
                flat.copy_(host)

    def kept(self, owner=0):
        """What local rank `owner` last share()d, where it lies in the
        owner's region of shared memory until the owner's next share() or
        differing() (read it, do not write it); None where that went through
        gloo."""
        n = self._kept.get(owner)
        return self._outgoing[owner][:n] if n else None

    def differing(self, parts, owner=0):
        """The local ranks whose float32 tensors `parts` (the same shapes
        on every rank; every rank calls it) differ bit for bit from local
        rank `owner`'s. Through shared memory the owner writes its parts to
        its region and each rank compares its own with them there; through
        gloo each rank sends a hash of its own."""
        from . import _digest_of, _same_pieces
        n = sum(t.numel() for t in parts)
        if self._outgoing is not None and n <= self._capacity:
            region = self._outgoing[owner][:n]
            if self.local_rank == owner and region.device != parts[0].device:
                region.copy_(torch.cat([t.detach().reshape(-1) for t in parts]))  # CUDA: one copy
            elif self.local_rank == owner:
                torch.cat([t.detach().reshape(-1) for t in parts], out=region)
            self._broadcast(torch.zeros(1), owner)  # the owner's values are in place
            self._kept[owner] = None
            same = self.local_rank == owner or _same_pieces(parts, [region])
            # (The owner writes its region again only after this gather,
            # which every rank enters once it has read.)
            flags = self.objects(same)
        else:
            digests = self.objects(_digest_of(parts))
            flags = [d == digests[owner] for d in digests]
        return [k for k, same in enumerate(flags) if not same]

    def _mean(self, parts, end=None):
        """The node's average of the ranks' `parts` (each [:end]), summed in
        local-rank order, so that every run sums alike: ((g0 + g1) + ...) / L."""
        if len(parts) == 1:
            total = parts[0][:end].clone()
        else:
            total = torch.add(parts[0][:end], parts[1][:end])  # g0 + g1 in one pass, no copy first
        for part in parts[2:]:
            total += part[:end]
        total /= self.size
        return total

    def _mean_staged(self, offset, n):
        """The node's average of what every rank staged at `offset`."""
        return self._mean([region[offset:offset + n] for region in self._staging])

    def gather_async(self, values, owner, offset=0):
        """Starts sending `values` (host float32, not written again) to
        local rank `owner`, at `offset` of the node's exchange (its place
        in the staging regions: the gathers in flight at once lie apart);
        collect() waits for it and returns the node's average there (None
        elsewhere). Every rank of the node starts the same gathers in the
        same order (a bucket of the step's gradient, during backward(); see
        _MorseOptimizer._node_bucket_ready)."""
        owns = self.local_rank == owner
        shared = self._shared_at(values, offset)
        sent = values if shared is None else torch.zeros(1)  # shared: only "it is there"
        parts = [[torch.empty_like(sent) for _ in range(self.size)]] if owns else []
        opts = self.dist.GatherOptions()
        opts.rootRank = owner
        try:
            work = self.pg.gather(parts, [sent], opts)
        except RuntimeError as e:
            self._wait_failed(e)
        where = None if shared is None else (offset, values.numel())
        return work, parts, where

    def collect(self, handle):
        work, parts, where = handle
        self._wait(work)
        if not parts:
            return None
        if where is not None:
            return self._mean_staged(*where)
        return self._mean(parts[0])

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

    def average(self, flat_grad, hyper, digest=None, owner=0, offset=0):
        """Sends this rank's gradient, (lr, weight_decay) pairs (one per
        parameter group) and `digest` (a 64-bit hash of its parameters
        where it changed them since the last step, else None) to local rank
        `owner` (the leader, or a slice's owner), the gradient at `offset`
        of the node's exchange (as gather_async); there returns the node's
        average (host), every rank's pairs and every rank's digest,
        elsewhere (None, None, None)."""
        values = _packed(hyper, digest)
        k = len(values)
        shared = self._shared_at(flat_grad.detach(), offset)
        if shared is not None:
            mine = torch.tensor(values, dtype=torch.float32)
        else:
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
        if shared is not None:
            total = self._mean_staged(offset, flat_grad.numel())
        else:
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

    def finish_all(self, failure=None, checksum=None, buffers=None, members=None, learned=False):
        """Every rank's outcome of the step to every rank of the node (each
        owner stepped its slice): [(failure, checksum, buffers, members,
        learned: whether it learned to show the clipped average)] by local
        rank."""
        outcomes = self.objects((failure, checksum, buffers, members, learned))
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

# Where slices() leaves a rank more than this many even shares of the
# model's elements, rank 0 says so (uneven()).
UNEVEN = 1.25


def uneven(sizes, starts, names):
    """Where slices() cut parameters of `sizes` (named `names`) unevenly:
    (slice, its elements, how many even shares that is, its largest
    parameter's name and size) for the slice that holds most, if that is
    above UNEVEN even shares; else None. A slice holds whole parameters, so
    one tensor larger than an even share (an embedding) makes its rank hold
    that much more of the node's optimizer state."""
    total = sum(sizes)
    held = [sum(sizes[starts[k]:starts[k + 1]]) for k in range(len(starts) - 1)]
    k = max(range(len(held)), key=lambda i: (held[i], -i))
    share = held[k] * len(held) / total
    if share <= UNEVEN:
        return None
    big = max(range(starts[k], starts[k + 1]), key=lambda j: (sizes[j], -j))
    return k, held[k], share, names[big], sizes[big]
