"""Exercise 20, grader side: single-process attention over the whole sequence (every head, grouped-query
pairs as torch pairs them), its gradients, and what each rank should send."""

from __future__ import annotations

import functools
import math

import torch

from grader.rank.drivers.ex20_ulysses import BATCH, CHUNK, DTYPE, HEAD_DIM, make_inputs, replication, shapes


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, *, scale: float | None = None,
              over: int = -1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v, query head h with key/value head h // (heads / kv_heads). The verdicts
    name wrong answers with the other arguments: ``scale`` in place of 1 / sqrt(head_dim), the softmax ``over``
    another dimension, ``mask`` (True where a query may not attend) in place of the causal one."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1)
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    n = scores.shape[-1]
    if mask is None and causal:
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=over) @ v


@functools.cache
def expected(scenario: str, world_size: int) -> dict[str, torch.Tensor]:
    """The output and the gradients of q, k and v of sum(output * g) over the whole sequence."""
    data = make_inputs(scenario, world_size)
    q, k, v = (data[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    out = attention(q, k, v, shapes(scenario, world_size)[2])
    (out * data["g"]).sum().backward()
    return {"output": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def local_bytes(heads: int) -> int:
    """Bytes of one rank's chunk of a tensor of ``heads`` heads: [batch, heads, seq / W, head_dim], float64."""
    return BATCH * heads * CHUNK * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def bytes_to_send(scenario: str, world_size: int) -> int:
    """Bytes each rank sends off-rank each way: (W - 1) / W of q, of k and v (their copies, with fewer key/value
    heads than ranks) and of the output (q's size); backward the same of their gradients."""
    heads, kv_heads, _ = shapes(scenario, world_size)
    exchanged = 2 * local_bytes(heads) + 2 * replication(kv_heads, world_size) * local_bytes(kv_heads)
    return exchanged * (world_size - 1) // world_size
