"""Exercise 14: one training step in mixed precision, under DistributedDataParallel.

Mixed precision runs the forward pass's matrix products in a 16-bit float
(torch.float16 or torch.bfloat16) while the parameters, their gradients and
the optimizer stay in float32. float16 has a narrow range: small gradients
round to zero. A GradScaler multiplies the loss by a large factor before
backward, so the gradients stay representable, and divides them again before
the optimizer uses them. When a gradient comes out inf or NaN (the scale was
too large, or the data was bad), scaler.step skips the update and
scaler.update halves the scale.

Under DDP the gradients are averaged across ranks during backward, so one
rank's inf reaches every rank: all of them skip the same step, and their
scales stay equal.

The grader has already joined the default process group (gloo on CPU) and
wrapped the model in torch's DistributedDataParallel when your code runs.
(RANK, LOCAL_RANK and WORLD_SIZE are set, as under torchrun.)

    train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float
        model      a DistributedDataParallel over a float32 model
        optimizer  over model's parameters (SGD)
        scaler     a torch.amp.GradScaler for the device the model is on
        batch      (x, y): inputs and class labels, already on that device
        max_norm   clip the gradients' total norm to this, measured on the
                   true (unscaled) gradients
        dtype      torch.float16 or torch.bfloat16: the autocast dtype
        - Forward and loss (cross entropy) under torch.autocast for the
          model's device type with `dtype`.
        - Backward on the scaled loss; unscale the gradients, then clip
          them to max_norm; step through the scaler (it skips the step when
          a gradient is not finite); update the scale.
        - Clear the gradients, and return the loss, unscaled, as a float.

Which dtypes are graded where: on the CPU (gloo) both bfloat16 and float16
(torch 2.13 runs both under CPU autocast, and GradScaler("cpu") works); on
GPUs (NCCL) both as well. The grader also makes one rank's gradient inf for
one step, and gives one rank a batch holding an inf at another (that rank's
loss is NaN, the others' are finite): every rank must skip both steps, and
every rank's scale drop.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/14_mixed_precision.py      (stuck? ddp-grade hint 14)
"""

import torch
import torch.nn.functional as F


def train_step_amp(model, optimizer, scaler, batch, max_norm: float, dtype: torch.dtype) -> float:
    x, y = batch

    # Only the forward runs in 16 bits; backward follows the same dtypes by itself.
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)

    scaler.scale(loss).backward()  # DDP averages the (scaled) gradients here

    # The gradients are still multiplied by the scale: divide first, or the
    # clipping threshold is compared with a norm thousands of times too large.
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    scaler.step(optimizer)  # skipped when a gradient is inf or NaN
    scaler.update()  # halves the scale after a skip, grows it after a run of good steps
    optimizer.zero_grad()
    return loss.item()
