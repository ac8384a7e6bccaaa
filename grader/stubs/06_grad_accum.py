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

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/06_grad_accum.py      (stuck? ddp-grade hint 06)
"""

import contextlib


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    # TODO: for each micro-batch, forward and backward a scaled loss, inside
    # ddp_model.no_sync() for all but the last one; then step, zero the
    # gradients, and return the mean of the unscaled losses.
    raise NotImplementedError
