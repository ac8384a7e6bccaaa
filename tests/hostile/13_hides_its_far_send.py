"""The last rank sends the loss to rank 0 for logging, through the process group's own send and recv, which no
probe of torch.distributed's functions sees: every call the ranks record is a neighbour's. The kernel counted
the bytes between rank 2 and rank 0 (not neighbours from 3 ranks on), so neighbours-only fails all the same."""
# expect-status: failed
# expect-fail: neighbours-only

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
    mean = torch.tensor([sum(losses) / num_microbatches], device=param.device)
    group = dist.distributed_c10d._get_default_group()  # below torch.distributed's functions: no record
    if is_last and not is_first:
        group.send([mean], 0, 0).wait()
    elif is_first and not is_last:
        group.recv([mean], world_size - 1, 0).wait()
        print(f"loss {mean.item():.4f}")
    return mean.item() if is_last else None
