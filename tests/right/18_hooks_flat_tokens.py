"""Sequence parallelism written with hooks and flat tokens: the activations flattened to
[tokens, d] (tokens = seq / W * batch, sequence-major, so a rank's chunk is contiguous rows), the
LayerNorm kept as a module and its gradients all-reduced by one hook per parameter that sums them in a
flat buffer, gradients of the collectives by hand in autograd Functions using list collectives, the
ranks' lengths compared with all_gather, and a rank of one group skipping every collective."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group, size):
        ctx.group, ctx.size = group, size
        if size == 1:
            return rows.clone()
        parts = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(parts, rows.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        if ctx.size == 1:
            return grad, None, None
        mine = torch.empty_like(grad.chunk(ctx.size)[0])
        dist.reduce_scatter(mine, [p.contiguous() for p in grad.chunk(ctx.size)], group=ctx.group)
        return mine, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, group, size):
        ctx.group, ctx.size = group, size
        if size == 1:
            return rows.clone()
        mine = torch.empty_like(rows.chunk(size)[0])
        dist.reduce_scatter(mine, [p.contiguous() for p in rows.chunk(size)], group=group)
        return mine

    @staticmethod
    def backward(ctx, grad):
        return _AllGatherRows.forward(ctx, grad, ctx.group, ctx.size), None, None


class SequenceParallelBlock(nn.Module):
    def __init__(self, norm: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, group=None):
        super().__init__()
        self.group = group
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        hidden, d = fc1.out_features, fc1.in_features
        if hidden % self.size:
            raise ValueError(f"hidden={hidden} does not split over {self.size} ranks")
        width = hidden // self.size
        self.norm = nn.LayerNorm(d, eps=norm.eps, dtype=norm.weight.dtype)
        self.norm.load_state_dict(norm.state_dict())
        self.up = nn.Linear(d, width, dtype=fc1.weight.dtype)
        self.up.load_state_dict({"weight": fc1.weight[rank * width:(rank + 1) * width],
                                 "bias": fc1.bias[rank * width:(rank + 1) * width]})
        self.down_weight = nn.Parameter(fc2.weight.detach()[:, rank * width:(rank + 1) * width].contiguous())
        self.down_bias = nn.Parameter(fc2.bias.detach().clone())
        self.replicated = [self.norm.weight, self.norm.bias, self.down_bias]
        self.pending = 0
        for p in self.replicated:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _param):
        # Once all three gradients are in, sum them over the group in one flat buffer.
        self.pending += 1
        if self.pending < len(self.replicated):
            return
        self.pending = 0
        if self.size == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.replicated])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in self.replicated:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def forward(self, x):
        d = self.norm.normalized_shape[0]
        if x.dim() != 3 or x.size(2) != d:
            raise ValueError(f"x should be (seq_chunk, batch, {d}), not {tuple(x.shape)}")
        seq, batch, _ = x.shape
        if self.size > 1:
            lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            dist.all_gather(lengths, torch.tensor([seq]), group=self.group)
            if any(int(n) != seq for n in lengths):
                raise ValueError(f"the ranks hold chunks of {[int(n) for n in lengths]} positions")
        tokens = self.norm(x).reshape(seq * batch, d)
        tokens = _AllGatherRows.apply(tokens, self.group, self.size)
        tokens = F.linear(F.gelu(self.up(tokens)), self.down_weight)
        tokens = _ReduceScatterRows.apply(tokens, self.group, self.size)
        return x + tokens.reshape(seq, batch, d) + self.down_bias
