"""Exercise 20, wrong on purpose: the all-to-all sends each rank this rank's whole chunk (every head,
x expanded W times) and the receiver keeps the heads it needs. The output is right, but W - 1 times
too many bytes leave each rank, and every rank receives every head's whole sequence."""
# expect-fail: bytes-off-rank heads-share-held
# expect-pass: matches-attention grads-match causal-matches causal-grads-match gqa-matches only-all-to-alls heads-refused

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sequence_to_heads(x, group):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, heads, chunk, head_dim = x.shape
    send = x.unsqueeze(0).expand(world_size, *x.shape).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # received[j]: rank j's whole chunk
    per_rank = heads // world_size
    mine = received[:, :, rank * per_rank:(rank + 1) * per_rank]
    return mine.permute(1, 2, 0, 3, 4).reshape(batch, per_rank, world_size * chunk, head_dim)


def heads_to_sequence(x, group):
    world_size = dist.get_world_size(group)
    batch, local_heads, seq, head_dim = x.shape
    send = x.reshape(batch, local_heads, world_size, seq // world_size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.transpose(0, 1).reshape(batch, world_size * local_heads, seq // world_size, head_dim)


def heads_to_sequence_whole(grad, group):
    """Backward of sequence_to_heads: the same wide exchange, each rank's gradients for every chunk."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, local_heads, seq, head_dim = grad.shape
    chunk = seq // world_size
    full = grad.new_zeros(world_size, batch, local_heads * world_size, chunk, head_dim)
    parts = grad.reshape(batch, local_heads, world_size, chunk, head_dim).permute(2, 0, 1, 3, 4)
    full[:, :, rank * local_heads:(rank + 1) * local_heads] = parts
    received = torch.empty_like(full)
    dist.all_to_all_single(received, full.contiguous(), group=group)
    return received.sum(0)


class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence_whole(grad, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        world_size = dist.get_world_size(ctx.group)
        batch, heads, chunk, head_dim = grad.shape
        send = grad.reshape(batch, world_size, heads // world_size, chunk, head_dim).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * chunk, head_dim), None


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
