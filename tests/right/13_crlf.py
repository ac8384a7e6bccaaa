"""Right answer for exercise 13 in the plainest style, saved with CRLF line endings.

A shape header before every activation (ndim, then up to four sizes); micro-batches by torch.split;
GPipe with plain blocking sends (its order never has two neighbours sending to each other); 1F1B with
isend for every send, waited for at the end; torch.autograd.backward for both.
"""
import torch
import torch.distributed as dist

HEADER = 5


def pipeline_step(stage, batch, target, num_microbatches, loss_fn, schedule="gpipe"):
    rank = dist.get_rank()
    world = dist.get_world_size()
    last = world - 1
    p = next(stage.parameters())
    blocking = schedule == "gpipe"
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError("schedule must be gpipe or 1f1b")

    if rank == 0:
        xs = torch.split(batch, batch.shape[0] // num_microbatches)
    if rank == last:
        ys = torch.split(target, target.shape[0] // num_microbatches)

    kept_in = []
    kept_out = []
    works = []
    total = 0.0

    def send(t, dst):
        if blocking:
            dist.send(t, dst)
        else:
            works.append(dist.isend(t, dst))

    def F(i):
        nonlocal total
        if rank == 0:
            x = xs[i]
        else:
            head = torch.zeros(HEADER, dtype=torch.long, device=p.device)
            dist.recv(head, rank - 1)
            x = torch.empty(head[1:1 + head[0]].tolist(), dtype=p.dtype, device=p.device)
            dist.recv(x, rank - 1)
            x.requires_grad_(True)
        y = stage(x)
        if rank == last:
            loss = loss_fn(y, ys[i])
            total += loss.item()
            y = loss / num_microbatches
        else:
            head = torch.zeros(HEADER, dtype=torch.long, device=p.device)
            head[0] = y.dim()
            head[1:1 + y.dim()] = torch.tensor(y.shape)
            send(head, rank + 1)
            send(y.detach(), rank + 1)
        kept_in.append(x)
        kept_out.append(y)

    def B(i):
        x = kept_in.pop(0)
        y = kept_out.pop(0)
        if rank == last:
            torch.autograd.backward(y)
        else:
            g = torch.empty_like(y)
            dist.recv(g, rank + 1)
            torch.autograd.backward(y, g)
        if rank > 0:
            send(x.grad, rank - 1)

    if schedule == "gpipe":
        for i in range(num_microbatches):
            F(i)
        for i in range(num_microbatches):
            B(i)
    else:
        ahead = min(world - 1 - rank, num_microbatches)
        for i in range(ahead):
            F(i)
        for i in range(num_microbatches - ahead):
            F(ahead + i)
            B(i)
        for i in range(num_microbatches - ahead, num_microbatches):
            B(i)

    for w in works:
        w.wait()
    if rank == last:
        return total / num_microbatches
    return None
