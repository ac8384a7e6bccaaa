"""accumulate_and_step, saved with Windows line endings: the first micro-batches together under one
no_sync(), the last one after it."""


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn):
    *accumulate, last = micro_batches
    scale = 1.0 / len(micro_batches)
    total = 0.0

    with ddp_model.no_sync():
        for x, y in accumulate:
            loss = loss_fn(ddp_model(x), y)
            total += loss.item()
            (loss * scale).backward()

    x, y = last
    loss = loss_fn(ddp_model(x), y)
    total += loss.item()
    (loss * scale).backward()  # DDP all-reduces the accumulated gradients here

    optimizer.step()
    optimizer.zero_grad()
    return total / len(micro_batches)
