"""Exercise 20, wrong on purpose: one autograd.Function for the whole method. Forward exchanges q, k
and v, runs attention without autograd and exchanges the output back, saving the head-sharded q, k and
v; backward exchanges the output's gradient, recomputes attention under autograd to get the gradients
of q, k and v, and exchanges those back. The recomputation forgets the causal mask."""
# expect-fail: causal-grads-match
# expect-pass: matches-attention grads-match causal-matches gqa-matches only-all-to-alls bytes-off-rank heads-share-held uses-group heads-refused

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


class UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.group = causal, group
        return heads_to_sequence(out, group)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        grad_out = sequence_to_heads(grad_out, ctx.group)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        grad_q, grad_k, grad_v = torch.autograd.grad(out, (q, k, v), grad_out)
        return (heads_to_sequence(grad_q, ctx.group), heads_to_sequence(grad_k, ctx.group),
                heads_to_sequence(grad_v, ctx.group), None, None)


def ulysses_attention(q, k, v, causal=False, group=None):
    world_size = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world_size or heads % kv_heads or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"cannot split {heads} heads and {kv_heads} key/value heads over {world_size} ranks")
    if kv_heads < world_size:
        k = k.repeat_interleave(world_size // kv_heads, dim=1)
        v = v.repeat_interleave(world_size // kv_heads, dim=1)
    return UlyssesAttention.apply(q, k, v, causal, group)
