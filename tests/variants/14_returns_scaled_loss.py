"""Exercise 14, broken: returns the scaled loss, the one backward ran on."""
# expect-fail: loss-returned

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return scaled.item()
