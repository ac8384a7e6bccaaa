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

Grade it with:  ddp-grade exercises/52_zero_bubble.py
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


def zb_h1_order(rank: int, world_size: int, num_microbatches: int) -> list[tuple[str, int]]:
    """ZB-H1's passes on one rank, in order: ("F", i), ("B", i) and ("W", i)."""
    m = num_microbatches
    warmup = min(world_size - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    next_w = 0
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
        if i >= rank:  # the first `rank` rounds leave their W for the end, where rank r would idle
            order.append(("W", next_w))
            next_w += 1
    for i in range(m - warmup, m):
        order += [("B", i), ("W", next_w)]
        next_w += 1
    return order + [("W", i) for i in range(next_w, m)]


def zero_bubble_step(stage, batch, target, num_microbatches, loss_fn):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_first, is_last = rank == 0, rank == world_size - 1
    param = next(stage.parameters())  # what the stage's inputs must be: its dtype, on its device
    params = [p for p in stage.parameters() if p.requires_grad]

    inputs = batch.chunk(num_microbatches) if is_first else None
    targets = target.chunk(num_microbatches) if is_last else None
    input_shape = None  # rank r > 0 learns it from rank r - 1's header
    saved = {}  # micro-batch -> (its input, its output): what B and W need
    output_grads = {}  # micro-batch -> the gradient of its output, which W needs again
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
            x.requires_grad_()
        y = stage(x)
        if is_last:
            loss = loss_fn(y, targets[i])
            losses.append(loss.item())
            y = loss / num_microbatches
        else:
            if i == 0:
                send_shape(y, rank + 1)
            sends.append(dist.isend(y.detach(), rank + 1))
        saved[i] = (x, y)

    def backward_input(i):  # B
        x, y = saved[i]
        grad = None
        if not is_last:
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 1)
        output_grads[i] = grad
        if not is_first:
            y.backward(grad, inputs=[x], retain_graph=True)  # the graph stays: W needs it
            sends.append(dist.isend(x.grad, rank - 1))  # rank - 1 is waiting for it: send it now

    def backward_weight(i):  # W
        x, y = saved.pop(i)
        y.backward(output_grads.pop(i), inputs=params)  # without retain_graph: frees micro-batch i's graph

    passes = {"F": forward, "B": backward_input, "W": backward_weight}
    for kind, i in zb_h1_order(rank, world_size, num_microbatches):
        passes[kind](i)
    for request in sends:
        request.wait()
    return sum(losses) / num_microbatches if is_last else None
