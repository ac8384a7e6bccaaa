"""Exercise 00, the template, solved."""

import torch
import torch.distributed as dist


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()  # all_reduce sums in place
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out
