"""Exercise 06, broken: runs the forward outside no_sync(), so every backward all-reduces anyway."""
# expect-fail: one-sync-per-call sync-on-last

import contextlib


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    num_micro = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        is_last = i == num_micro - 1
        # DDP decides in forward whether the coming backward all-reduces, so
        # the forward belongs inside no_sync() too.
        loss = loss_fn(ddp_model(x), y)
        sync_context = contextlib.nullcontext() if is_last else ddp_model.no_sync()
        with sync_context:
            (loss / num_micro).backward()
        losses.append(loss.item())

    optimizer.step()
    optimizer.zero_grad()
    return sum(losses) / num_micro
