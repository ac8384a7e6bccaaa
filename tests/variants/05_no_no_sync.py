"""Exercise 05, broken: no no_sync() at all (gradient accumulation was left for later)."""
# expect-fail: no-sync-silent no-sync-restores
# expect-pass: grads-averaged params-identical matches-torch-ddp frozen-params init-rejects-mismatch


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

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "SimpleDDP":
        self.module.train(mode)
        return self

    def eval(self) -> "SimpleDDP":
        self.module.eval()
        return self

    def sync_gradients(self) -> None:
        if not self.sync_enabled:
            return
        for param in self.module.parameters():
            if param.grad is None:  # frozen, or not used in this forward
                continue
            # ReduceOp.AVG is not available on every backend: sum, then divide.
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= self.world_size
