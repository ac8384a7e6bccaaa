"""Tensor-parallel MLP that also takes feature counts the world size does not divide: the blocks come
from torch.tensor_split (the first n % W ranks one feature more), as DTensor's uneven shards do,
so nothing is refused; the row layer's input block is whatever width its weight has."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def my_block(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's contiguous block along dim, in rank order; blocks differ by one feature at most."""
    blocks = torch.tensor_split(tensor.detach(), dist.get_world_size(), dim=dim)
    return blocks[dist.get_rank()].clone()


class _F(torch.autograd.Function):
    """In front of the column-parallel layer: the gradient of x is the sum of every rank's term."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _G(torch.autograd.Function):
    """After the row-parallel product: the output is the sum of every rank's term."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(my_block(full.weight, 0))
        self.bias = nn.Parameter(my_block(full.bias, 0)) if full.bias is not None else None

    def forward(self, x):
        return F.linear(_F.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(my_block(full.weight, 1))
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x):
        y = _G.apply(x @ self.weight.T)
        if self.bias is not None:
            y = y + self.bias
        return y


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1)
        self.fc2 = RowParallelLinear(fc2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
