"""Exercise 06: gradient accumulation with no_sync.

When the batch you want does not fit in memory, split it into micro-batches:
run forward and backward on each, let the gradients add up in .grad, and step
once. Under DistributedDataParallel every backward would all-reduce the
gradients; only the last one needs to. `ddp_model.no_sync()` turns the
all-reduce off for the forward and backward run inside it.

The grader has already joined the default process group (gloo on CPU) and
wrapped the model in torch's DistributedDataParallel when your code runs.
(RANK, LOCAL_RANK and WORLD_SIZE are set, as under torchrun.)

    accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float
        ddp_model      a torch.nn.parallel.DistributedDataParallel
        optimizer      over ddp_model's parameters
        micro_batches  a list of (x, y) pairs, all of the same size
        loss_fn        loss_fn(output, y) -> the mean loss of a micro-batch
        - Run forward and backward on each micro-batch, in order. Scale each
          loss so that the update equals one step on all the micro-batches
          together.
        - Gradients are all-reduced once, in the backward of the last
          micro-batch; the others run forward AND backward inside no_sync().
        - Then optimizer.step() and optimizer.zero_grad().
        - Return the mean of this rank's micro-batch losses, unscaled, as a
          float.

Grade it with:  ddp-grade exercises/06_grad_accum.py
"""

import contextlib


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    num_micro = len(micro_batches)
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        is_last = i == num_micro - 1
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
