"""Exercise 06, broken: runs every micro-batch inside no_sync(), the last one too, so the ranks never average."""
# expect-fail: one-sync-per-call matches-single-process

import contextlib


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    num_micro = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        is_last = i == num_micro - 1
        # DDP decides in forward whether the coming backward all-reduces, so
        # the forward belongs inside no_sync() too.
        with ddp_model.no_sync():
            loss = loss_fn(ddp_model(x), y)
            (loss / num_micro).backward()
        losses.append(loss.item())

    optimizer.step()
    optimizer.zero_grad()
    return sum(losses) / num_micro
