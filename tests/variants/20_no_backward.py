"""Exercise 20, wrong on purpose: the all-to-alls are plain dist.all_to_all_single calls into fresh
buffers, with no autograd.Function around them. The output is right, but nothing connects it to q, k
and v: autograd has no way back through the exchanges."""
# expect-fail: grads-match causal-grads-match gqa-matches
# expect-pass: matches-attention causal-matches only-all-to-alls heads-refused

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


def ulysses_attention(q, k, v, causal=False, group=None):
    world_size = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world_size or heads % kv_heads or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"cannot split {heads} heads and {kv_heads} key/value heads over {world_size} ranks")
    if kv_heads < world_size:
        k = k.repeat_interleave(world_size // kv_heads, dim=1)
        v = v.repeat_interleave(world_size // kv_heads, dim=1)
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return heads_to_sequence(out, group)
