"""Exercise 53, broken: each rank starts the partial sum of its own block and passes it on, so after W - 1
steps it holds the sum of the block of the rank after it."""
# expect-fail: matmul-reduce-scatter-output

import torch
import torch.distributed as dist


def _around_the_ring(shard, group, use):
    """Call use(source, chunk) with every rank's shard, each while the next one travels; source: its group rank."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    receive_from = dist.get_global_rank(group, (rank - 1) % size)
    chunk = shard.contiguous()
    for step in range(size):
        last = step == size - 1
        if not last:
            incoming = torch.empty_like(chunk)
            works = [dist.isend(chunk, send_to, group=group), dist.irecv(incoming, receive_from, group=group)]
        use((rank - step) % size, chunk)  # the chunk in hand, while the next one is on its way
        if not last:
            for work in works:
                work.wait()
            chunk = incoming  # the one just used is dropped: never the whole input at once


def _reduce_around_the_ring(x, weight, group):
    """This rank's block of rows of the sum over the group of x @ weight, partial sums passed along the ring."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    receive_from = dist.get_global_rank(group, (rank - 1) % size)
    rows = x.shape[0] // size
    block = rank
    total = x[block * rows:(block + 1) * rows] @ weight
    for step in range(1, size):
        incoming = torch.empty_like(total)
        works = [dist.isend(total, send_to, group=group), dist.irecv(incoming, receive_from, group=group)]
        block = (rank - step) % size
        mine = x[block * rows:(block + 1) * rows] @ weight  # computed while the partial sum travels
        for work in works:
            work.wait()
        total = incoming + mine
    return total


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, group):
        ctx.save_for_backward(x_shard, weight)
        ctx.group = group
        rows = x_shard.shape[0]
        out = x_shard.new_empty(rows * dist.get_world_size(group), weight.shape[1])

        def multiply(source, chunk):
            out[source * rows:(source + 1) * rows] = chunk @ weight

        _around_the_ring(x_shard, group, multiply)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        rows = x_shard.shape[0]
        # d x_shard: every rank's grad_out @ its weight.T, summed, this rank's rows: a reduce-scatter.
        grad_x = _reduce_around_the_ring(grad_out, weight.t(), ctx.group)
        # d weight: the whole input.T @ grad_out, one chunk of rows at a time, around the ring again.
        grad_weight = torch.zeros_like(weight)

        def accumulate(source, chunk):
            grad_weight.add_(chunk.t() @ grad_out[source * rows:(source + 1) * rows])

        _around_the_ring(x_shard, ctx.group, accumulate)
        return grad_x, grad_weight, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_shard, group):
        ctx.save_for_backward(x, weight_shard)
        ctx.group = group
        return _reduce_around_the_ring(x, weight_shard, group)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_shard = ctx.saved_tensors
        rows = grad_out.shape[0]
        # Every rank's grad_out, gathered a chunk at a time: d x = gathered @ weight.T, d weight = x.T @ gathered.
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros_like(weight_shard)

        def use(source, chunk):
            grad_x[source * rows:(source + 1) * rows] = chunk @ weight_shard.t()
            grad_weight.add_(x[source * rows:(source + 1) * rows].t() @ chunk)

        _around_the_ring(grad_out, ctx.group, use)
        return grad_x, grad_weight, None


def allgather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    return _AllGatherMatmul.apply(x_shard, weight, group)


def matmul_reduce_scatter(x: torch.Tensor, weight_shard: torch.Tensor, group) -> torch.Tensor:
    return _MatmulReduceScatter.apply(x, weight_shard, group)
