"""What a driver records, done the same way in every exercise (runs in a rank): a tensor as a plain CPU
tensor, whether every rank is ok, a module's state. An exception the learner's code raised is recorded in
words with its frame by :func:`grader.checks.shared.learner_errors.learner_error`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def plain_tensor(value):
    """A tensor as a plain CPU tensor (a functional collective's result is a subclass, a DTensor gives this
    rank's part); None as None; anything else described ("a list")."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    if hasattr(value, "to_local"):  # a DTensor: this rank's part
        value = value.to_local()
    out = torch.empty(value.shape, dtype=value.dtype)
    out.copy_(value.detach().to("cpu"))
    return out


def all_ok(ok: bool, device="cpu", group=None) -> bool:
    """Whether every rank of ``group`` is ok (so that all go on, e.g. to backward, or none does)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def cpu_state(module: nn.Module) -> dict:
    """A copy of ``module``'s state_dict on the CPU, detached: what it holds now, whatever it does next."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
