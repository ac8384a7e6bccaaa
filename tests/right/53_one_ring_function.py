"""Exercise 53, right, in another shape: one generator walks the ring and yields each chunk while the next is on
its way (isend/irecv with group_dst=/group_src=, the works waited for when the generator resumes); the outputs
are assembled from a list of per-chunk products with torch.cat, the matmuls written as F.linear and einsum, and
the backward of matmul_reduce_scatter computes both gradients from each chunk of grad_out in turn."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def ring(shard, group):
    """Yield (owner, chunk) for every rank's shard, in ring order, each while the next one travels."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    hand = shard.contiguous()
    for step in range(size):
        works, nxt = [], None
        if step + 1 < size:
            nxt = torch.empty_like(hand)
            works.append(dist.isend(hand, group=group, group_dst=(me + 1) % size))
            works.append(dist.irecv(nxt, group=group, group_src=(me - 1) % size))
        yield (me - step) % size, hand
        for work in works:
            work.wait()
        hand = nxt


def reduce_ring(x, weight, group):
    me, size = dist.get_rank(group), dist.get_world_size(group)
    rows = x.shape[0] // size
    blocks = x.split(rows)
    partial = torch.einsum("rk,km->rm", blocks[(me - 1) % size], weight)
    for step in range(1, size):
        arriving = torch.empty_like(partial)
        works = [dist.isend(partial, group=group, group_dst=(me + 1) % size),
                 dist.irecv(arriving, group=group, group_src=(me - 1) % size)]
        own = torch.einsum("rk,km->rm", blocks[(me - step - 1) % size], weight)
        for work in works:
            work.wait()
        partial = arriving.add(own)
    return partial


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, group):
        ctx.save_for_backward(x_shard, weight)
        ctx.group = group
        pieces = dict((owner, F.linear(chunk, weight.t())) for owner, chunk in ring(x_shard, group))
        return torch.cat([pieces[i] for i in range(len(pieces))])

    @staticmethod
    def backward(ctx, g):
        x_shard, weight = ctx.saved_tensors
        rows = x_shard.shape[0]
        dw = sum(torch.einsum("rk,rm->km", chunk, g[owner * rows:(owner + 1) * rows])
                 for owner, chunk in ring(x_shard, ctx.group))
        return reduce_ring(g, weight.t(), ctx.group), dw, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_shard, group):
        ctx.save_for_backward(x, weight_shard)
        ctx.group = group
        return reduce_ring(x, weight_shard, group)

    @staticmethod
    def backward(ctx, g):
        x, weight_shard = ctx.saved_tensors
        rows = g.shape[0]
        dx = torch.zeros_like(x)
        dw = torch.zeros_like(weight_shard)
        for owner, chunk in ring(g, ctx.group):
            dx[owner * rows:(owner + 1) * rows] = F.linear(chunk, weight_shard)
            dw += x[owner * rows:(owner + 1) * rows].t() @ chunk
        return dx, dw, None


def allgather_matmul(x_shard, weight, group):
    return _Gather.apply(x_shard, weight, group)


def matmul_reduce_scatter(x, weight_shard, group):
    return _Scatter.apply(x, weight_shard, group)
