"""train_step_amp as in PyTorch's automatic mixed precision recipe: a loss module, the device type
taken from the parameters, torch.amp.autocast, gradients set to None."""

import torch
from torch import nn

loss_fn = nn.CrossEntropyLoss()


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    inputs, targets = batch
    device_type = next(model.parameters()).device.type
    with torch.amp.autocast(device_type, dtype=dtype):
        output = model(inputs)
        loss = loss_fn(output, targets)

    scaler.scale(loss).backward()

    # Unscales the gradients of optimizer's assigned params in-place
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.module.parameters(), max_norm=max_norm)

    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
