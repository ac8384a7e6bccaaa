"""Exercise 53, broken: the ring is right, but written with plain tensor operations under autograd instead of an
autograd.Function: autograd saves every chunk the matmuls read (all of them, by the last step), and the gradient
of x_shard flows only through this rank's own chunk, since the received ones are not connected to anything."""
# expect-fail: never-whole-input allgather-matmul-grads
# expect-pass: allgather-matmul-output

import torch
import torch.distributed as dist


def _ring(group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return rank, size, dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def allgather_matmul(x_shard, weight, group):
    rank, size, send_to, receive_from = _ring(group)
    rows = x_shard.shape[0]
    pieces = [None] * size
    chunk = x_shard
    for step in range(size):
        if step < size - 1:
            incoming = torch.empty_like(x_shard)
            works = [dist.isend(chunk.detach().contiguous(), send_to, group=group),
                     dist.irecv(incoming, receive_from, group=group)]
        pieces[(rank - step) % size] = chunk @ weight
        if step < size - 1:
            for work in works:
                work.wait()
            chunk = incoming
    return torch.cat(pieces)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_shard, group):
        ctx.save_for_backward(x, weight_shard)
        ctx.group = group
        rank, size, send_to, receive_from = _ring(group)
        rows = x.shape[0] // size
        block = (rank - 1) % size
        total = x[block * rows:(block + 1) * rows] @ weight_shard
        for step in range(1, size):
            incoming = torch.empty_like(total)
            works = [dist.isend(total, send_to, group=group), dist.irecv(incoming, receive_from, group=group)]
            block = (rank - step - 1) % size
            mine = x[block * rows:(block + 1) * rows] @ weight_shard
            for work in works:
                work.wait()
            total = incoming + mine
        return total

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_shard = ctx.saved_tensors
        rank, size, send_to, receive_from = _ring(ctx.group)
        rows = grad_out.shape[0]
        grad_x, grad_weight = torch.empty_like(x), torch.zeros_like(weight_shard)
        chunk = grad_out.contiguous()
        for step in range(size):
            if step < size - 1:
                incoming = torch.empty_like(chunk)
                works = [dist.isend(chunk, send_to, group=ctx.group),
                         dist.irecv(incoming, receive_from, group=ctx.group)]
            source = (rank - step) % size
            grad_x[source * rows:(source + 1) * rows] = chunk @ weight_shard.t()
            grad_weight += x[source * rows:(source + 1) * rows].t() @ chunk
            if step < size - 1:
                for work in works:
                    work.wait()
                chunk = incoming
        return grad_x, grad_weight, None


def matmul_reduce_scatter(x, weight_shard, group):
    return _MatmulReduceScatter.apply(x, weight_shard, group)
