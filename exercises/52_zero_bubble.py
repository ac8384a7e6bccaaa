"""Exercise 52: a zero-bubble pipeline (ZB-H1): the backward split in two.

In 13's 1F1B a rank's backward of a micro-batch does two jobs at once: the gradient of the stage's input, which
the rank before is waiting for, and the gradients of the stage's weights, which nobody waits for until the
optimizer step. Split them, send the first upstream at once, and run the second later, in the time 1F1B leaves
idle: that is ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1 and
Figure 3).

    zero_bubble_step(stage, batch, target, num_microbatches, loss_fn) -> float | None
        One forward and backward of a batch through the pipeline under ZB-H1, over the default process group of
        W ranks. The rest of the contract is 13's pipeline_step:
        - rank r holds `stage`, stage r of a sequential model; rank 0 gets `batch` and the last rank `target`
          (None elsewhere); both are split into M = num_microbatches equal micro-batches along dimension 0;
        - the last rank computes loss_fn(output, target part i) and backpropagates it divided by M;
        - the stage's .grad end up as the gradient of the mean loss over the whole batch (not zeroed, no step);
        - the last rank returns the mean of the micro-batch losses as a float, the others None;
        - only neighbours talk, one message per micro-batch each way in the stage's dtype (a small int64 shape
          header aside), by dist.isend for every send (neighbours send to each other at the same time).

        The backward of micro-batch i is two passes:
        - B i: the gradient of the stage's input only, sent to rank r - 1 at once (the last rank starts from
          its loss, the others from the gradient received from rank r + 1);
        - W i: the gradients of the stage's parameters for micro-batch i, added to .grad, later.
        Rank 0 has no input gradient to send: its B only receives the gradient of its output, and its W does
        the whole backward (ZB-H1 runs rank 0's W right after its B anyway).

        ZB-H1's order on rank r, for M >= W (the grader's cases):
          1. W - r - 1 warm-up forwards, as 1F1B;
          2. r rounds of F, B: the W's wait;
          3. rounds of F, B, W until every forward has run; each W is the oldest one still waiting;
          4. B, W for each backward left;
          5. the r W's still waiting.
        W = 4, M = 8, each pass one time slot, each waiting for its neighbour's message ("." is idle):

          rank 0  F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
          rank 1  .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
          rank 2  .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
          rank 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7

        In these units 1F1B's backward is two slots (B and W fused) and each rank idles 3 (W - 1) slots;
        ZB-H1 idles W - 1, a third. Memory: a micro-batch's activations stay until its W (W needs them), so
        every rank may hold up to W micro-batches, the most 1F1B holds (on its rank 0), never more.

How to split a backward in PyTorch: keep the graph after B (retain_graph=True) and ask autograd for one set of
gradients at a time.

    y.backward(grad_y, inputs=[x], retain_graph=True)    # B: x.grad only; the graph stays for W
    y.backward(grad_y, inputs=list(stage.parameters()))  # W: adds to each .grad, frees the graph

(or torch.autograd.grad(y, x, grad_y, retain_graph=True), then torch.autograd.grad(y, params, grad_y) added to
.grad by hand). W done so goes back through the stage's layers a second time (the first layer's weights need the
gradient of the hidden activation, which B computed too); torch.distributed.pipelining's stage_backward_input
keeps those intermediate gradients for stage_backward_weight, and DeepSeek's DualPipe has each layer's own
backward queue its weight products (WeightGradStore). Call the stage as stage(x): the grader's stage sees the
backward enter it (B) and autograd produce each parameter's gradient (W), however you ask for them.

Where this sits: torch.distributed.pipelining's ScheduleInterleavedZeroBubble is the paper's ZB1P (its actions
F, I for this B, W; B there is a whole backward); with one stage per rank its order is this one.
ScheduleZBVZeroBubble is the paper's ZB-V (its section 6): two stages per rank in a V (rank r holds stages r
and 2W - 1 - r), zero bubble when F, B and W take equal time, at 1F1B's peak memory. DeepSeek-V3's DualPipe
(arXiv 2412.19437, section 3.2.1) feeds micro-batches from both ends of the pipeline, each rank holding two
mirrored stages (parameters twice), splits B and W as here, and runs one micro-batch's forward chunk beside
another's backward chunk so that the expert-parallel all-to-alls and the pipeline's own messages hide under
computation; torch 2.13 has its V-shaped form as ScheduleDualPipeV.

The grader compares the gradients and the loss with the whole model on one process (float64), and reads from
each rank's own record the order of its F, B and W passes and messages, the idle slots that order leaves in unit
time, and how many micro-batches' saved activations it held at once. The report draws the slot table above for
your run. The process group is already initialized by the grader (gloo on CPU), and RANK, LOCAL_RANK and
WORLD_SIZE are set, as under torchrun.

Replace the `raise NotImplementedError` below; keep the name and signature.
Grade it with:  ddp-grade exercises/52_zero_bubble.py      (stuck? ddp-grade hint 52)
"""

import torch
import torch.distributed as dist


def zero_bubble_step(stage, batch, target, num_microbatches, loss_fn):
    # TODO: write the three passes of one micro-batch: F (receive the input or take
    # the batch's part, run the stage, send the output or compute the loss), B (the
    # gradient of the input only, keeping the graph, sent to rank - 1 at once) and W
    # (the parameters' gradients, added to .grad, freeing the graph); then run them
    # in ZB-H1's order for this rank, with isend for every send.
    raise NotImplementedError
