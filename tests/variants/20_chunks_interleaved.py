"""Exercise 20, wrong on purpose: after the all-to-all the received chunks are laid out position-major
(position p of rank j's chunk lands at p * W + j, not at j * seq / W + p), and the exchange back undoes
the same layout. Every query still meets every key, so non-causal attention is right; the causal mask,
applied to a shuffled sequence, lets queries see keys after them and hides some before."""
# expect-fail: causal-matches causal-grads-match
# expect-pass: matches-attention grads-match gqa-matches only-all-to-alls bytes-off-rank heads-share-held

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sequence_to_heads(x, group):
    world_size = dist.get_world_size(group)
    batch, heads, chunk, head_dim = x.shape
    send = x.reshape(batch, world_size, heads // world_size, chunk, head_dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # [W, batch, heads / W, chunk, d] -> [batch, heads / W, chunk, W, d]
    return received.permute(1, 2, 3, 0, 4).reshape(batch, heads // world_size, chunk * world_size, head_dim)


def heads_to_sequence(x, group):
    world_size = dist.get_world_size(group)
    batch, local_heads, seq, head_dim = x.shape
    send = x.reshape(batch, local_heads, seq // world_size, world_size, head_dim).permute(3, 0, 1, 2, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.transpose(0, 1).reshape(batch, world_size * local_heads, seq // world_size, head_dim)


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
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world_size or heads % kv_heads or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"cannot split {heads} heads and {kv_heads} key/value heads over {world_size} ranks")
    if kv_heads < world_size:
        k = k.repeat_interleave(world_size // kv_heads, dim=1)
        v = v.repeat_interleave(world_size // kv_heads, dim=1)
    q, k, v = (SequenceToHeads.apply(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return HeadsToSequence.apply(out, group)
