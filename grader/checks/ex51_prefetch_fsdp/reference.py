"""Exercise 51, grader side: the same training in one process, step by step (each rank's output, each unit's
gradient as the ranks' slices should hold it, the state after the step), and the sizes that name each unit's
collectives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.rank.drivers.ex51_prefetch_fsdp import DTYPE, LR, STEPS, build_model, make_batch, unit_sizes


def padded(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size


def reference_steps(seed: int, world_size: int) -> dict:
    """Rank 0's model trained in one process on the global batch: the initial state, and per step each rank's
    output, each unit's gradient cut into the ranks' slices (padded with zeros) and the state after SGD."""
    model = build_model(seed, 0)
    trainable = {name: [(n, p) for n, p in unit.named_parameters() if p.requires_grad]
                 for name, unit in model.named_children()}
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    steps = []
    for step in range(STEPS):
        batches = [make_batch(seed, step, rank) for rank in range(world_size)]
        model.zero_grad()
        outputs = [model(x) for x, _ in batches]
        F.mse_loss(torch.cat(outputs), torch.cat([y for _, y in batches])).backward()
        slices = {}
        for name, params in trainable.items():
            flat = torch.cat([p.grad.reshape(-1) for _, p in params])
            flat = F.pad(flat, (0, padded(flat.numel(), world_size) - flat.numel()))
            slices[name] = list(flat.chunk(world_size))
        with torch.no_grad():
            for params in trainable.values():
                for _, p in params:
                    p.add_(p.grad, alpha=-LR)  # torch.optim.SGD's own arithmetic
        steps.append({"outputs": [o.detach().clone() for o in outputs], "grads": slices,
                      "state": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    return {"initial": initial, "steps": steps}


def gathered_sizes(world_size: int) -> dict[int, str]:
    """The bytes of each unit's gathered (padded) buffer, and what they name."""
    element = torch.empty((), dtype=DTYPE).element_size()
    return {padded(n, world_size) * element: name for name, n in unit_sizes().items()}


def slice_sizes(world_size: int) -> dict[int, str]:
    """The bytes of each unit's slice (one rank's part of its padded buffer), and what they name."""
    element = torch.empty((), dtype=DTYPE).element_size()
    return {padded(n, world_size) // world_size * element: name for name, n in unit_sizes().items()}
