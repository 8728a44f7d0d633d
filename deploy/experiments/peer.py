"""What the experiments' peers (ddp_peer.py, onebit_peer.py) share: their
command line and joining the gloo process group."""
import argparse

import torch
import torch.distributed as dist


def start(description, add_arguments=None):
    """Parses --rank --world --master --dim --steps (and what add_arguments
    adds), uses one thread, joins the gloo group; returns the arguments."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    if add_arguments is not None:
        add_arguments(p)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world)
    return a
