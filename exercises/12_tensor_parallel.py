"""Exercise 12: tensor parallelism, Megatron-style: a column- and a row-parallel linear layer.

Data parallelism gives every rank the whole model and a different batch. Tensor
parallelism does the opposite: every rank sees the same batch, and each weight
matrix is split across the ranks, so that each holds and multiplies only its
share. Megatron-LM splits a transformer's MLP (fc1, GELU, fc2) so that it needs
a single all-reduce in forward and a single one in backward:

    x, the same on every rank
    -> fc1, column-parallel: rank r keeps block r of fc1's output features (rows of
       fc1.weight) and computes block r of the hidden activation. No communication.
    -> GELU on that block alone: it works element by element.
    -> fc2, row-parallel: rank r keeps block r of fc2's input features (columns of
       fc2.weight) and multiplies its hidden block by them: one term of a sum.
    -> all-reduce (sum) of those terms, then fc2's bias: the whole output, on every rank.

Backward mirrors it. The output's gradient is already whole on every rank, so the
row-parallel layer passes it on unchanged; fc1's input gradient is a sum over the
ranks' blocks, so the column-parallel layer all-reduces it. Megatron calls the two
operators f (identity in forward, all-reduce in backward, in front of fc1) and g
(all-reduce in forward, identity in backward, after fc2). Write each as a
torch.autograd.Function (`ddp-grade hint 12` says why torch's differentiable
all-reduces are neither).

Blocks: a dimension of n features is cut into W (the world size) equal, contiguous
blocks in rank order; rank r holds features [r * n / W, (r + 1) * n / W). When n is
not divisible by W, __init__ raises ValueError saying n and W (Megatron refuses
such splits too, with an assert, which the grader accepts as well). Splitting such
an n unevenly instead (as torch.tensor_split does) passes only if every rank's
result is right; what must never happen is a layer that builds and silently
computes a wrong result.

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as torchrun
sets them) and the process group (gloo on CPU); the ranks of the default group are
the tensor-parallel group. Every rank builds the same full nn.Linear layers and passes
them to your classes, then feeds the same input on every rank.

    class ColumnParallelLinear(nn.Module)
        __init__(self, full: nn.Linear)
            self.weight: this rank's block of full's output features, rows of
            full.weight, shape (out_features / W, in_features); self.bias: the same
            block of full.bias, or None when full has no bias. Both nn.Parameter,
            and copies: a slice of full.weight is a view, which keeps the whole
            weight's storage alive, and each rank must hold only its share.
        forward(self, x) -> Tensor
            x: (..., in_features), the same on every rank. Returns this rank's
            block of the output, (..., out_features / W). In backward, x's gradient
            is all-reduced (summed), so that every rank holds the whole of it.

    class RowParallelLinear(nn.Module)
        __init__(self, full: nn.Linear)
            self.weight: this rank's block of full's input features, columns of
            full.weight, shape (out_features, in_features / W), a copy; self.bias:
            the whole full.bias (or None), a copy, on every rank.
        forward(self, x) -> Tensor
            x: (..., in_features / W), this rank's block of the input. Returns the
            whole output, (..., out_features), the same on every rank: the partial
            products all-reduced, then the bias added once. In backward, the
            output's gradient passes through unchanged.

    class ParallelMLP(nn.Module)
        __init__(self, fc1: nn.Linear, fc2: nn.Linear)
            self.fc1 = ColumnParallelLinear(fc1), self.fc2 = RowParallelLinear(fc2).
        forward(self, x) -> Tensor
            fc2(gelu(fc1(x))) with the exact GELU (torch.nn.functional.gelu's
            default): the dense MLP's output, on every rank.

The grader compares the output, the input's gradient and every parameter's .grad
with a dense MLP it runs in its own process, counts the collectives in forward and
in backward, and measures the bytes each rank's module holds.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/12_tensor_parallel.py      (stuck? ddp-grade hint 12)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        # TODO: keep copies of this rank's block of full's output features:
        # self.weight (rows of full.weight) and self.bias (or None); raise
        # ValueError when out_features is not divisible by the world size.
        raise NotImplementedError

    def forward(self, x):
        # TODO: this rank's block of the output; x's gradient must be all-reduced
        # in backward (a torch.autograd.Function: identity forward, all-reduce backward).
        raise NotImplementedError


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear):
        super().__init__()
        # TODO: keep a copy of this rank's block of full's input features
        # (columns of full.weight) as self.weight, and the whole bias (or None);
        # raise ValueError when in_features is not divisible by the world size.
        raise NotImplementedError

    def forward(self, x):
        # TODO: all-reduce the partial product in forward (gradient unchanged in
        # backward), then add the bias once.
        raise NotImplementedError


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        # TODO: self.fc1 column-parallel, self.fc2 row-parallel.
        raise NotImplementedError

    def forward(self, x):
        # TODO: fc2(gelu(fc1(x))).
        raise NotImplementedError
