"""Exercise 10: shard the optimizer state (ZeRO stage 1).

With DistributedDataParallel every rank keeps a full copy of the optimizer
state: for AdamW two running averages per parameter, twice the model's size,
on every rank. Yet after the all-reduce every rank computes the very same
update. ZeRO stage 1 splits that work: each parameter gets one owner rank,
only the owner keeps the parameter's optimizer state and updates it, then it
sends the new values to the other ranks.

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as
torchrun sets them) and the process group (gloo on CPU), and uses your class
inside it, on a model wrapped in DistributedDataParallel (so the gradients are
already averaged when step() is called).

    class ShardedOptimizer(torch.optim.Optimizer)
        __init__(self, params, optimizer_cls, **kwargs)
            `params`: an iterable of parameters, the same on every rank.
            - Assign each parameter to one rank, balanced by size (number of
              elements), the same assignment on every rank.
            - Build `optimizer_cls(<this rank's parameters>, **kwargs)` and
              keep it as `self.local_optimizer`. A rank may own no parameter
              at all (a model with fewer parameters than ranks): it still
              needs a local optimizer, and takes part in every broadcast.
            - Every parameter stays in `self.param_groups` (so that
              zero_grad, learning-rate schedulers, ... see all of them).
        step(self, closure=None)
            Step the local optimizer, then broadcast each parameter from its
            owner, so that every rank ends with the same, updated parameters.
            A change to `self.param_groups` (a scheduler setting "lr") takes
            effect at the next step: the local optimizer's groups follow it.
            Return what the local step returned.
        zero_grad(...)
            Clears the gradients of every parameter, as usual.

The result must equal optimizer_cls over all the parameters (unsharded),
while each rank holds only about 1/world_size of its state.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/10_zero.py      (stuck? ddp-grade hint 10)
"""

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
        # A scheduler changes self.param_groups: the local optimizer must step with those settings.
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups):
            local.update({key: value for key, value in group.items() if key != "params"})
        loss = self.local_optimizer.step(closure)
        # Each rank updated only its own parameters: the owner sends the new values to everyone.
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.detach(), src=self.owner[p])
        return loss
