"""The debugging track's replay: train, in the grader's process, the model the ranks should have trained,
step by step on the same global batches (what :func:`grader.checks.shared.debug_job.check_replay` compares)."""

from __future__ import annotations

import torch
from torch import nn


def load_into(model: nn.Module, state: dict) -> str:
    """Load ``state`` into the grader's copy of the model; "" or what does not fit, in words."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return " ".join(lines[1:3] if len(lines) > 1 else lines)[:400]
    return ""


def replay(model: nn.Module, per_rank: list[list[list[list[int]]]], x: torch.Tensor, y: torch.Tensor, *,
           lr: float, loss_fn, momentum: float = 0.0, buffers: list | None = None,
           after_step=None) -> list:
    """Train ``model`` in this process as DDP should have, step by step; its momentum buffers at the end.

    ``per_rank[r][s]``: rank r's micro-batches (sample ids) of step s; ``loss_fn(model, x, y, step)``
    is the mean loss of one micro-batch at that step. Each micro-batch's loss is
    divided by the number of micro-batches of that rank's step; gradients are averaged over the
    ranks (a rank with nothing at a step contributes zero, as under Join). SGD, written out (no
    torch.optim in the grader's process), with ``momentum`` and its starting ``buffers`` (one per
    parameter, None for none yet). ``after_step(step, model)`` is called after each update.
    """
    params = list(model.parameters())
    buffers = list(buffers) if buffers is not None else [None] * len(params)
    world = len(per_rank)
    steps = max((len(r) for r in per_rank), default=0)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for rank_steps in per_rank:
            if step >= len(rank_steps):
                continue
            micro = [m for m in rank_steps[step] if m]
            for ids in micro:
                idx = torch.tensor([i for i in ids if i >= 0], dtype=torch.long)
                if len(idx):
                    (loss_fn(model, x[idx], y[idx], step) / (len(micro) * world)).backward()
        with torch.no_grad():
            for i, p in enumerate(params):
                if p.grad is None:
                    continue
                update = p.grad
                if momentum:
                    buffers[i] = update.clone() if buffers[i] is None else buffers[i].mul_(momentum).add_(update)
                    update = buffers[i]
                p.add_(update, alpha=-lr)
        if after_step is not None:
            after_step(step, model)
    return buffers


