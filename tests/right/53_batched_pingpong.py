"""Exercise 53, right, written unlike the reference: the ring runs the other way (send to the previous rank,
receive from the next), each step's pair of transfers goes through dist.batch_isend_irecv with group_peer=
(ranks of the group, no conversion), two preallocated ping-pong buffers take turns, the matmuls are
torch.mm/torch.addmm, and allgather_matmul's backward reuses the reduce ring written for matmul_reduce_scatter."""

import torch
import torch.distributed as dist


def _pass(send, receive, to_peer, from_peer, group):
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=to_peer),
           dist.P2POp(dist.irecv, receive, group=group, group_peer=from_peer)]
    return dist.batch_isend_irecv(ops)


def _gather_ring(shard, group, visit):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    buffers = shard.new_empty((2,) + tuple(shard.shape))
    buffers[0].copy_(shard)
    for step in range(n):
        hand, spare = buffers[step % 2], buffers[(step + 1) % 2]
        pending = _pass(hand, spare, (me - 1) % n, (me + 1) % n, group) if step < n - 1 else []
        visit((me + step) % n, hand)  # the ring runs backwards: the chunk in hand is rank me + step's
        for request in pending:
            request.wait()


def _reduce_ring(x, w, group):
    me, n = dist.get_rank(group), dist.get_world_size(group)
    rows = x.shape[0] // n
    acc = x.new_empty(2, rows, w.shape[1])
    block = (me + 1) % n
    torch.mm(x[block * rows:(block + 1) * rows], w, out=acc[0])
    for step in range(1, n):
        pending = _pass(acc[(step - 1) % 2], acc[step % 2], (me - 1) % n, (me + 1) % n, group)
        block = (me + step + 1) % n
        mine = torch.mm(x[block * rows:(block + 1) * rows], w)
        for request in pending:
            request.wait()
        acc[step % 2] += mine
    return acc[(n - 1) % 2].clone()


class AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, group):
        ctx.save_for_backward(x_shard, weight)
        ctx.group = group
        rows = x_shard.shape[0]
        out = torch.empty(rows * dist.get_world_size(group), weight.shape[1], dtype=weight.dtype)

        def visit(owner, chunk):
            torch.mm(chunk, weight, out=out[owner * rows:(owner + 1) * rows])

        _gather_ring(x_shard, group, visit)
        return out

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        rows = x_shard.shape[0]
        grad_x = _reduce_ring(grad, weight.t(), ctx.group)
        grad_w = torch.zeros_like(weight)

        def visit(owner, chunk):
            torch.addmm(grad_w, chunk.t(), grad[owner * rows:(owner + 1) * rows], out=grad_w)

        _gather_ring(x_shard, ctx.group, visit)
        return grad_x, grad_w, None


class MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_shard, group):
        ctx.save_for_backward(x, weight_shard)
        ctx.group = group
        return _reduce_ring(x, weight_shard, group)

    @staticmethod
    def backward(ctx, grad):
        x, weight_shard = ctx.saved_tensors
        rows = grad.shape[0]
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight_shard)

        def visit(owner, chunk):
            torch.mm(chunk, weight_shard.t(), out=grad_x[owner * rows:(owner + 1) * rows])
            torch.addmm(grad_w, x[owner * rows:(owner + 1) * rows].t(), chunk, out=grad_w)

        _gather_ring(grad.contiguous(), ctx.group, visit)
        return grad_x, grad_w, None


def allgather_matmul(x_shard, weight, group):
    return AllGatherMatmul.apply(x_shard, weight, group)


def matmul_reduce_scatter(x, weight_shard, group):
    return MatmulReduceScatter.apply(x, weight_shard, group)
