"""Ring attention in the style of FlashAttention-2's loop: a running row maximum m, a running sum l
of exp(score - m) and an unnormalised accumulator, normalised once at the end. K and V travel
stacked in one tensor, one message per hop, posted with dist.batch_isend_irecv; the ring runs the
other way round (blocks go to rank - 1); the ranks' lengths are compared through all_gather."""

import math

import torch
import torch.distributed as dist


def _peers(group):
    size, me = dist.get_world_size(group), dist.get_rank(group)
    return size, me, (me - 1) % size, (me + 1) % size  # send to the left, receive from the right


def _post_shift(tensor, group):
    _, _, left, right = _peers(group)
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, group=group, group_peer=left),
           dist.P2POp(dist.irecv, incoming, group=group, group_peer=right)]
    return dist.batch_isend_irecv(ops), incoming


def _visible(me, source, causal):
    """None: skip the block; False: every key counts; True: mask within (own block)."""
    if not causal:
        return False
    if source > me:
        return None
    return source == me


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        size, me, _, _ = _peers(group)
        lengths = [torch.zeros(1, dtype=torch.int64, device=q.device) for _ in range(size)]
        dist.all_gather(lengths, torch.tensor([q.shape[2]], device=q.device), group=group)
        if len({int(t) for t in lengths}) != 1:
            raise ValueError(f"sequence chunks differ in length across ranks: {[int(t) for t in lengths]}")
        sm_scale = q.shape[-1] ** -0.5
        n = q.shape[2]
        tri = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        m = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        l = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
        acc = torch.zeros_like(q)
        kv = torch.stack([k, v])
        for i in range(size):
            source = (me + i) % size
            pending = None
            if i + 1 < size:
                pending, kv_next = _post_shift(kv, group)
            vis = _visible(me, source, causal)
            if vis is not None:
                s = torch.einsum("bhqd,bhkd->bhqk", q, kv[0]) * sm_scale
                if vis:
                    s = s.masked_fill(tri, -math.inf)
                m_new = torch.maximum(m, s.amax(dim=-1))
                alpha = torch.exp(m - m_new)
                p = torch.exp(s - m_new.unsqueeze(-1))
                l = alpha * l + p.sum(dim=-1)
                acc = alpha.unsqueeze(-1) * acc + torch.einsum("bhqk,bhkd->bhqd", p, kv[1])
                m = m_new
            if pending is not None:
                for work in pending:
                    work.wait()
                kv = kv_next
        out = acc / l.unsqueeze(-1)
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        size, me, _, _ = _peers(ctx.group)
        sm_scale = q.shape[-1] ** -0.5
        n = q.shape[2]
        tri = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        D = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the gradients of the block in kv, travelling with it
        for i in range(size):
            source = (me + i) % size
            pending = None
            if i + 1 < size:
                pending, kv_next = _post_shift(kv, ctx.group)
            vis = _visible(me, source, ctx.causal)
            if vis is not None:
                s = torch.einsum("bhqd,bhkd->bhqk", q, kv[0]) * sm_scale
                if vis:
                    s = s.masked_fill(tri, -math.inf)
                p = torch.exp(s - lse.unsqueeze(-1))
                dkv[1] += torch.einsum("bhqk,bhqd->bhkd", p, dout)
                ds = p * (torch.einsum("bhqd,bhkd->bhqk", dout, kv[1]) - D) * sm_scale
                dq += torch.einsum("bhqk,bhkd->bhqd", ds, kv[0])
                dkv[0] += torch.einsum("bhqk,bhqd->bhkd", ds, q)
            if size > 1:
                grad_pending, dkv = _post_shift(dkv, ctx.group)
            if pending is not None:
                for work in pending:
                    work.wait()
                kv = kv_next
            if size > 1:
                for work in grad_pending:
                    work.wait()
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q, k, v, causal=False, group=None):
    return _Ring.apply(q, k, v, causal, group)
