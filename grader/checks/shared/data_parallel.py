"""What data parallelism must reach, trained by the grader outside the ranks: the parameters a model gets when
each step's gradient is the mean of every rank's own, as torch's DistributedDataParallel hands the optimizer.
No rank holds this answer; the ranks' own parameters are compared with it (05, 10)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def train_on_mean_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, world_size: int,
                            loss_of: Callable[[nn.Module, int, int], torch.Tensor],
                            scheduler=None) -> dict[str, torch.Tensor]:
    """Train ``model`` in place for ``steps`` steps: each step, the gradient of ``loss_of(model, step, rank)``
    for every rank, summed in rank order and divided by ``world_size``, then ``optimizer.step()`` (and
    ``scheduler.step()``). Returns the parameters, by name."""
    params = list(model.parameters())
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            for t, grad in zip(total, torch.autograd.grad(loss_of(model, step, rank), params)):
                t += grad
        for p, t in zip(params, total):
            p.grad = t / world_size
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
