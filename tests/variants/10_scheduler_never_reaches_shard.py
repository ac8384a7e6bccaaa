"""Exercise 10, broken: the local optimizer keeps the learning rate it was built with; a scheduler
changes self.param_groups, which the local step never reads."""
# expect-fail: lr-change-applies

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        # The base class keeps every parameter in self.param_groups: zero_grad works on all of them.
        super().__init__(params, defaults=kwargs)
        world_size = dist.get_world_size()

        # Largest parameters first, each to the rank with the fewest elements so far
        # (the sort is stable, so every rank computes the same assignment).
        load = [0] * world_size
        self.owner = {}
        for p in sorted(params, key=lambda p: p.numel(), reverse=True):
            rank = load.index(min(load))
            self.owner[p] = rank
            load[rank] += p.numel()

        # One group, possibly empty: optimizer_cls(mine) would refuse an empty list of parameters.
        mine = [p for p in params if self.owner[p] == dist.get_rank()]
        self.local_optimizer = optimizer_cls([{"params": mine}], **kwargs)

    def step(self, closure=None):
        loss = self.local_optimizer.step(closure)
        # Each rank updated only its own parameters: the owner sends the new values to everyone.
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.detach(), src=self.owner[p])
        return loss
