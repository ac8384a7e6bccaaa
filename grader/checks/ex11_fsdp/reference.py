"""Exercise 11, grader side: the same training in one process, each step's state, and the bytes a rank may
hold (its padded slices)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.rank.drivers.ex11_fsdp import ADAMW, HELD_SLACK_BYTES, LR, PLANS, build_model, make_batch, unit_sizes


def reference_states(plan: str, world_size: int) -> list[dict]:
    """Rank 0's model trained in one process on the global batch: the state after each step."""
    dtype, _, steps_count = PLANS[plan]
    model = build_model(0, plan)
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in trainable]
    out = []
    for step in range(steps_count):
        batches = [make_batch(step, rank, plan) for rank in range(world_size)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p, (exp_avg, exp_avg_sq) in zip(trainable, moments):
                if plan != "adamw":
                    p -= LR * p.grad
                    continue
                # torch.optim.AdamW's arithmetic, by hand (the grader's process imports no optimizer).
                lr, (beta1, beta2), eps, decay = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
                p.mul_(1 - lr * decay)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** (step + 1))).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** (step + 1)))
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def expected_held(world_size: int, plan: str = "sgd") -> dict:
    """The bytes a rank holds between steps: its slices (twice: a gradient slice may stay allocated),
    the frozen parameter and the buffer, and a little slack."""
    model = build_model(0, plan)
    size = next(model.parameters()).element_size()
    full = sum(unit_sizes(plan).values()) * size
    slices = sum(padded(n, world_size) // world_size for n in unit_sizes(plan).values()) * size
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    return {"full": full, "slices": slices, "whole": whole, "limit": 2 * slices + whole + HELD_SLACK_BYTES}


def padded(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size
