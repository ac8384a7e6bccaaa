"""Exercise 18, wrong on purpose: the block keeps the norm's weight and bias but not its eps, and normalises with
layer_norm's default 1e-5."""
# expect-fail: output-matches
# expect-pass: saved-activations-sharded forward-gather-scatter second-step-matches

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along the sequence (dim 0) in forward; reduce-scatter of the gradient in backward."""

    @staticmethod
    def forward(ctx, chunk, group):
        ctx.group = group
        world_size = dist.get_world_size(group)
        chunk = chunk.contiguous()
        whole = chunk.new_empty((world_size * chunk.shape[0], *chunk.shape[1:]))
        dist.all_gather_single(whole, chunk, group=group)
        return whole

    @staticmethod
    def backward(ctx, grad_whole):
        # Each rank's gradient of the whole sequence is only its hidden block's term:
        # sum the terms, and keep this rank's chunk of the sum.
        world_size = dist.get_world_size(ctx.group)
        grad_whole = grad_whole.contiguous()
        grad_chunk = grad_whole.new_empty((grad_whole.shape[0] // world_size, *grad_whole.shape[1:]))
        dist.reduce_scatter_single(grad_chunk, grad_whole, group=ctx.group)
        return grad_chunk, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along the sequence (dim 0) in forward; all-gather of the gradient in backward."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        world_size = dist.get_world_size(group)
        partial = partial.contiguous()
        chunk = partial.new_empty((partial.shape[0] // world_size, *partial.shape[1:]))
        dist.reduce_scatter_single(chunk, partial, group=group)
        return chunk

    @staticmethod
    def backward(ctx, grad_chunk):
        # Every rank's term fed the whole sum, so each needs the whole sequence's gradient.
        world_size = dist.get_world_size(ctx.group)
        grad_chunk = grad_chunk.contiguous()
        grad_whole = grad_chunk.new_empty((world_size * grad_chunk.shape[0], *grad_chunk.shape[1:]))
        dist.all_gather_single(grad_whole, grad_chunk, group=ctx.group)
        return grad_whole, None


class AllReduceGradient(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the gradient in backward. Put in front of a replicated
    parameter, it sums the gradients every rank's chunk of the sequence gave it."""

    @staticmethod
    def forward(ctx, parameter, group):
        ctx.group = group
        return parameter.view_as(parameter)

    @staticmethod
    def backward(ctx, grad):
        # all_reduce writes in place: reduce a copy, not a tensor autograd handed us.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SequenceParallelBlock(nn.Module):
    def __init__(self, norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, group=None):
        super().__init__()
        self.group = group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        hidden = fc1.out_features
        if hidden % world_size != 0:
            raise ValueError(f"the hidden size {hidden} is not divisible by the group's size {world_size}")
        block = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)

        # Replicated on every rank: their gradients are all-reduced in backward.
        self.norm_weight = nn.Parameter(norm.weight.detach().clone())
        self.norm_bias = nn.Parameter(norm.bias.detach().clone())
        self.fc2_bias = nn.Parameter(fc2.bias.detach().clone())
        # Split: .clone(), because a slice is a view that would keep the whole weight alive.
        self.fc1_weight = nn.Parameter(fc1.weight.detach()[block].clone())
        self.fc1_bias = nn.Parameter(fc1.bias.detach()[block].clone())
        self.fc2_weight = nn.Parameter(fc2.weight.detach()[:, block].clone())

    def forward(self, x):
        d = self.norm_weight.shape[0]
        if x.dim() != 3 or x.shape[-1] != d:
            raise ValueError(f"x must be [seq / W, batch, {d}], got {list(x.shape)}")
        # Every rank learns whether the chunks' lengths agree, before a collective that would mismatch.
        lengths = torch.tensor([x.shape[0], -x.shape[0]], device=x.device)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=self.group)
        if lengths[0] != -lengths[1]:
            raise ValueError(f"the ranks' chunks have different lengths (from {-int(lengths[1])} to "
                             f"{int(lengths[0])}): the sequence must be divisible by the world size")

        norm_weight = AllReduceGradient.apply(self.norm_weight, self.group)
        norm_bias = AllReduceGradient.apply(self.norm_bias, self.group)
        fc2_bias = AllReduceGradient.apply(self.fc2_bias, self.group)

        h = F.layer_norm(x, (d,), norm_weight, norm_bias)  # on this rank's chunk
        h = GatherFromSequenceParallel.apply(h, self.group)             # [seq, batch, d]
        h = F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias))          # [seq, batch, hidden / W]
        h = F.linear(h, self.fc2_weight)                                 # this rank's term of the sum
        h = ReduceScatterToSequenceParallel.apply(h, self.group)         # [seq / W, batch, d], summed
        # fc2's bias after the sum, so that it is added once.
        return x + h + fc2_bias
