"""Exercise 14, broken: clips the gradients while they are still multiplied by the scale, then lets scaler.step unscale them."""
# expect-fail: clips-true-gradients matches-reference

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()
