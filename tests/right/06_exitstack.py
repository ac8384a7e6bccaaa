"""accumulate_and_step with contextlib.ExitStack choosing no_sync, losses kept as tensors."""

from contextlib import ExitStack

import torch


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    n = len(micro_batches)
    losses = []
    for index, (inputs, targets) in enumerate(micro_batches):
        with ExitStack() as stack:
            if index < n - 1:
                stack.enter_context(ddp_model.no_sync())
            loss = loss_fn(ddp_model(inputs), targets)
            (loss / n).backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses).mean().item()
