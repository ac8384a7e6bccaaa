"""Sequence parallelism with torch's differentiable functional collectives
(torch.distributed._functional_collectives.all_gather_tensor_autograd and
reduce_scatter_tensor_autograd, whose backwards are the conjugate collectives), the activations
batch-first inside the block, the linear weights kept transposed ([in, out], for x @ w), the blocks
from torch.tensor_split, and a tensor hook on each replicated parameter that returns its all-reduced
gradient."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


def _group(group):
    return group if group is not None else dist.group.WORLD


class SequenceParallelBlock(nn.Module):
    def __init__(self, norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, group=None):
        super().__init__()
        self.group = _group(group)
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if fc1.out_features % size:
            raise ValueError(f"cannot split {fc1.out_features} hidden features over {size} ranks")
        self.d = norm.normalized_shape[0]
        self.eps = norm.eps
        self.ln_w = nn.Parameter(norm.weight.detach().clone())
        self.ln_b = nn.Parameter(norm.bias.detach().clone())
        self.w_in = nn.Parameter(fc1.weight.detach().T.tensor_split(size, dim=1)[rank].clone())   # [d, hidden / W]
        self.b_in = nn.Parameter(fc1.bias.detach().tensor_split(size)[rank].clone())
        self.w_out = nn.Parameter(fc2.weight.detach().T.tensor_split(size, dim=0)[rank].clone())  # [hidden / W, d]
        self.b_out = nn.Parameter(fc2.bias.detach().clone())
        for p in (self.ln_w, self.ln_b, self.b_out):
            p.register_hook(self._summed)

    def _summed(self, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=self.group)
        return grad

    def forward(self, x):
        if x.ndim != 3 or x.shape[2] != self.d:
            raise ValueError(f"expected x of shape [seq / W, batch, {self.d}], got {tuple(x.shape)}")
        n = torch.tensor([x.shape[0]])
        most, least = n.clone(), n.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.group)
        if int(most) != int(least):
            raise ValueError(f"this rank has {int(n)} positions, others between {int(least)} and {int(most)}")

        y = F.layer_norm(x, (self.d,), self.ln_w, self.ln_b, self.eps)
        y = funcol.all_gather_tensor_autograd(y.contiguous(), 0, self.group)    # [seq, batch, d]
        y = y.transpose(0, 1)                                                   # [batch, seq, d]
        y = F.gelu(y @ self.w_in + self.b_in) @ self.w_out
        y = y.transpose(0, 1).contiguous()                                      # [seq, batch, d]
        y = funcol.reduce_scatter_tensor_autograd(y, "sum", 0, self.group)      # [seq / W, batch, d]
        y = funcol.wait_tensor(y)
        return x + y + self.b_out
