"""The communicating pieces of :mod:`.capacity_model`'s frontier transformer, as autograd functions (runs in a
rank). Each keeps for backward what Megatron-LM's keeps, no more, so that the bytes autograd saves are the
ones :func:`grader.capacity.layer_activations` counts:

* ``GatherLinear``: sequence parallelism's column-parallel Linear: the input's sequence shard all-gathered
  forward, only the shard kept, gathered again backward, the input's gradient reduce-scattered (Korthikanti
  et al. 2022, section 4.2.2); ``ScatterReduce``: the row-parallel output reduce-scattered forward, its
  gradient all-gathered backward; ``ReduceForward``: all-reduce forward, identity backward.
* ``FlashAttention``: the CPU flash kernel (neither scores nor probabilities kept: Q, K, V as the one QKV
  tensor, the output and the log-sum-exp); under context parallelism K and V are all-gathered forward,
  only this rank's kept, gathered again backward and their gradients reduce-scattered (Llama 3, 3.3.2).
* ``RMSNorm`` (input and 1/rms in fp32 kept, as fused kernels keep them), ``Rotary`` (RoPE on Q and K,
  nothing kept), ``AllToAll`` (experts' dispatch and combine), ``VocabParallelCrossEntropy``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

EPS = 1e-5


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """``x`` all-gathered along ``dim`` over ``group`` (one all_gather_single)."""
    n = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype)
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def _scatter_sum(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's part along ``dim`` of the sum of ``x`` over ``group`` (one reduce_scatter_single)."""
    n = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


class GatherLinear(torch.autograd.Function):
    """x_shard (b, s/t, h) -> all-gather over the sequence -> x W^T + b; keeps x_shard and W only."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(_gather(x, group, 1), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gather(x, ctx.group, 1)  # gathered again: only the shard was kept
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ whole.reshape(-1, whole.shape[-1])
        grad_bias = grad.sum(dim=(0, 1)) if ctx.has_bias else None
        grad_x = _scatter_sum(grad @ weight, ctx.group, 1)
        return grad_x, grad_weight, grad_bias, None


class ScatterReduce(torch.autograd.Function):
    """Partial sums (b, s, h) -> reduce-scatter over the sequence forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_sum(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, 1), None


class GatherForward(torch.autograd.Function):
    """A sequence shard gathered forward (the pipeline's scatter/gather), this rank's part of the gradient back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=1)[rank].contiguous(), None


class ReduceForward(torch.autograd.Function):
    """All-reduce of partial sums forward (a row-parallel output, a vocabulary-parallel lookup), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceBackward(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's f before a column-parallel Linear)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w, computed in fp32; keeps x and 1/rms (fp32, one a token)."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
        ctx.save_for_backward(x, rstd, weight)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = (grad.float() * normed).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        g = grad.float() * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight


def rotary_tables(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.float()[:, None] * inverse[None, :]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dim of x (b, s, heads, d) by the angles of (s, d/2)."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.empty_like(x)
    out[..., 0::2] = (even * c - odd * s).to(x.dtype)
    out[..., 1::2] = (even * s + odd * c).to(x.dtype)
    return out


class Rotary(torch.autograd.Function):
    """RoPE on the Q and K heads of a fused QKV output (b, s, heads_q + 2 heads_kv, d); V copied. Keeps
    nothing for backward (the rotation's inverse needs only the angles)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, rotated_heads):
        ctx.tables, ctx.heads = (cos, sin), rotated_heads
        out = qkv.clone()
        out[:, :, :rotated_heads] = _rotate(qkv[:, :, :rotated_heads], cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.tables
        out = grad.clone()
        out[:, :, :ctx.heads] = _rotate(grad[:, :, :ctx.heads], cos, -sin)
        return out, None, None, None


class FlashAttention(torch.autograd.Function):
    """qkv (b, s, heads_q + 2 heads_kv, d) -> attention output (b, s, heads_q * d), by the CPU flash kernel.
    Keeps qkv, the output and the log-sum-exp. With ``cp_group``: K and V of every context rank's tokens."""

    @staticmethod
    def forward(ctx, qkv, heads_q, heads_kv, cp_group):
        ctx.shape, ctx.cp_group = (heads_q, heads_kv), cp_group
        q, kv = _split(qkv, heads_q, heads_kv, cp_group)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv[0], kv[1], 0.0, False)
        ctx.save_for_backward(qkv, out, lse)
        b, _, s, d = out.shape
        return out.transpose(1, 2).reshape(b, s, heads_q * d)  # a view: the kernel lays out (b, s, heads, d)

    @staticmethod
    def backward(ctx, grad):
        qkv, out, lse = ctx.saved_tensors
        heads_q, heads_kv = ctx.shape
        q, (k, v) = _split(qkv, heads_q, heads_kv, ctx.cp_group)
        b, s, _ = grad.shape
        grad_out = grad.reshape(b, s, heads_q, -1).transpose(1, 2)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse,
                                                                                          0.0, False)
        dkv = torch.cat([dk, dv], dim=1).transpose(1, 2)  # (b, s_all, 2 heads_kv, d)
        if ctx.cp_group is not None:
            dkv = _scatter_sum(dkv, ctx.cp_group, 1)
        return torch.cat([dq.transpose(1, 2), dkv], dim=2), None, None, None


