"""Exercise 16, grader side: attention over the whole sequence in one process (causal or not), the outputs
and gradients every rank's chunk should have."""

from __future__ import annotations

import math

import torch

from grader.rank.drivers.ex16_ring_attention import CHUNK, groups_of, make_inputs


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: bool = True,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v in one process; ``mask`` (True: left out) replaces the causal one."""
    scores = q @ k.transpose(-2, -1)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    if causal and mask is None:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def reference(scenario: str, length: int, causal: bool) -> dict[str, torch.Tensor]:
    """Single-process attention of the whole sequence: the output and the gradients of q, k and v."""
    data = make_inputs(scenario, length)
    q, k, v = (data[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    out = attention(q, k, v, causal)
    (out * data["g"]).sum().backward()
    return {"output": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def expected_for(world_size: int) -> dict:
    length = CHUNK * world_size
    out = {"plain": reference("plain", length, False), "causal": reference("causal", length, True),
           "large": reference("large", length, False), "zigzag": reference("zigzag", length, True)}
    out["group"] = {len(members): reference("group", CHUNK * len(members), False)
                    for members in groups_of(world_size)}
    return out
