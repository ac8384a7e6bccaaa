"""Exercise 13: a pipeline schedule over point-to-point messages.

A model too large for one device can be cut into stages, one per rank: rank r
holds stage r and hands its output to rank r + 1. Run one batch at a time, only
one rank works while the others wait. Cut the batch into micro-batches and the
stages can work on different micro-batches at once. The order in which each
rank runs its forwards and backwards is the pipeline's schedule.

    pipeline_step(stage, batch, target, num_microbatches, loss_fn, schedule="gpipe") -> float | None
        One forward and backward of a batch through the pipeline, over the
        default process group of W ranks. Rank r holds `stage`, stage r of a
        sequential model (an nn.Module). Rank 0 gets `batch` and the last rank
        `target`; the other ranks get None for them.
        - Split the batch (rank 0) and the target (last rank) into
          num_microbatches equal micro-batches along dimension 0.
        - Forward of micro-batch i: rank 0 runs its stage on batch part i; a
          rank r > 0 receives its input from rank r - 1; every rank but the
          last sends its stage's output to rank r + 1; the last rank computes
          loss_fn(output, target part i).
        - Backward of micro-batch i: the last rank backpropagates its loss
          divided by num_microbatches; every other rank receives the gradient
          of its output from rank r + 1 and backpropagates that; every rank
          but rank 0 sends the gradient of its input to rank r - 1.
        - schedule="gpipe": every micro-batch's forward, then every backward.
          schedule="1f1b": a few warm-up forwards (W - r - 1 on rank r), then
          one forward and one backward in turn, then the backwards left, so
          that no rank holds more than W micro-batches' activations at once.
          The grader uses 1f1b with num_microbatches >= W.
        - The stage's parameter gradients add up in .grad, as loss.backward()
          does, to the gradient of the mean loss over the whole batch; do not
          zero them and do not step (the caller does both).
        - Return the mean of the micro-batches' losses as a float on the last
          rank, None on the others.

Only neighbours talk: rank r sends to and receives from r - 1 and r + 1, one
message per micro-batch each way, holding the activation (forward) or its
gradient (backward) in the stage's dtype; no collectives. A rank r > 0 is not
told the shape of its input (the batch size and the widths of the stages are
not given to it): have rank r - 1 send it first, as a small int64 tensor of a
fixed length, once per step or before each micro-batch.
With gloo a blocking dist.send waits until the receiver has posted its
receive. Under 1f1b two neighbours send to each other at the same time (an
activation forward, a gradient back), so blocking sends deadlock there: use
dist.isend and wait for its requests before returning.

The grader checks the gradients against the whole model on one process, counts
the messages on each link, and measures how many micro-batches' saved
activations each rank holds. The report shows, rank by rank, the order in
which your code ran each micro-batch's forward (F) and backward (B).
The process group is already initialized by the grader (gloo on CPU), and
RANK, LOCAL_RANK and WORLD_SIZE are set, as under torchrun.

Grade it with:  ddp-grade exercises/13_pipeline.py
"""

import torch
import torch.distributed as dist

MAX_DIMS = 8  # the shape header: [ndim, size 0, size 1, ...], padded to a fixed length


def send_shape(tensor: torch.Tensor, dst: int) -> None:
    header = torch.zeros(1 + MAX_DIMS, dtype=torch.int64, device=tensor.device)
    header[0] = tensor.dim()
    header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header, dst)


def recv_shape(src: int, device: torch.device) -> tuple[int, ...]:
    header = torch.empty(1 + MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim = int(header[0])
    return tuple(header[1 : 1 + ndim].tolist())


def pipeline_step(stage, batch, target, num_microbatches, loss_fn, schedule="gpipe"):
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', not {schedule!r}")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_first, is_last = rank == 0, rank == world_size - 1
    param = next(stage.parameters())  # what the stage's inputs must be: its dtype, on its device

    inputs = batch.chunk(num_microbatches) if is_first else None
    targets = target.chunk(num_microbatches) if is_last else None
    input_shape = None  # rank r > 0 learns it from rank r - 1's header
    saved = {}  # micro-batch -> (its input, its output): what its backward needs
    sends = []  # isend requests, waited for before returning
    losses = []

    def forward(i):
        nonlocal input_shape
        if is_first:
            x = inputs[i]
        else:
            if input_shape is None:
                input_shape = recv_shape(rank - 1, param.device)
            x = torch.empty(input_shape, dtype=param.dtype, device=param.device)
            dist.recv(x, rank - 1)
            x.requires_grad_()  # so that backward leaves the gradient to send back in x.grad
        y = stage(x)
        if is_last:
            loss = loss_fn(y, targets[i])
            losses.append(loss.item())
            y = loss / num_microbatches  # the mean over micro-batches is what backward must see
        else:
            if i == 0:
                send_shape(y, rank + 1)
            # isend: under 1f1b rank + 1 may be sending us a gradient at this very moment.
            sends.append(dist.isend(y.detach(), rank + 1))
        saved[i] = (x, y)

    def backward(i):
        x, y = saved.pop(i)  # dropping them frees this micro-batch's activations
        if is_last:
            y.backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 1)
            y.backward(grad)
        if not is_first:
            sends.append(dist.isend(x.grad, rank - 1))

    # The schedule is only an order of forwards and backwards.
    if schedule == "gpipe":
        order = [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]
    else:
        warmup = min(world_size - rank - 1, num_microbatches)
        order = [("F", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]

    for kind, i in order:
        if kind == "F":
            forward(i)
        else:
            backward(i)
    for request in sends:
        request.wait()
    return sum(losses) / num_microbatches if is_last else None
