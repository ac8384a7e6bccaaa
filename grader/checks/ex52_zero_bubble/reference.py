"""Exercise 52's expected values, computed in the grader's process: each stage's gradients and the loss of the
whole model on the whole batch, and the order of passes ZB-H1 runs on each rank (with 1F1B's beside it, whose
idle slots the bubble is measured against)."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex52_zero_bubble import WIDTHS, build_stages, loss_fn, make_batch


def cases_for(world_size: int) -> list[dict]:
    """The steps of one run: twice as many micro-batches as ranks, then one more than ranks (other rows)."""
    w = max(world_size, 1)
    return [{"index": 0, "num_microbatches": 2 * w, "rows": 4},
            {"index": 1, "num_microbatches": w + 1, "rows": 3}]


def activation_bytes(case: dict, link: int) -> int:
    """Bytes of one micro-batch's activation from stage ``link`` to stage ``link + 1`` (and of its gradient)."""
    return case["rows"] * WIDTHS[link + 1] * 8  # float64


def expected_step(seed: int, case: dict, world_size: int) -> tuple[list[dict], float]:
    """Each stage's gradients and the loss, for the whole batch through the whole model in one process."""
    stages = build_stages(seed, world_size)
    batch, target = make_batch(seed, case)
    out = batch
    for stage in stages:
        out = stage(out)
    loss = loss_fn(out, target)
    loss.backward()
    grads = [{name: p.grad.detach().clone() for name, p in stage.named_parameters()} for stage in stages]
    return grads, loss.item()


def zb_h1_order(rank: int, world_size: int, m: int) -> list[str]:
    """ZB-H1's passes on one rank (Qi et al. 2024, Figure 3; torch.distributed.pipelining's
    ScheduleInterleavedZeroBubble with one stage per rank): W - r - 1 forwards, r rounds of F B, rounds of F B W
    while forwards remain, B W for each backward left, then the W's still waiting, each W the oldest waiting."""
    warmup = min(world_size - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    next_w = 0
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
        if i >= rank:
            order.append(f"W{next_w}")
            next_w += 1
    for i in range(m - warmup, m):
        order += [f"B{i}", f"W{next_w}"]
        next_w += 1
    return order + [f"W{i}" for i in range(next_w, m)]


def one_f_one_b_order(rank: int, world_size: int, m: int) -> list[str]:
    """13's 1F1B with each backward's two passes back to back (B then W, its input's gradient sent after both)."""
    warmup = min(world_size - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}", f"W{i}"]
    for i in range(m - warmup, m):
        order += [f"B{i}", f"W{i}"]
    return order


def with_sends(order: list[str], rank: int, world_size: int, *, fused: bool) -> list[str]:
    """A rank's passes with its sends where they go: each activation (">F3") right after its forward; each
    input gradient ("<B3") right after its B, or after its W when the two are one backward (``fused``)."""
    out = []
    for label in order:
        out.append(label)
        if label[0] == "F" and rank < world_size - 1:
            out.append(">" + label)
        if rank > 0 and label[0] == ("W" if fused else "B"):
            out.append("<B" + label[1:])
    return out


def expected_runs(world_size: int, m: int) -> dict:
    """ZB-H1's and 1F1B's token sequences (passes and sends) on every rank."""
    return {"zb-h1": [with_sends(zb_h1_order(r, world_size, m), r, world_size, fused=False)
                      for r in range(world_size)],
            "1f1b": [with_sends(one_f_one_b_order(r, world_size, m), r, world_size, fused=True)
                     for r in range(world_size)]}


def grads_as_float64(grads: list[dict]) -> list[dict]:
    return [{name: g.to(torch.float64) for name, g in stage.items()} for stage in grads]
