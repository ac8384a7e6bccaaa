"""Exercise 18, wrong on purpose (with group= only). The collectives are torch.distributed.nn.functional's
differentiable all_gather and reduce_scatter. On the default group all is right: on gloo the
all-gather's backward is emulated by W scatters, one from each rank (torch.distributed.nn's
_AlltoAll), which moves a reduce-scatter's bytes. But those scatters name their source as a global
rank 0..W-1, so on a group of other ranks (the odd ranks) the backward raises 'Global rank 1 is not
part of group'."""
# expect-fail: uses-group
# expect-pass: output-matches input-grad-matches replicated-grads-match forward-gather-scatter backward-gather-scatter saved-activations-sharded

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn


class SequenceParallelBlock(nn.Module):
    def __init__(self, norm, fc1, fc2, group=None):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        world_size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if fc1.out_features % world_size:
            raise ValueError(f"hidden size {fc1.out_features} is not divisible by {world_size}")
        block = slice(rank * fc1.out_features // world_size, (rank + 1) * fc1.out_features // world_size)
        self.norm = nn.LayerNorm(norm.normalized_shape, eps=norm.eps, dtype=norm.weight.dtype)
        self.norm.load_state_dict(norm.state_dict())
        self.w1 = nn.Parameter(fc1.weight.detach()[block].clone())
        self.b1 = nn.Parameter(fc1.bias.detach()[block].clone())
        self.w2 = nn.Parameter(fc2.weight.detach()[:, block].clone())
        self.b2 = nn.Parameter(fc2.bias.detach().clone())
        for p in (self.norm.weight, self.norm.bias, self.b2):
            p.register_hook(self._all_reduced)

    def _all_reduced(self, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        return grad

    def forward(self, x):
        if x.dim() != 3 or x.shape[-1] != self.w1.shape[1]:
            raise ValueError(f"expected [seq / W, batch, {self.w1.shape[1]}], got {list(x.shape)}")
        world_size = dist.get_world_size(self.group)
        lengths = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(lengths, torch.tensor([x.shape[0]]), group=self.group)
        if len({int(t) for t in lengths}) > 1:
            raise ValueError(f"chunks of different lengths: {[int(t) for t in lengths]}")
        h = torch.cat(dist_nn.all_gather(self.norm(x).contiguous(), group=self.group), dim=0)
        h = F.linear(F.gelu(F.linear(h, self.w1, self.b1)), self.w2)
        out = torch.empty_like(x)
        h = dist_nn.reduce_scatter(out, list(h.contiguous().chunk(world_size, dim=0)), group=self.group)
        return x + h + self.b2
