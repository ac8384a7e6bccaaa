"""Exercise 52, broken: runs 13's 1F1B: each backward is one pass (the input's and the weights' gradients
together), its input gradient sent after both: nothing fills the bubble."""
# expect-fail: zb-h1-order bubble
# expect-pass: grads-match zb-memory neighbour-messages
# expect-message: zb-h1-order as 1F1B's one backward
# expect-message: bubble sent the gradient of micro-batch 0's input only after W0

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


def zero_bubble_step(stage, batch, target, num_microbatches, loss_fn):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_first, is_last = rank == 0, rank == world_size - 1
    param = next(stage.parameters())  # what the stage's inputs must be: its dtype, on its device

    inputs = batch.chunk(num_microbatches) if is_first else None
    targets = target.chunk(num_microbatches) if is_last else None
    input_shape = None  # rank r > 0 learns it from rank r - 1's header
    saved = {}  # micro-batch -> (its input, its output): what B and W need
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

    def backward(i):
        x, y = saved.pop(i)
        grad = None
        if not is_last:
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 1)
        y.backward(grad)
        if not is_first:
            sends.append(dist.isend(x.grad, rank - 1))

    warmup = min(world_size - rank - 1, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    for kind, i in order:
        forward(i) if kind == "F" else backward(i)
    for request in sends:
        request.wait()
    return sum(losses) / num_microbatches if is_last else None
