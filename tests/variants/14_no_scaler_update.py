"""Exercise 14, broken: never calls scaler.update(), so the scale stays where it started."""
# expect-fail: scale-updates

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad()
    return loss.item()
