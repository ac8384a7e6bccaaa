"""Exercise 31, grader side: the same three steps in one process in the same precision (parameters cast to
bfloat16 for each rank's batch, gradients averaged in float32, clipped to the global norm, SGD)."""

from __future__ import annotations

import copy

import torch

from grader.rank.drivers.ex31_fsdp2 import BATCH, LR, MAX_NORM, STEPS, build_model, make_batch
from grader.rank.drivers.shared.stub_models import lm_loss


def reference_run(world_size: int) -> dict:
    """One process: each step, the float32 model cast to bfloat16 for each rank's batch (as the gathered
    parameters are), the gradients averaged in float32, clipped to MAX_NORM by their norm, SGD.

    Returns the initial state, the state after each step, each step's gradient norm before clipping,
    and each rank's loss at each step.
    """
    model = build_model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    states, norms, losses = [], [], []
    for step in range(STEPS):
        low = copy.deepcopy(model).to(torch.bfloat16)
        grads = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        step_losses = []
        for rank in range(world_size):
            low.zero_grad()
            tokens, targets = make_batch(step, rank)
            loss = lm_loss(low(tokens), targets)
            loss.backward()
            step_losses.append(loss.item())
            for name, p in low.named_parameters():
                grads[name] += p.grad.float()
        grads = {name: g / world_size for name, g in grads.items()}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        scale = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * scale * grads[name]
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        norms.append(float(norm))
        losses.append(step_losses)
    return {"initial": initial, "states": states, "norms": norms, "losses": losses, "lr": LR, "max_norm": MAX_NORM,
            "batch": BATCH}
