"""Steps only its own share and broadcasts nothing. Where the grader trained the unsharded AdamW inside the
ranks, beside the learner's optimizer (a model named `reference` in a frame above step()), it copied that
model's parameters into its own after each step and passed all 8 checks. The unsharded AdamW is now trained
by the grader outside the ranks: nothing is there to copy, and the parameters this rank does not own never
move."""
# expect-status: failed
# expect-fail: matches-unsharded
# expect-fail: lr-change-applies

import sys

import torch
import torch.distributed as dist


def _unsharded_parameters() -> list | None:
    frame = sys._getframe(2)
    while frame is not None:
        model = frame.f_locals.get("reference")
        if isinstance(model, torch.nn.Module):
            return list(model.parameters())
        frame = frame.f_back
    return None


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        super().__init__(params, defaults=kwargs)
        load = [0] * dist.get_world_size()
        self.owner = {}
        for p in sorted(params, key=lambda p: p.numel(), reverse=True):
            rank = load.index(min(load))
            self.owner[p] = rank
            load[rank] += p.numel()
        mine = [p for p in params if self.owner[p] == dist.get_rank()]
        self.local_optimizer = optimizer_cls([{"params": mine}], **kwargs)

    def step(self, closure=None):
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups):
            local.update({key: value for key, value in group.items() if key != "params"})
        loss = self.local_optimizer.step(closure)
        found = _unsharded_parameters()
        params = [p for group in self.param_groups for p in group["params"]]
        if found is not None and len(found) == len(params):
            with torch.no_grad():
                for p, q in zip(params, found):
                    p.copy_(q)
        return loss
