"""ShardedOptimizer after torch's ZeroRedundancyOptimizer: a heap for the partition, settings
synced between the param groups around every step, one flat broadcast per owner."""

from __future__ import annotations

import heapq
from typing import Any

import torch
import torch.distributed as dist


def _sync_param_groups(source: list[dict[str, Any]], destination: list[dict[str, Any]]) -> None:
    for src, dst in zip(source, destination):
        for key in filter(lambda k: k != "params", src.keys()):
            dst[key] = src[key]


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        super().__init__(params, defaults=dict(kwargs))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

        heap = [(0, r) for r in range(self.world_size)]  # (elements owned, rank)
        self.params_per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            load, r = heapq.heappop(heap)
            self.params_per_rank[r].append(p)
            heapq.heappush(heap, (load + p.numel(), r))

        self.local_optimizer = optimizer_cls([{"params": self.params_per_rank[self.rank]}], **kwargs)
        _sync_param_groups(self.param_groups, self.local_optimizer.param_groups)

    @torch.no_grad()
    def _broadcast_from_owners(self) -> None:
        for owner, owned in enumerate(self.params_per_rank):
            if not owned:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in owned])
            dist.broadcast(flat, src=owner)
            if owner != self.rank:
                offset = 0
                for p in owned:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def step(self, closure=None):
        _sync_param_groups(self.param_groups, self.local_optimizer.param_groups)
        loss = self.local_optimizer.step(closure=closure)
        _sync_param_groups(self.local_optimizer.param_groups, self.param_groups)
        self._broadcast_from_owners()
        return loss
