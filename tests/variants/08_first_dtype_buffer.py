"""Exercise 08, broken: each bucket's buffer takes the dtype of its first parameter, so in a bucket
that mixes float32 and float64 the float64 gradients are averaged in float32."""
# expect-fail: grads-match-ddp

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    ready: int = 0
    work: object = None
    members: set[int] = field(default_factory=set)


class BucketedDDP(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)

        cap = int(bucket_cap_mb * 1024 * 1024)
        groups: list[list[nn.Parameter]] = [[]]
        used = 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            size = p.numel() * p.element_size()
            if groups[-1] and used + size > cap:
                groups.append([])
                used = 0
            groups[-1].append(p)
            used += size
        groups = [g for g in groups if g]

        self._buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        for b, params in enumerate(groups):
            dtype = params[0].dtype
            offsets, total = [], 0
            for i, p in enumerate(params):
                offsets.append(total)
                total += p.numel()
                self._where[p] = (b, i)
            buffer = torch.zeros(total, dtype=dtype, device=params[0].device)
            self._buckets.append(_Bucket(params, buffer, offsets))
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.buckets = [b.params for b in self._buckets]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad(self, param: nn.Parameter) -> None:
        b, i = self._where[param]
        bucket = self._buckets[b]
        start = bucket.offsets[i]
        bucket.buffer[start:start + param.numel()].copy_(param.grad.reshape(-1))
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        world_size = dist.get_world_size()
        for bucket in self._buckets:
            if bucket.work is None:
                continue
            bucket.work.wait()
            bucket.buffer.div_(world_size)
            for p, start in zip(bucket.params, bucket.offsets):
                p.grad.copy_(bucket.buffer[start:start + p.numel()].view_as(p.grad))
            bucket.work, bucket.ready = None, 0
