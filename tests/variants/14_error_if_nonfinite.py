"""Exercise 14, broken: clips with error_if_nonfinite=True, which raises on the step the scaler should skip."""
# expect-fail: skips-nonfinite

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()
