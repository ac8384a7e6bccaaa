"""Exercise 10, wrong on purpose: parameters dealt out by position, so one rank gets all the weights."""
# expect-fail: balanced-by-size state-sharded

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        # The base class keeps every parameter in self.param_groups: zero_grad works on all of them.
        super().__init__(params, defaults=kwargs)
        world_size = dist.get_world_size()

        # Every world_size-th parameter to the same rank.
        self.owner = {p: i % world_size for i, p in enumerate(params)}

        mine = [p for p in params if self.owner[p] == dist.get_rank()]
        self.local_optimizer = optimizer_cls(mine, **kwargs)

    def step(self, closure=None):
        loss = self.local_optimizer.step(closure)
        # Each rank updated only its own parameters: the owner sends the new values to everyone.
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.detach(), src=self.owner[p])
        return loss
