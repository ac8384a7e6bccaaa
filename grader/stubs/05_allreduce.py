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

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/05_allreduce.py      (stuck? ddp-grade hint 05)
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist


class SimpleDDP:
    def __init__(self, model: torch.nn.Module):
        # TODO: keep the model as self.module, remember the world size, turn
        # syncing on, and check every parameter against rank 0's (broadcast a
        # copy of each; raise ValueError only after the last broadcast).
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        # TODO: call the model.
        raise NotImplementedError

    def train(self, mode: bool = True) -> "SimpleDDP":
        # TODO: delegate to the model.
        raise NotImplementedError

    def eval(self) -> "SimpleDDP":
        # TODO: delegate to the model.
        raise NotImplementedError

    def sync_gradients(self) -> None:
        # TODO: unless syncing is off, all-reduce (sum) every .grad that is not
        # None, then divide it by the world size.
        raise NotImplementedError

    @contextmanager
    def no_sync(self):
        # TODO: turn syncing off for the block; restore the previous state on
        # exit, also when the block raises.
        raise NotImplementedError
