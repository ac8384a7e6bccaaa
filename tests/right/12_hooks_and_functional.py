"""Tensor-parallel MLP with a gradient hook for the input's all-reduce and a functional
collective (waited on inside an autograd Function) for the output's; blocks from torch.chunk,
flattened to 2-D for the matmuls."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


def _my_chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
    world = dist.get_world_size()
    if t.shape[dim] % world:
        raise ValueError(f"cannot split {t.shape[dim]} features over {world} ranks")
    return t.detach().chunk(world, dim=dim)[dist.get_rank()].clone()


def _sum_grad(grad: torch.Tensor) -> torch.Tensor:
    total = grad.contiguous().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        return funcol.all_reduce(partial.contiguous(), "sum", dist.group.WORLD).wait()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]) @ weight.T
    if bias is not None:
        flat = flat + bias
    return flat.reshape(*x.shape[:-1], weight.shape[0])


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(_my_chunk(full.weight, 0))
        self.register_parameter("bias", None if full.bias is None else nn.Parameter(_my_chunk(full.bias, 0)))

    def forward(self, x):
        if x.requires_grad:
            x = x.view_as(x)  # a fresh node, so the hook sees only this layer's share of x's gradient
            x.register_hook(_sum_grad)
        return _linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(_my_chunk(full.weight, 1))
        self.register_parameter("bias", None if full.bias is None else nn.Parameter(full.bias.detach().clone()))

    def forward(self, x):
        y = _SumOverRanks.apply(_linear(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1, self.act, self.fc2 = ColumnParallelLinear(fc1), nn.GELU(), RowParallelLinear(fc2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