def _split(qkv: torch.Tensor, heads_q: int, heads_kv: int, cp_group) -> tuple:
    """Q (b, heads_q, s, d) as a view of qkv; K and V, all-gathered over the sequence under context parallelism."""
    q = qkv[:, :, :heads_q].transpose(1, 2)
    kv = qkv[:, :, heads_q:]
    if cp_group is not None:
        kv = _gather(kv, cp_group, 1)
    kv = kv.transpose(1, 2)
    return q, (kv[:, :heads_kv], kv[:, heads_kv:])


class RingFlashAttention(torch.autograd.Function):
    """Context parallelism as a ring (ring attention): each rank's K and V block passes to the next rank
    cp - 1 times forward, the partial outputs merged by their log-sum-exp; backward the blocks pass round
    again with their gradients, which travel on to the block's owner (cp sends). Keeps only this rank's
    qkv, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, qkv, heads_q, heads_kv, cp_group):
        ctx.shape, ctx.cp_group = (heads_q, heads_kv), cp_group
        q = qkv[:, :, :heads_q].transpose(1, 2)
        block = qkv[:, :, heads_q:].contiguous()
        total = lse = None
        for step, block in _ring(block, cp_group):
            kv = block.transpose(1, 2)
            out, part = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv[:, :heads_kv], kv[:, heads_kv:],
                                                                                  0.0, False)
            if total is None:
                total, lse = out.float(), part
            else:  # merge the two softmaxes by their log-sum-exp
                merged = torch.logaddexp(lse, part)
                total = total * (lse - merged).exp().unsqueeze(-1) + out.float() * (part - merged).exp().unsqueeze(-1)
                lse = merged
        b, _, s, d = total.shape
        out = torch.empty(b, s, heads_q, d, dtype=qkv.dtype).transpose(1, 2)
        out.copy_(total)
        ctx.save_for_backward(qkv, out, lse)
        return out.transpose(1, 2).reshape(b, s, heads_q * d)

    @staticmethod
    def backward(ctx, grad):
        qkv, out, lse = ctx.saved_tensors
        heads_q, heads_kv = ctx.shape
        group = ctx.cp_group
        q = qkv[:, :, :heads_q].transpose(1, 2)
        b, s, _ = grad.shape
        grad_out = grad.reshape(b, s, heads_q, -1).transpose(1, 2)
        dq = torch.zeros(q.shape, dtype=torch.float32)
        travelling = None  # the gradient of the block now here, accumulated on its way round
        for step, block in _ring(qkv[:, :, heads_q:].contiguous(), group):
            kv = block.transpose(1, 2)
            dq_part, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, kv[:, :heads_kv], kv[:, heads_kv:], out, lse, 0.0, False)
            dq += dq_part.float()
            mine = torch.cat([dk, dv], dim=1).transpose(1, 2)  # (b, s, 2 heads_kv, d)
            travelling = mine if travelling is None else travelling + mine
            travelling = _pass(travelling, group)  # on with the block it belongs to
        return torch.cat([dq.to(qkv.dtype).transpose(1, 2), travelling], dim=2), None, None, None


def _peers(group) -> tuple[int, int]:
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    return ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]


def _pass(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` sent to the next rank of the ring, the previous rank's received in its place."""
    following, previous = _peers(group)
    out = torch.empty(x.shape, dtype=x.dtype)
    work = dist.isend(x.contiguous(), dst=following, group=group)
    dist.recv(out, src=previous, group=group)
    work.wait()
    return out


def _ring(block: torch.Tensor, group):
    """(step, the block of K and V held at that step) round the ring, this rank's own first."""
    n = dist.get_world_size(group)
    for step in range(n):
        yield step, block
        if step < n - 1:
            block = _pass(block, group)


def flash_flops() -> dict:
    """FlopCounterMode's formulas for the CPU flash kernel (torch counts the CUDA ones with these)."""
    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    ops = torch.ops.aten
    return {ops._scaled_dot_product_flash_attention_for_cpu: forward,
            ops._scaled_dot_product_flash_attention_for_cpu_backward: backward}


class AllToAll(torch.autograd.Function):
    """Rows (ep x rows_each, h) exchanged in equal blocks over the expert group, forward and backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of logits split over the vocabulary (b, s, V/t): the max, the sum of exponentials
    and the target's logit all-reduced in fp32 over the tensor group (Megatron-LM's)."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        ctx.dtype = logits.dtype
        logits = logits.float()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        local = (targets - start).clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp, total, local, mine)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        exp, total, local, mine = ctx.saved_tensors
        soft = exp / total.unsqueeze(-1)
        soft.scatter_add_(-1, local.unsqueeze(-1), -mine.float().unsqueeze(-1))
        return (soft * grad / mine.numel()).to(ctx.dtype), None, None, None
