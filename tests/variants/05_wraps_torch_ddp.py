"""Exercise 05, broken: hands the work to torch's DistributedDataParallel (which copies rank 0's weights instead of checking them)."""
# expect-fail: no-torch-ddp grads-local-until-sync init-rejects-mismatch

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class SimpleDDP:
    def __init__(self, model: torch.nn.Module):
        self.module = model
        self.world_size = dist.get_world_size()
        self.sync_enabled = True

        # DDP broadcasts rank 0's weights, so they are the same everywhere.
        self.ddp = DistributedDataParallel(model)

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def train(self, mode: bool = True) -> "SimpleDDP":
        self.module.train(mode)
        return self

    def eval(self) -> "SimpleDDP":
        self.module.eval()
        return self

    def sync_gradients(self) -> None:
        pass  # DDP averaged the gradients during backward

    @contextmanager
    def no_sync(self):
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous
