"""Exercise 20, wrong on purpose: the exchange there cuts the heads as [W, heads / W] (rank j gets
heads j * heads / W onwards), but the exchange back reads the received heads as [heads / W, W], so
every head's result lands in another head's place; backward mirrors the same mistake."""
# expect-fail: matches-attention causal-matches grads-match
# expect-pass: only-all-to-alls bytes-off-rank heads-share-held heads-refused

import torch
import torch.distributed as dist
import torch.nn.functional as F


def check_heads(heads, kv_heads, world_size):
    if heads % world_size or heads % kv_heads or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"cannot split {heads} heads and {kv_heads} key/value heads over {world_size} ranks")


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
    # received is [W, batch, local heads, chunk, d]: the heads put back local-head-major
    return received.permute(1, 2, 0, 3, 4).reshape(batch, world_size * local_heads, seq // world_size, head_dim)


class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad, ctx.group), None


def ulysses_attention(q, k, v, causal=False, group=None):
    world_size = dist.get_world_size(group)
    check_heads(q.shape[1], k.shape[1], world_size)
    if k.shape[1] < world_size:
        k = k.repeat_interleave(world_size // k.shape[1], dim=1)
        v = v.repeat_interleave(world_size // v.shape[1], dim=1)
    q, k, v = (SequenceToHeads.apply(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return HeadsToSequence.apply(out, group)
