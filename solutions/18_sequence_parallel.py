"""Exercise 18: sequence parallelism, Megatron-style: a LayerNorm and a tensor-parallel MLP.

Tensor parallelism (exercise 12) splits the MLP's weights across W ranks, but every rank
still runs the LayerNorm, the bias and the residual on the whole sequence, and keeps
their activations for backward: W identical copies. Sequence parallelism (Korthikanti et
al., 2022, in Megatron-LM) cuts those along the sequence instead. Outside the
tensor-parallel region each rank holds one chunk of the sequence, and the all-reduce at
the region's end becomes a reduce-scatter, with an all-gather at its start: the same
bytes on the wire (an all-reduce is a reduce-scatter followed by an all-gather), and
1/W of the activations outside the region.

    x: this rank's chunk of the sequence, [seq / W, batch, d]
    -> LayerNorm on the chunk (its weight and bias replicated on every rank)
    -> all-gather along the sequence: the whole normed sequence, [seq, batch, d]
    -> fc1, column-parallel: this rank's block of the hidden features, [seq, batch, hidden / W]
    -> GELU (exact: F.gelu's default), element by element
    -> fc2, row-parallel: this rank's term of the output, [seq, batch, d]
    -> reduce-scatter along the sequence: this rank's chunk of the sum, [seq / W, batch, d]
    -> + fc2's bias, + x (the residual)

Backward runs the conjugate collectives: the gradient of an all-gather is a
reduce-scatter (each rank's gradient of the whole normed sequence is a partial sum,
over its own hidden block), the gradient of a reduce-scatter an all-gather. The
replicated parameters (the norm's weight and bias, fc2's bias) now meet only this
rank's chunk of the sequence: their gradient is a sum over the ranks, to be
all-reduced during backward, so that every rank ends with the dense block's
gradient. Without that all-reduce each rank's replicas are updated differently
and drift apart.

    class SequenceParallelBlock(nn.Module)
        __init__(self, norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, group=None)
            Every rank passes the same dense modules: norm = nn.LayerNorm(d),
            fc1 = nn.Linear(d, hidden), fc2 = nn.Linear(hidden, d). group: the ranks
            the block is split over (the default group when None); W and r below
            are the group's size and this rank's rank in it.
            Keep as nn.Parameters, copies (the dense tensors must be free to go;
            the names are yours):
              - the norm's weight and bias, and fc2's bias: whole, on every rank;
              - rank r's block of fc1's output features: rows [r * hidden / W,
                (r + 1) * hidden / W) of fc1.weight, and that block of fc1.bias;
              - the same block of fc2's input features: those columns of fc2.weight.
            Use the norm's eps. hidden not divisible by W: raise ValueError
            saying both.
        forward(self, x) -> Tensor
            x: [seq / W, batch, d], rank r's chunk: positions [r * seq / W,
            (r + 1) * seq / W) of the sequence. Returns this rank's chunk of
            x + fc2(gelu(fc1(norm(x)))) computed over the whole sequence: x's shape.
            - Bad input: x not 3-D, or its last dimension not d: ValueError.
              Chunks of different lengths on different ranks (a sequence W does
              not divide): ValueError on every rank, before a collective of
              mismatched sizes (compare the lengths first: a small all-reduce).
            - Messages: per forward, one all-gather and one reduce-scatter of
              activations; per backward their two conjugates, plus the all-reduce
              of the replicated parameters' gradients. No all-reduce of an
              activation.
            - Memory: what autograd saves outside the parallel region (the norm's
              input and statistics) covers this rank's chunk only: 1/W of what the
              dense block saves there. fc1's input (the gathered sequence) and the
              hidden blocks are saved inside the region.
            - After backward, each parameter's .grad is the dense block's gradient
              of what it holds: its block, or, for the replicated ones, the whole
              gradient, the same on every rank.

The grader starts the ranks and the process group (gloo on CPU), builds the same
dense modules on every rank (float64), gives each rank its chunk of x, runs forward
and backward of sum(output * G), and compares with the dense block run in one
process. It counts the collectives of forward and of backward, looks at what
autograd saves (torch.autograd.graph.saved_tensors_hooks) and measures the bytes
each rank's block holds.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/18_sequence_parallel.py      (stuck? ddp-grade hint 18)
"""

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
        self.eps = norm.eps
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

        h = F.layer_norm(x, (d,), norm_weight, norm_bias, self.eps)  # on this rank's chunk
        h = GatherFromSequenceParallel.apply(h, self.group)             # [seq, batch, d]
        h = F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias))          # [seq, batch, hidden / W]
        h = F.linear(h, self.fc2_weight)                                 # this rank's term of the sum
        h = ReduceScatterToSequenceParallel.apply(h, self.group)         # [seq / W, batch, d], summed
        # fc2's bias after the sum, so that it is added once.
        return x + h + fc2_bias
