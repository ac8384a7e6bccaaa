"""Exercise 16, wrong on purpose: the ring is a differentiable shift (an autograd.Function that
sends to the next rank in forward and passes the gradient back in backward), and autograd does the
rest. Right numbers, but autograd saves every block it multiplied until backward: after forward
each rank holds every other rank's K and V. (Its causal path masks the future blocks instead of
skipping them: skipping would leave some ranks' shifts out of the backward graph, and their
neighbours would wait for them.)"""
# expect-fail: two-blocks-held causal-skips-future
# expect-pass: matches-attention grads-match causal-matches causal-grads-match ring-neighbours ring-hops

import math

import torch
import torch.distributed as dist


def shift(x, direction, group):
    """x to the rank `direction` steps along the ring; returns what arrives from the other side."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    requests = [dist.isend(x, group=group, group_dst=(rank + direction) % world_size),
                dist.irecv(received, group=group, group_src=(rank - direction) % world_size)]
    for request in requests:
        request.wait()
    return received


class RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return shift(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return shift(grad, -1, ctx.group), None


def ring_attention(q, k, v, causal=False, group=None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = torch.tensor([q.shape[-2], -q.shape[-2]], device=q.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    if int(length[0]) != -int(length[1]):
        raise ValueError(f"chunk lengths differ across ranks: {-int(length[1])} to {int(length[0])}")
    n = q.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = lse = None
    k_block, v_block = k, v
    for step in range(world_size):
        source = (rank - step) % world_size
        scores = q @ k_block.transpose(-2, -1) * scale
        if causal:
            queries = rank * n + torch.arange(n, device=q.device)
            keys = source * n + torch.arange(n, device=q.device)
            scores = scores.masked_fill(keys[None, :] > queries[:, None], torch.finfo(q.dtype).min)
        block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        block_out = torch.exp(scores - block_lse) @ v_block
        if out is None:
            out, lse = block_out, block_lse
        else:
            new_lse = torch.logaddexp(lse, block_lse)
            out = torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out
            lse = new_lse
        if step < world_size - 1:
            k_block = RingShift.apply(k_block, group)
            v_block = RingShift.apply(v_block, group)
    return out
