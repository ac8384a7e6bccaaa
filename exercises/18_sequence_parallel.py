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


class SequenceParallelBlock(nn.Module):
    def __init__(self, norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, group=None):
        super().__init__()
        # TODO: keep copies, as nn.Parameters: the norm's weight and bias and fc2's bias whole,
        # this rank's block of fc1's rows (weight and bias) and of fc2's columns; raise
        # ValueError when the hidden size is not divisible by the group's size.
        raise NotImplementedError

    def forward(self, x):
        # TODO: check x (ValueError on every rank); LayerNorm on the chunk; all-gather along the
        # sequence (reduce-scatter in backward); fc1, GELU, fc2 on this rank's hidden block;
        # reduce-scatter along the sequence (all-gather in backward); + fc2's bias, + x. The
        # replicated parameters' gradients are all-reduced in backward.
        raise NotImplementedError
