"""Exercise 20, wrong on purpose: to keep nothing head-sharded between forward and backward, one
autograd.Function saves only this rank's q, k and v and, in backward, exchanges them again to
recompute attention (activation checkpointing of the whole method). The gradients are right, but
backward runs seven all-to-alls where the method needs four, and sends q, k and v a second time."""
# expect-fail: only-all-to-alls bytes-off-rank
# expect-pass: matches-attention grads-match causal-matches causal-grads-match gqa-matches heads-share-held uses-group heads-refused

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sequence_to_heads(x, group):
    world_size = dist.get_world_size(group)
    batch, heads, chunk, head_dim = x.shape
    send = x.reshape(batch, world_size, heads // world_size, chunk, head_dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * chunk, head_dim)


def heads_to_sequence(x, group):
    world_size = dist.get_world_size(group)
    batch, local_heads, seq, head_dim = x.shape
    send = x.reshape(batch, local_heads, world_size, seq // world_size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.transpose(0, 1).reshape(batch, world_size * local_heads, seq // world_size, head_dim)


def attend(q, k, v, causal, group):
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    return q, k, v, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


class CheckpointedUlysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.group = causal, group
        return heads_to_sequence(attend(q, k, v, causal, group)[3], group)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _ = attend(*ctx.saved_tensors, ctx.causal, ctx.group)  # the exchange again
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=ctx.causal, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), sequence_to_heads(grad_out, ctx.group))
        return (*(heads_to_sequence(grad, ctx.group) for grad in grads), None, None)


def ulysses_attention(q, k, v, causal=False, group=None):
    world_size = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world_size or heads % kv_heads or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"cannot split {heads} heads and {kv_heads} key/value heads over {world_size} ranks")
    if kv_heads < world_size:
        k = k.repeat_interleave(world_size // kv_heads, dim=1)
        v = v.repeat_interleave(world_size // kv_heads, dim=1)
    return CheckpointedUlysses.apply(q, k, v, causal, group)
