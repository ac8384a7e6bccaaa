"""train_step_amp in the style of a training loop that watches for bad data: it warns when this rank's
loss is not finite, but leaves the decision to the scaler (which sees the averaged gradients, the same
on every rank), unscales through a helper, and clears the gradients with set_to_none."""

import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_


def _forward(model, batch, dtype):
    inputs, labels = batch
    with torch.autocast(inputs.device.type, dtype):
        return F.cross_entropy(model(inputs), labels, reduction="mean")


def _unscale_and_clip(scaler, optimizer, model, max_norm):
    scaler.unscale_(optimizer)
    return clip_grad_norm_(model.parameters(), max_norm=max_norm)


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    loss = _forward(model, batch, dtype)
    value = loss.detach().item()
    if not math.isfinite(value):
        warnings.warn(f"loss is {value} on this rank: the scaler will skip the step", RuntimeWarning)
    scaler.scale(loss).backward()
    _unscale_and_clip(scaler, optimizer, model, max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return value
