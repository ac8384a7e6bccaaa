"""Exercise 05, broken: averages each gradient in a hook during backward instead of in sync_gradients."""
# expect-fail: grads-local-until-sync

from contextlib import contextmanager

import torch
import torch.distributed as dist


class SimpleDDP:
    def __init__(self, model: torch.nn.Module):
        self.module = model
        self.world_size = dist.get_world_size()
        self.sync_enabled = True

        # Every rank broadcasts every parameter, even after a mismatch: a rank
        # that stopped early would leave the others waiting in a broadcast.
        first_mismatch = None
        for name, param in model.named_parameters():
            reference = param.detach().clone()
            dist.broadcast(reference, src=0)
            if first_mismatch is None and not torch.equal(reference, param.detach()):
                first_mismatch = name
        if first_mismatch is not None:
            raise ValueError(f"rank {dist.get_rank()}: parameter {first_mismatch!r} differs from rank 0's")
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(self._average)

    def _average(self, grad):
        if not self.sync_enabled:
            return grad
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad / self.world_size

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "SimpleDDP":
        self.module.train(mode)
        return self

    def eval(self) -> "SimpleDDP":
        self.module.eval()
        return self

    def sync_gradients(self) -> None:
        pass  # the hooks have already averaged every gradient

    @contextmanager
    def no_sync(self):
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous
