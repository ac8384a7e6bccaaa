"""Exercise 14, broken: unscales once to measure the gradient norm for a log line, and again before
clipping. GradScaler refuses a second unscale_ before update() and raises at the first step."""
# expect-fail: clips-true-gradients
# expect-problem: scaler.unscale_(optimizer) ran a second time in the same step

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    print(f"grad norm {float(grad_norm):.3f}")
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()
