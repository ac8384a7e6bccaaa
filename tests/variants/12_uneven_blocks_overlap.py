"""Exercise 12, wrong on purpose: a feature count the world size does not divide is "handled" with
equal blocks of ceil(n / W) features, the last block moved back to stay in range. Nothing raises,
but the blocks overlap: the features they share count twice in the row-parallel sum."""
# expect-fail: uneven-refused
# expect-pass: mlp-output weight-grads column-output row-output

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        # all_reduce writes in place: reduce a copy, not a tensor autograd handed us.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)
        return grad


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        # Every rank already holds the whole output's gradient.
        return grad


def rank_block(n: int, name: str) -> slice:
    """This rank's block of n features: equal blocks of ceil(n / W), the last one moved back so that it
    stays inside the n features."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    size = math.ceil(n / world_size)
    start = min(rank * size, n - size)
    return slice(start, start + size)


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        rows = rank_block(full.out_features, "out_features")
        # .clone(): a slice is a view that would keep the whole weight alive.
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x):
        x = CopyToParallelRegion.apply(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        columns = rank_block(full.in_features, "in_features")
        self.weight = nn.Parameter(full.weight.detach()[:, columns].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        output = ReduceFromParallelRegion.apply(F.linear(x, self.weight))
        # After the sum, so that the bias is added once and not once per rank.
        if self.bias is not None:
            output = output + self.bias
        return output


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1)
        self.fc2 = RowParallelLinear(fc2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
