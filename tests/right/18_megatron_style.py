"""Sequence parallelism as Megatron-LM's tensor_parallel/mappings.py writes it: _GatherFromSequenceParallelRegion
and _ReduceScatterToSequenceParallelRegion built on list collectives (dist.all_gather + torch.cat,
dist.reduce_scatter of torch.chunk), asserts for divisibility (ensure_divisibility), a copy of the
LayerNorm module, and the replicated parameters marked sequence_parallel = True, their gradients
all-reduced by a post-accumulate-grad hook."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def ensure_divisibility(numerator, denominator):
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def _gather_along_first_dim(input_, group):
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return input_
    tensor_list = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(tensor_list, input_.contiguous(), group=group)
    return torch.cat(tensor_list, dim=0).contiguous()


def _reduce_scatter_along_first_dim(input_, group):
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return input_
    ensure_divisibility(input_.size(0), world_size)
    input_list = [t.contiguous() for t in torch.chunk(input_, world_size, dim=0)]
    output = torch.empty_like(input_list[0])
    dist.reduce_scatter(output, input_list, group=group)
    return output


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_first_dim(grad_output, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


def gather_from_sequence_parallel_region(input_, group):
    return _GatherFromSequenceParallelRegion.apply(input_, group)


def reduce_scatter_to_sequence_parallel_region(input_, group):
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


class SequenceParallelBlock(nn.Module):
    def __init__(self, norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, group=None):
        super().__init__()
        self.tp_group = group
        self.tp_size = dist.get_world_size(group=group)
        self.tp_rank = dist.get_rank(group=group)
        ensure_divisibility(fc1.out_features, self.tp_size)
        per_partition = fc1.out_features // self.tp_size
        start = self.tp_rank * per_partition

        self.norm = copy.deepcopy(norm)
        self.fc1 = nn.Linear(fc1.in_features, per_partition, dtype=fc1.weight.dtype)
        self.fc2 = nn.Linear(per_partition, fc2.out_features, dtype=fc2.weight.dtype)
        with torch.no_grad():
            self.fc1.weight.copy_(fc1.weight[start:start + per_partition])
            self.fc1.bias.copy_(fc1.bias[start:start + per_partition])
            self.fc2.weight.copy_(fc2.weight[:, start:start + per_partition])
            self.fc2.bias.copy_(fc2.bias)

        for param in (self.norm.weight, self.norm.bias, self.fc2.bias):
            param.sequence_parallel = True
            param.register_post_accumulate_grad_hook(self._allreduce_sequence_parallel_grad)

    def _allreduce_sequence_parallel_grad(self, param):
        dist.all_reduce(param.grad, group=self.tp_group)

    def forward(self, hidden_states):
        assert hidden_states.dim() == 3, f"expected [s, b, h], got {tuple(hidden_states.shape)}"
        assert hidden_states.size(-1) == self.norm.normalized_shape[0], \
            f"expected hidden size {self.norm.normalized_shape[0]}, got {hidden_states.size(-1)}"
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.tp_size)]
        dist.all_gather(sizes, torch.tensor([hidden_states.size(0)]), group=self.tp_group)
        if len({int(s) for s in sizes}) != 1:
            raise ValueError(f"sequence chunks of different lengths on the ranks: {[int(s) for s in sizes]}")

        residual = hidden_states
        ln_out = self.norm(hidden_states)
        total_input = gather_from_sequence_parallel_region(ln_out, self.tp_group)
        intermediate = F.gelu(F.linear(total_input, self.fc1.weight, self.fc1.bias))
        output_parallel = F.linear(intermediate, self.fc2.weight)
        output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        return residual + output + self.fc2.bias
