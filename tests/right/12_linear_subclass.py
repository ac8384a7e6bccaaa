"""Each parallel layer is an nn.Linear of the block's size whose weight is overwritten with the
block; the MLP is built from them with an nn.GELU module; world size and rank asked of the group."""

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        work = dist.all_reduce(grad, async_op=True)
        work.wait()
        return grad


class _AllReduceOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.detach().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def _bounds(n: int) -> tuple[int, int]:
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank, left = divmod(n, world)
    if left:
        raise ValueError(f"{n} features cannot be split evenly over {world} ranks")
    return rank * per_rank, per_rank


class ColumnParallelLinear(nn.Linear):
    def __init__(self, full: nn.Linear):
        start, size = _bounds(full.out_features)
        super().__init__(full.in_features, size, bias=full.bias is not None,
                         device=full.weight.device, dtype=full.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(full.weight.narrow(0, start, size))
            if self.bias is not None:
                self.bias.copy_(full.bias.narrow(0, start, size))

    def forward(self, x):
        return super().forward(_AllReduceGradient.apply(x))


class RowParallelLinear(nn.Linear):
    def __init__(self, full: nn.Linear):
        start, size = _bounds(full.in_features)
        super().__init__(size, full.out_features, bias=full.bias is not None,
                         device=full.weight.device, dtype=full.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(full.weight.narrow(1, start, size))
            if self.bias is not None:
                self.bias.copy_(full.bias)

    def forward(self, x):
        out = _AllReduceOutput.apply(nn.functional.linear(x, self.weight))
        if self.bias is not None:
            out = out + self.bias
        return out


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1)
        self.gelu = nn.GELU()
        self.fc2 = RowParallelLinear(fc2)

    def forward(self, x):
        return self.fc2(self.gelu(self.fc1(x)))
