"""Snapshots of what a rank holds, taken in the rank and sent to the grader as plain data."""

from __future__ import annotations

from torch import nn


def cpu_state(module: nn.Module) -> dict:
    """A copy of ``module``'s state_dict on the CPU, detached: what it holds now, whatever it does next."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
