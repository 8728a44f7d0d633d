"""Node-local aggregation: one Morse worker per node (morse-run
--node-aggregation; issue 37, part 1, first cut).

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
"""
import atexit

import torch

from .._native import MorseError


def _destroy_process_group(dist):
    if dist.is_initialized():
        dist.destroy_process_group()


class NodeGroup:
    """This rank's node: its group, its leader, and the step's exchanges."""

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
        if not dist.is_initialized():
            # env://: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (morse-run).
            dist.init_process_group("gloo")
            # Ours to tear down, while the interpreter still runs: torch 1.13
            # can abort a process whose gloo groups are left to exit().
            atexit.register(_destroy_process_group, dist)
        if dist.get_rank() != rank or dist.get_world_size() != local_size * nnodes:
            raise MorseError(
                f"FAILED_PRECONDITION: torch.distributed has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, Morse rank {rank} of {local_size * nnodes}")
        self.dist = dist
        # new_group is collective: every rank makes every node's, in order.
        for n in range(nnodes):
            group = dist.new_group(ranks=list(range(n * local_size, (n + 1) * local_size)),
                                   backend="gloo")
            if n == node:
                self.group = group
        self.rank, self.local_rank, self.size = rank, local_rank, local_size
        self.node, self.nnodes = node, nnodes
        self.leader = node * local_size
        self.is_leader = local_rank == 0
        self.checksum = None  # the leader's, after the last step
        self.steps = 0

    def share(self, flat):
        """Every rank of the node takes the leader's `flat` values."""
        host = flat.detach().cpu() if flat.is_cuda else flat.detach()
        if not host.is_contiguous():
            host = host.contiguous()
        self.dist.broadcast(host, src=self.leader, group=self.group)
        if host.data_ptr() != flat.data_ptr():
            with torch.no_grad():
                flat.copy_(host)

    def average(self, flat_grad, hyper, digest=None):
        """Sends this rank's gradient, (lr, weight_decay) pairs (one per
        parameter group trained apart) and `digest` (a 64-bit hash of its
        parameters where it changed them since the last step, else None) to
        the leader; on the leader returns the node's average (host), every
        rank's pairs and every rank's digest, elsewhere (None, None,
        None)."""
        values = [v for pair in hyper for v in pair]
        # The digest as a flag and four 16-bit pieces, each exact in fp32.
        values += [0.0] * 5 if digest is None else [1.0] + [
            float((digest >> shift) & 0xFFFF) for shift in (0, 16, 32, 48)]
        k = len(values)
        mine = torch.cat([flat_grad.detach().reshape(-1).cpu().float(),
                          torch.tensor(values, dtype=torch.float32)])
        parts = [torch.empty_like(mine) for _ in range(self.size)] if self.is_leader else None
        self.dist.gather(mine, gather_list=parts, dst=self.leader, group=self.group)
        if not self.is_leader:
            return None, None, None
        total = parts[0][:-k].clone()
        for part in parts[1:]:
            total += part[:-k]  # in local-rank order, so every run sums alike
        total /= self.size
        pairs, digests = [], []
        for part in parts:
            v = [float(f) for f in part[-k:].tolist()]
            pairs.append(tuple(zip(v[0:k - 5:2], v[1:k - 5:2])))
            digests.append(None if v[k - 5] == 0 else
                           sum(int(piece) << shift for piece, shift in zip(v[k - 4:], (0, 16, 32, 48))))
        return total, pairs, digests

    def finish(self, failure=None, checksum=None, buffers=None):
        """The leader's outcome of the step to the node: (failure, checksum,
        buffers) broadcast; returns what the leader sent."""
        message = [(failure, checksum, buffers)] if self.is_leader else [None]
        self.dist.broadcast_object_list(message, src=self.leader, group=self.group)
        self.steps += 1
        self.checksum = message[0][1]
        return message[0]
