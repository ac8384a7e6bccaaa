"""Ulysses with one all-to-all for q, k and v together: each tensor is cut into W parts by heads,
the parts for rank j are flattened side by side, and torch's functional all_to_all_single_autograd
(whose backward is the opposite exchange) sends them; autograd carries every gradient. The output
goes back with a second functional all-to-all. The rank and the world come from the group. Heads that
cannot be split are refused by torch._check_value, which raises ValueError (no raise statement here)."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def _exchange(rows, group):
    """rows: [W, n]; row j goes to rank j. Returns [W, n], row j from rank j."""
    world = rows.shape[0]
    out = funcol.all_to_all_single_autograd(rows.reshape(-1), [rows.numel() // world] * world,
                                            [rows.numel() // world] * world, group)
    return funcol.wait_tensor(out).reshape(rows.shape)


def _by_rank(x, world):
    """[b, h, n, d] -> [W, b * (h / W) * n * d]: the heads of rank j in row j."""
    b, h, n, d = x.shape
    return x.reshape(b, world, h // world, n, d).transpose(0, 1).reshape(world, -1)


def _from_ranks(rows, b, h_local, n, d):
    """[W, b * h_local * n * d] from every rank -> [b, h_local, W * n, d], chunks in rank order."""
    world = rows.shape[0]
    return rows.reshape(world, b, h_local, n, d).permute(1, 2, 0, 3, 4).reshape(b, h_local, world * n, d)


def ulysses_attention(q, k, v, causal=False, group=None):
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    ok = heads % world == 0 and heads % kv_heads == 0 and (kv_heads % world == 0 or world % kv_heads == 0)
    torch._check_value(ok, lambda: f"heads={heads}, kv_heads={kv_heads} cannot be shared by {world} ranks")
    if kv_heads < world:
        k, v = (t.repeat_interleave(world // kv_heads, dim=1) for t in (k, v))
    parts = [_by_rank(t, world) for t in (q, k, v)]
    sizes = [p.shape[1] for p in parts]
    received = _exchange(torch.cat(parts, dim=1), group)
    rq, rk, rv = received.split(sizes, dim=1)
    q_local = _from_ranks(rq, b, heads // world, n, d)
    k_local = _from_ranks(rk, b, k.shape[1] // world, n, d)
    v_local = _from_ranks(rv, b, v.shape[1] // world, n, d)

    out = F.scaled_dot_product_attention(q_local, k_local, v_local, is_causal=causal, enable_gqa=True)

    # back: [b, h_local, W * n, d] -> rows by the rank whose chunk they are
    h_local = out.shape[1]
    rows = out.reshape(b, h_local, world, n, d).permute(2, 0, 1, 3, 4).reshape(world, -1)
    back = _exchange(rows, group)
    return back.reshape(world, b, h_local, n, d).transpose(0, 1).reshape(b, world * h_local, n, d)
