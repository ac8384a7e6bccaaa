"""ShardedOptimizer that copies the hyperparameters it was given before each local step and
overlaps its broadcasts (async_op=True, then wait for all)."""

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self._all = list(params)
        super().__init__(self._all, kwargs)
        world = dist.get_world_size()
        sizes = [0] * world
        order = sorted(range(len(self._all)), key=lambda i: (-self._all[i].numel(), i))
        self._owner = [0] * len(self._all)
        for i in order:
            r = min(range(world), key=lambda k: sizes[k])
            self._owner[i] = r
            sizes[r] += self._all[i].numel()
        mine = [p for p, r in zip(self._all, self._owner) if r == dist.get_rank()]
        self.local_optimizer = optimizer_cls([{"params": mine}], **kwargs)
        self._settings = list(kwargs)

    def step(self, closure=None):
        for name in self._settings:
            self.local_optimizer.param_groups[0][name] = self.param_groups[0][name]
        result = self.local_optimizer.step(closure)
        handles = [dist.broadcast(p.data, src=r, async_op=True) for p, r in zip(self._all, self._owner)]
        for handle in handles:
            handle.wait()
        return result
