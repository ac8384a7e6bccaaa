"""train_step_amp that logs the steps the scaler skipped (a smaller scale after update means a skip),
clips the optimizer's own parameter groups, and zeroes the gradients in place."""

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    autocast = torch.autocast(device_type=x.device.type, dtype=dtype, enabled=True)
    with autocast:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(_params(optimizer), max_norm, norm_type=2.0)
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if scaler.get_scale() < scale_before:
        log.warning("skipped a step: gradient norm %s, scale now %s", float(grad_norm), scaler.get_scale())
    for p in _params(optimizer):
        if p.grad is not None:
            p.grad.zero_()
    return loss.float().item()
