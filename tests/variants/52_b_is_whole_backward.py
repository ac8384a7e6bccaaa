"""Exercise 52, broken: B is a whole backward (y.backward(grad, retain_graph=True) fills x.grad and the weights'
.grad), and W then adds the weights' gradients again."""
# expect-fail: grads-match micro-batches
# expect-message: grads-match added twice (B and W)
# expect-message: micro-batches more than once for [0, 1, 2, 3]

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
            y.backward(grad, retain_graph=True)  # the graph stays: W needs it
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
