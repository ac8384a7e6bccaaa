"""Exercise 05: average gradients by hand, a minimal DDP wrapper.

DistributedDataParallel does two things for plain data parallelism: it makes
sure every replica starts from the same weights, and it averages gradients
across ranks before the optimizer steps. Here you write both yourself.

The grader has already joined the default process group (gloo on CPU) when
your code runs: do not call init_process_group. (RANK, LOCAL_RANK and
WORLD_SIZE are set, as under torchrun.)

    class SimpleDDP:
        __init__(self, model)
            Keep the model as `self.module`. Check that every parameter equals
            rank 0's: broadcast a copy of each from rank 0 and compare. A rank
            whose parameters differ raises ValueError naming the first
            parameter that differs -- but only after all the broadcasts are
            done, so that no other rank is left waiting in one.
        __call__(self, *args, **kwargs)
            Calls the model and returns what it returns.
        train(self, mode=True) / eval(self)
            Delegate to the model.
        sync_gradients(self)
            Average every parameter's .grad that is not None across ranks with
            dist.all_reduce (sum, then divide by the world size). Does nothing
            while syncing is off. This is the only place gradients travel:
            after backward, .grad is still this rank's own.
        no_sync(self)
            A context manager: syncing is off inside it, and on exit it goes
            back to what it was before, also when the block raises.

Not allowed: torch's DistributedDataParallel.
Usage, in every rank:

    ddp = SimpleDDP(model)
    loss_fn(ddp(x), y).backward()
    ddp.sync_gradients()
    optimizer.step()

Grade it with:  ddp-grade exercises/05_allreduce.py
"""

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

    @contextmanager
    def no_sync(self):
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous
