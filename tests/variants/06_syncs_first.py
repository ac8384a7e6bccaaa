"""Exercise 06, broken: all-reduces in the first micro-batch's backward instead of the last one's."""
# expect-fail: sync-on-last matches-single-process

import contextlib


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    num_micro = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        is_last = i == 0
        # DDP decides in forward whether the coming backward all-reduces, so
        # the forward belongs inside no_sync() too.
        sync_context = contextlib.nullcontext() if is_last else ddp_model.no_sync()
        with sync_context:
            loss = loss_fn(ddp_model(x), y)
            # .grad adds up over micro-batches: divide so the sum is a mean.
            (loss / num_micro).backward()
        losses.append(loss.item())

    optimizer.step()
    optimizer.zero_grad()
    return sum(losses) / num_micro
