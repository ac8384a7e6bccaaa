"""SimpleDDP that moves flat buffers: one broadcast of every parameter at construction, one
all-reduce of every gradient per sync (parameters_to_vector and friends)."""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector


class SimpleDDP:
    def __init__(self, model: torch.nn.Module):
        self.module = model
        self._sync = True
        named = list(model.named_parameters())
        with torch.no_grad():
            mine = parameters_to_vector([p for _, p in named])
            reference = mine.clone()
            dist.broadcast(reference, src=0)
        if not torch.equal(mine, reference):
            offset = 0
            for name, p in named:
                n = p.numel()
                if not torch.equal(mine[offset:offset + n], reference[offset:offset + n]):
                    raise ValueError(f"parameter {name} differs from rank 0's")
                offset += n

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def sync_gradients(self) -> None:
        if not self._sync:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    @contextmanager
    def no_sync(self):
        before, self._sync = self._sync, False
        try:
            yield self
        finally:
            self._sync = before
