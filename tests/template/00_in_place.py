"""Exercise 00, a wrong answer: the right sum, but into the caller's tensor."""

import torch
import torch.distributed as dist


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t
