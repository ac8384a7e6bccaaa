"""Exercise 16, wrong on purpose: every rank all-gathers K and V and computes its queries'
attention against the whole sequence; backward all-reduces the whole dK and dV and keeps its own
chunk. Right numbers, but every rank holds the whole sequence's K and V, and talks to every rank
through collectives: no ring."""
# expect-fail: ring-neighbours ring-hops two-blocks-held
# expect-pass: matches-attention grads-match causal-matches causal-grads-match causal-skips-future

import math

import torch
import torch.distributed as dist


class GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        n = q.shape[-2]
        k_all = [torch.empty_like(k) for _ in range(world_size)]
        v_all = [torch.empty_like(v) for _ in range(world_size)]
        dist.all_gather(k_all, k.contiguous(), group=group)
        dist.all_gather(v_all, v.contiguous(), group=group)
        # With causal=True only the keys up to the end of this rank's chunk matter.
        last = (rank + 1) * n if causal else world_size * n
        keys, values = torch.cat(k_all, dim=-2)[..., :last, :], torch.cat(v_all, dim=-2)[..., :last, :]
        scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            positions = rank * n + torch.arange(n, device=q.device)
            scores = scores.masked_fill(torch.arange(last, device=q.device)[None, :] > positions[:, None],
                                        float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(q, keys, values, probs)
        ctx.group, ctx.world_size, ctx.rank, ctx.n = group, world_size, rank, n
        return probs @ values

    @staticmethod
    def backward(ctx, grad_out):
        q, keys, values, probs = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        grad_values = probs.transpose(-2, -1) @ grad_out
        grad_probs = grad_out @ values.transpose(-2, -1)
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * scale
        grad_q = grad_scores @ keys
        grad_keys = grad_scores.transpose(-2, -1) @ q
        shape = (*q.shape[:-2], ctx.world_size * ctx.n, q.shape[-1])
        grad_k_all = torch.zeros(shape, dtype=q.dtype, device=q.device)
        grad_v_all = torch.zeros(shape, dtype=q.dtype, device=q.device)
        grad_k_all[..., :keys.shape[-2], :] = grad_keys
        grad_v_all[..., :keys.shape[-2], :] = grad_values
        dist.all_reduce(grad_k_all, group=ctx.group)
        dist.all_reduce(grad_v_all, group=ctx.group)
        mine = slice(ctx.rank * ctx.n, (ctx.rank + 1) * ctx.n)
        return grad_q, grad_k_all[..., mine, :].clone(), grad_v_all[..., mine, :].clone(), None, None


def ring_attention(q, k, v, causal=False, group=None):
    length = torch.tensor([q.shape[-2], -q.shape[-2]], device=q.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
    if int(length[0]) != -int(length[1]):
        raise ValueError(f"chunk lengths differ across ranks: {-int(length[1])} to {int(length[0])}")
    return GatheredAttention.apply(q, k, v, causal, group)
