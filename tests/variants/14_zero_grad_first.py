"""Exercise 14, broken: clears the gradients before backward instead of after the step, so they are left behind."""
# expect-fail: grads-cleared

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    optimizer.zero_grad()
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()
