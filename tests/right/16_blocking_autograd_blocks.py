"""Ring attention with blocking dist.send / dist.recv (even ranks send first, odd ranks receive
first, so gloo's blocking sends never all wait at once), global peer ranks from
dist.get_global_rank, the chunk lengths passed around the ring before the blocks, and a backward
whose per-block gradients come from torch.autograd.grad on a small recomputed function rather than
from hand-written formulas. Also the optional zigzag layout, written with its two halves by name."""

import math

import torch
import torch.distributed as dist


class Ring:
    """This rank's place in the ring of `group`, with global ranks for the neighbours."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        ranks = [i if group is None else dist.get_global_rank(group, i) for i in range(self.size)]
        self.next, self.prev = ranks[(self.index + 1) % self.size], ranks[(self.index - 1) % self.size]

    def pass_on(self, *tensors):
        """Send these tensors on, return the ones that arrive from behind (blocking)."""
        if self.size == 1:
            return tensors
        arrived = tuple(torch.empty_like(t) for t in tensors)
        if self.index % 2 == 0:
            for t in tensors:
                dist.send(t.contiguous(), self.next, group=self.group)
            for t in arrived:
                dist.recv(t, self.prev, group=self.group)
        else:
            for t in arrived:
                dist.recv(t, self.prev, group=self.group)
            for t in tensors:
                dist.send(t.contiguous(), self.next, group=self.group)
        return arrived


def _same_lengths(ring, n, device):
    seen = [n]
    token = torch.tensor([n], device=device)
    for _ in range(ring.size - 1):
        (token,) = ring.pass_on(token)
        seen.append(int(token))
    if len(set(seen)) > 1:
        raise ValueError(f"ring attention needs equal chunks on every rank, got lengths {sorted(set(seen))}")


def _pieces(layout, me, source, n):
    """(query rows, key rows, masked) pieces of this step; an empty list skips the block."""
    full = slice(0, n)
    if layout == "full":
        return [(full, full, False)]
    if source == me:
        return [(full, full, True)]
    if layout == "causal":
        return [(full, full, False)] if source < me else []
    early, late = slice(0, n // 2), slice(n // 2, n)  # zigzag: chunk me, then chunk 2W - 1 - me
    return [(full, early, False)] if source < me else [(late, full, False)]


def _block(q, k, v, masked, scale):
    s = torch.einsum("...id,...jd->...ij", q, k) * scale
    if masked:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, group):
        ring = Ring(group)
        _same_lengths(ring, q.shape[-2], q.device)
        scale = 1 / math.sqrt(q.shape[-1])
        n = q.shape[-2]
        out = torch.zeros_like(q)
        lse = q.new_full((*q.shape[:-1], 1), -math.inf)
        kb, vb = k, v
        for step in range(ring.size):
            for rows, cols, masked in _pieces(layout, ring.index, (ring.index - step) % ring.size, n):
                s = _block(q[..., rows, :], kb[..., cols, :], vb[..., cols, :], masked, scale)
                piece_lse = s.logsumexp(-1, keepdim=True)
                piece = torch.softmax(s, -1) @ vb[..., cols, :]
                both = torch.logaddexp(lse[..., rows, :], piece_lse)
                out[..., rows, :] = (out[..., rows, :] * (lse[..., rows, :] - both).exp()
                                     + piece * (piece_lse - both).exp())
                lse[..., rows, :] = both
            if step + 1 < ring.size:
                kb, vb = ring.pass_on(kb, vb)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group = layout, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        scale = 1 / math.sqrt(q.shape[-1])
        n = q.shape[-2]
        correction = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kb, vb = k, v
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(ring.size):
            for rows, cols, masked in _pieces(ctx.layout, ring.index, (ring.index - step) % ring.size, n):
                with torch.enable_grad():
                    qi = q[..., rows, :].detach().requires_grad_()
                    kj = kb[..., cols, :].detach().requires_grad_()
                    vj = vb[..., cols, :].detach().requires_grad_()
                    p = (_block(qi, kj, vj, masked, scale) - lse[..., rows, :]).exp()
                    # d/dS of this scalar is P * (dO V^T - D): the block's share of the softmax backward.
                    part = (dout[..., rows, :] * (p @ vj)).sum() - (correction[..., rows, :] * p).sum()
                    gq, gk, gv = torch.autograd.grad(part, (qi, kj, vj))
                dq[..., rows, :] += gq
                dk[..., cols, :] += gk
                dv[..., cols, :] += gv
            if step + 1 < ring.size:
                kb, vb, dk, dv = ring.pass_on(kb, vb, dk, dv)
        if ring.size > 1:
            dk, dv = ring.pass_on(dk, dv)  # the last hop brings each block's gradients home
        return dq, dk, dv, None, None


def ring_attention(q, k, v, causal=False, group=None):
    return _RingAttention.apply(q, k, v, "causal" if causal else "full", group)


def zigzag_ring_attention(q, k, v, group=None):
    return _RingAttention.apply(q, k, v, "zigzag", group)
