"""Exercise 14, broken: runs the forward on the model inside the DDP wrapper (model.module), so
backward never all-reduces and every rank steps on its own gradients."""
# expect-fail: params-identical

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    net = model.module  # skip DDP's forward under autocast
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()
