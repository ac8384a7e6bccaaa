"""SimpleDDP as an nn.Module (forward, train and eval come from the base class), no_sync counting
its nesting depth, gradients averaged one by one with div_."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn


class SimpleDDP(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model
        self._no_sync_depth = 0
        mismatched = []
        for name, param in self.module.named_parameters():
            rank0 = param.detach().clone()
            dist.broadcast(rank0, 0)
            if not torch.equal(rank0, param.detach()):
                mismatched.append(name)
        if mismatched:
            raise ValueError(f"rank {dist.get_rank()} has parameters that differ from rank 0: "
                             f"first {mismatched[0]} ({len(mismatched)} in all)")

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @property
    def require_sync(self) -> bool:
        return self._no_sync_depth == 0

    @torch.no_grad()
    def sync_gradients(self):
        if not self.require_sync:
            return
        world_size = dist.get_world_size()
        for param in self.module.parameters():
            if param.requires_grad and param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                param.grad.div_(world_size)

    @contextlib.contextmanager
    def no_sync(self):
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
