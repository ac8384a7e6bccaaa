"""Exercise 20, wrong on purpose: grouped-query key/value heads are expanded to one per query head
(repeat_interleave by heads / kv_heads, as a single-process attention would) before the exchange.
The results are right, but k and v travel heads / kv_heads times over, where copying them up to W
heads, and only when there are fewer than W, is all the exchange needs."""
# expect-fail: bytes-off-rank
# expect-message: bytes-off-rank too many bytes
# expect-pass: matches-attention grads-match causal-matches causal-grads-match gqa-matches only-all-to-alls heads-share-held uses-group heads-refused

import torch
import torch.distributed as dist
import torch.nn.functional as F


def check_heads(heads, kv_heads, world_size):
    """Every rank has the same shapes, so every rank raises here, before any message."""
    if heads % world_size:
        raise ValueError(f"{heads} attention heads cannot be split evenly over {world_size} ranks")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads over {world_size} ranks: neither divides the other")


def sequence_to_heads(x, group):
    """[batch, heads, seq / W, head_dim] -> [batch, heads / W, seq, head_dim]."""
    world_size = dist.get_world_size(group)
    batch, heads, chunk, head_dim = x.shape
    # all_to_all_single sends slice j of dim 0 to rank j: put rank j's heads there.
    send = x.reshape(batch, world_size, heads // world_size, chunk, head_dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[j] is rank j's chunk of the sequence for this rank's heads: line the chunks up.
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * chunk, head_dim)


def heads_to_sequence(x, group):
    """[batch, heads / W, seq, head_dim] -> [batch, heads, seq / W, head_dim]."""
    world_size = dist.get_world_size(group)
    batch, local_heads, seq, head_dim = x.shape
    send = x.reshape(batch, local_heads, world_size, seq // world_size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[j] is rank j's heads for this rank's chunk: heads in rank order.
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
    check_heads(heads, kv_heads, world_size)
    # one key/value head per query head, as if there were no grouping
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (SequenceToHeads.apply(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return HeadsToSequence.apply(out, group)
