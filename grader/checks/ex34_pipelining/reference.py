"""Exercise 34, grader side: the same micro-batches in one process, each schedule's three steps."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex34_pipelining import LR, STEPS, build_model, make_batch, n_microbatches
from grader.rank.drivers.shared.stub_models import pipeline_loss


def reference_run(schedule: str, world_size: int) -> dict:
    """The whole model in one process: each step, every micro-batch's loss divided by their number,
    backward (the gradients add up), then SGD. Returns the initial parameters, those after each step
    and each step's mean loss, by the model's parameter names."""
    model = build_model(schedule, world_size)
    m = n_microbatches(world_size)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    states, losses = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(schedule, world_size, step)
        model.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(tokens.chunk(m), targets.chunk(m)):
            loss = pipeline_loss(model(x), y)
            (loss / m).backward()
            total += loss.item()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
        losses.append(total / m)
    return {"initial": initial, "states": states, "losses": losses}
