"""Exercise 07, broken: lets dist.all_reduce do the work."""
# expect-fail: no-collectives

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)
