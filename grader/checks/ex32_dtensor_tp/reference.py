"""Exercise 32, grader side: the same three steps of the dense model in one process, on each data-parallel
group's batch."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex32_dtensor_tp import BATCH, LR, STEPS, build_model, make_batch
from grader.rank.drivers.shared.stub_models import lm_loss


def reference_run(world_size: int, tp_size: int) -> dict:
    """The dense model in one process: each step on every data-parallel group's batch at once (the mean
    loss over all their tokens), plain SGD. Returns the first step's logits of each group's batch, the
    initial parameters and the parameters after each step."""
    model = build_model()
    groups = world_size // tp_size
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    states, logits = [], []
    for step in range(STEPS):
        batches = [make_batch(step, group) for group in range(groups)]
        tokens = torch.cat([t for t, _ in batches])
        targets = torch.cat([t for _, t in batches])
        model.zero_grad()
        out = model(tokens)
        lm_loss(out, targets).backward()
        if step == 0:
            logits = [chunk.detach().clone() for chunk in out.split(BATCH)]
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        states.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {"logits": logits, "initial": initial, "states": states}
