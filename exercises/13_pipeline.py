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

Replace the `raise NotImplementedError` below; keep the name and signature.
Grade it with:  ddp-grade exercises/13_pipeline.py      (stuck? ddp-grade hint 13)
"""

import torch
import torch.distributed as dist


def pipeline_step(stage, batch, target, num_microbatches, loss_fn, schedule="gpipe"):
    # TODO: split the batch (rank 0) and the target (last rank) into micro-batches;
    # write the forward of one micro-batch (receive the input, run the stage, send
    # the output or compute the loss) and its backward (receive the output's
    # gradient, backpropagate, send the input's gradient); then run them in the
    # order the schedule gives, without a blocking send that its peer never meets.
    raise NotImplementedError
