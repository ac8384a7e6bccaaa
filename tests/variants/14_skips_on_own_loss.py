"""Exercise 14, broken: steps and updates the scaler only when this rank's own loss is finite.

With a bad batch on one rank, that rank skips scaler.update() while the others (whose losses were
finite, their gradients non-finite only through DDP's all-reduce) update: the ranks' scales part,
and the bad rank's next scaler.unscale_ raises."""
# expect-fail: skips-nonfinite scale-updates

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if torch.isfinite(loss):
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
    return loss.item()
