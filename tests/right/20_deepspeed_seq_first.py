"""Ulysses the way DeepSpeed's UlyssesSPAttentionHF lays it out: sequence first, [seq, batch, heads,
head_dim], the exchange a _DimZeroAllToAll Function over dim 0 (an all-to-all over dim 0 undoes
itself, so its backward is the same call), key/value heads replicated when there are fewer than
ranks, and attention written out by hand with an explicit mask. Heads that cannot be split raise the
library's own error, a subclass of ValueError."""

import math

import torch
import torch.distributed as dist


class DimZeroAllToAll(torch.autograd.Function):
    """[W, ...] -> [W, ...]: part j goes to rank j, rank j's part comes back in its place."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        tensor = tensor.contiguous()  # before empty_like, which would copy a view's strides
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, DimZeroAllToAll.apply(ctx.group, grad)


class SequenceParallelConfigError(ValueError):
    pass


class UlyssesLayout:
    def __init__(self, group, heads, kv_heads, local_len, batch, head_dim):
        self.group = group
        self.ws = dist.get_world_size(group)
        if heads % self.ws:
            raise SequenceParallelConfigError(f"Attention head count {heads} is not divisible by SP size {self.ws}")
        if heads % kv_heads or not (kv_heads % self.ws == 0 or self.ws % kv_heads == 0):
            raise SequenceParallelConfigError(f"KV attention head count {kv_heads} does not fit SP size {self.ws} "
                                              f"and {heads} heads")
        self.kv_replication = self.ws // kv_heads if kv_heads < self.ws else 1
        self.local_q_heads = heads // self.ws
        self.local_kv_heads = max(kv_heads // self.ws, 1)
        self.local_len, self.batch, self.head_dim = local_len, batch, head_dim

    def combine(self, x, local_heads):
        """[sl_l, bs, hc, hs] -> [sl, bs, hc_l, hs]"""
        x = x.reshape(self.local_len, self.batch, self.ws, local_heads, self.head_dim)
        x = x.permute(2, 0, 1, 3, 4).contiguous()  # ws sl_l bs hc_l hs
        x = DimZeroAllToAll.apply(self.group, x)
        return x.reshape(self.ws * self.local_len, self.batch, local_heads, self.head_dim)

    def partition(self, x):
        """[sl, bs, hc_l, hs] -> [sl_l, bs, hc, hs]"""
        x = x.reshape(self.ws, self.local_len, self.batch, self.local_q_heads, self.head_dim)
        x = DimZeroAllToAll.apply(self.group, x)  # ws sl_l bs hc_l hs, part j from rank j
        return x.permute(1, 2, 0, 3, 4).reshape(self.local_len, self.batch, self.ws * self.local_q_heads,
                                                 self.head_dim)


def core_attention(q, k, v, causal):
    """[bs, hc, sl, hs] each (k and v possibly fewer heads)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        seq = scores.shape[-1]
        future = torch.arange(seq, device=q.device)[None, :] > torch.arange(seq, device=q.device)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v)


def ulysses_attention(q, k, v, causal=False, group=None):
    batch, heads, local_len, head_dim = q.shape
    layout = UlyssesLayout(group, heads, k.shape[1], local_len, batch, head_dim)
    # bs hc sl hs -> sl bs hc hs
    query, key, value = (t.permute(2, 0, 1, 3) for t in (q, k, v))
    if layout.kv_replication > 1:
        key = key.repeat_interleave(layout.kv_replication, dim=2)
        value = value.repeat_interleave(layout.kv_replication, dim=2)
    query = layout.combine(query, layout.local_q_heads)
    key = layout.combine(key, layout.local_kv_heads)
    value = layout.combine(value, layout.local_kv_heads)
    context = core_attention(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), causal)
    out = layout.partition(context.permute(2, 0, 1, 3))
    return out.permute(1, 2, 0, 3)
