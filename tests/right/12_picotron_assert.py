"""Tensor-parallel MLP in the style of picotron: the group's rank and size kept on the layer, the split
checked with assert (as picotron and Megatron's ensure_divisibility do, instead of a ValueError), the
shard taken with Tensor.split, and f and g named after the regions they enter and leave."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


class ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.tp_world_size = dist.get_world_size()
        self.tp_rank = dist.get_rank()
        assert full.out_features % self.tp_world_size == 0, \
            "Hidden dimension must be divisible by the tensor parallel world size"
        self.output_size_per_partition = full.out_features // self.tp_world_size
        shards = full.weight.detach().split(self.output_size_per_partition, dim=0)
        self.weight = nn.Parameter(shards[self.tp_rank].clone())
        if full.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(full.bias.detach().split(self.output_size_per_partition)[self.tp_rank].clone())

    def forward(self, x):
        return F.linear(CopyToModelParallelRegion.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        self.tp_world_size = dist.get_world_size()
        self.tp_rank = dist.get_rank()
        assert full.in_features % self.tp_world_size == 0, \
            "Hidden dimension must be divisible by the tensor parallel world size"
        self.input_size_per_partition = full.in_features // self.tp_world_size
        shards = full.weight.detach().split(self.input_size_per_partition, dim=1)
        self.weight = nn.Parameter(shards[self.tp_rank].clone())
        if full.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        out = ReduceFromModelParallelRegion.apply(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1)
        self.fc2 = RowParallelLinear(fc2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
