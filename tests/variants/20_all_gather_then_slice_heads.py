"""Exercise 20, wrong on purpose: each rank all-gathers q, k and v along the sequence (the functional
all_gather_tensor_autograd, which reduce-scatters the gradients in backward), keeps the slice of its
heads, runs attention, and all-gathers the output's heads before cutting out its own positions. The
numbers are right, but every rank briefly holds every head's whole sequence, and W times the bytes
travel: it is all-gather context parallelism, not Ulysses."""
# expect-fail: only-all-to-alls heads-share-held
# expect-not-checked: bytes-off-rank
# expect-pass: matches-attention grads-match causal-matches causal-grads-match gqa-matches heads-refused

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def gather(x, dim, group):
    """Every rank's x, concatenated along dim (differentiable)."""
    world_size = dist.get_world_size(group)
    stacked = funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=0, group=group or dist.group.WORLD)
    return torch.cat(stacked.chunk(world_size, dim=0), dim=dim) if world_size > 1 else stacked


def ulysses_attention(q, k, v, causal=False, group=None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world_size or heads % kv_heads or (kv_heads % world_size and world_size % kv_heads):
        raise ValueError(f"cannot split {heads} heads and {kv_heads} key/value heads over {world_size} ranks")
    chunk = q.shape[2]
    per_rank, kv_per_rank = heads // world_size, max(kv_heads // world_size, 1)
    kv_first = rank * per_rank // (heads // kv_heads)
    q_all, k_all, v_all = (gather(t, 2, group) for t in (q, k, v))
    mine = F.scaled_dot_product_attention(q_all[:, rank * per_rank:(rank + 1) * per_rank],
                                          k_all[:, kv_first:kv_first + kv_per_rank],
                                          v_all[:, kv_first:kv_first + kv_per_rank], is_causal=causal, enable_gqa=True)
    out = gather(mine, 1, group)
    return out[:, :, rank * chunk:(rank + 1) * chunk]
