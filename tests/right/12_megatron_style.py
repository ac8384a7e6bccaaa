"""Tensor-parallel MLP in the style of Megatron-LM's mpu: ranks from the environment, a divide()
helper, the weight allocated empty and filled from torch.split, the all-reduce of forward done in
place on the partial product (as Megatron's _reduce does), and matmul with a transposed weight."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def get_tensor_model_parallel_rank():
    return int(os.environ["RANK"])


def get_tensor_model_parallel_world_size():
    return int(os.environ["WORLD_SIZE"])


def divide(numerator, denominator):
    if numerator % denominator != 0:
        raise ValueError("{} is not divisible by {}".format(numerator, denominator))
    return numerator // denominator


def _reduce(input_):
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_)
    return input_


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output.contiguous().clone())


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def _partition(tensor, per_partition, dim):
    chunks = torch.split(tensor.detach(), per_partition, dim=dim)
    mine = chunks[get_tensor_model_parallel_rank()]
    out = torch.empty(mine.shape, dtype=tensor.dtype, device=tensor.device)
    out.copy_(mine)
    return out


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.input_size = full.in_features
        self.output_size_per_partition = divide(full.out_features, world_size)
        self.weight = nn.Parameter(_partition(full.weight, self.output_size_per_partition, 0))
        if full.bias is not None:
            self.bias = nn.Parameter(_partition(full.bias, self.output_size_per_partition, 0))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        input_parallel = _CopyToModelParallelRegion.apply(input_)
        output_parallel = torch.matmul(input_parallel, self.weight.t())
        if self.bias is not None:
            output_parallel = output_parallel + self.bias
        return output_parallel


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        world_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(full.in_features, world_size)
        self.weight = nn.Parameter(_partition(full.weight, self.input_size_per_partition, 1))
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone())
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        output_parallel = torch.matmul(input_, self.weight.t())
        output_ = _ReduceFromModelParallelRegion.apply(output_parallel)
        return output_ + self.bias if self.bias is not None else output_


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1)
        self.fc2 = RowParallelLinear(fc2)

    def forward(self, hidden_states):
        intermediate_parallel = F.gelu(self.fc1(hidden_states))
        return self.fc2(intermediate_parallel)
