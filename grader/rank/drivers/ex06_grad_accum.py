"""Exercise 06: gradient accumulation under DistributedDataParallel: the drivers, run in each rank (the checks
that decide: grader/checks/ex06_grad_accum.py).

Wrap a small model (one DDP bucket) in torch's DDP with a communication hook of the grader's own, which
records every gradient all-reduce DDP makes: how many forwards had run by then and whether no_sync() was
active. Then call the learner's accumulate_and_step a few times with different numbers of micro-batches,
recording parameters before and after, the returned loss and the gradients left behind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.child import RankContext


SEED = 6
LR = 0.1
MICRO_COUNTS = (3, 1, 2)  # micro-batches per call, same on every rank
MICRO_BATCH = 4
SIZES = (5, 16, 3)  # in, hidden, out: a few hundred parameters, one DDP bucket


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.Tanh(), nn.Linear(SIZES[1], SIZES[2]))
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def micro_batch(rank: int, call: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + 1000 * call + 10 * index + rank)
    return torch.randn(MICRO_BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[2], (MICRO_BATCH,), generator=g)


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    device = ctx.device
    events: list = []
    with probes.watch_collectives(events):
        accumulate_and_step = ctx.function("accumulate_and_step")

    model = build_model().to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    seen = {"forwards": 0, "syncs": []}

    def count_forward(module, args):
        seen["forwards"] += 1

    def record_sync(state, bucket):
        # DDP calls this once per bucket for each backward that all-reduces.
        seen["syncs"].append({"after_forwards": seen["forwards"],
                              "inside_no_sync": not ddp.require_backward_grad_sync})
        mark = len(events)
        future = default_hooks.allreduce_hook(None, bucket)
        for event in events[mark:]:
            event["grader"] = True  # the hook's own all_reduce, not the learner's
        return future

    model.register_forward_pre_hook(count_forward)
    ddp.register_comm_hook(None, record_sync)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)

    calls = []
    with probes.watch_collectives(events):
        for call, count in enumerate(MICRO_COUNTS):
            micro = [tuple(t.to(device) for t in micro_batch(ctx.rank, call, i)) for i in range(count)]
            seen["forwards"], seen["syncs"] = 0, []
            before = _params(model)
            mark = len(events)
            returned = accumulate_and_step(ddp, optimizer, micro, F.cross_entropy)
            own_ops = [e["op"] for e in events[mark:] if not e.get("grader")]
            calls.append({
                "count": count,
                "before": before,
                "after": _params(model),
                "returned": _describe_value(returned),
                "syncs": list(seen["syncs"]),
                "forwards": seen["forwards"],
                "other_ops": own_ops,
                "grads_after": {n: None if p.grad is None else p.grad.detach().cpu().clone()
                                for n, p in model.named_parameters()},
            })
    return {"calls": calls}


def _params(model: nn.Module) -> dict:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def _describe_value(value) -> dict:
    if isinstance(value, bool) or value is None:
        return {"type": type(value).__name__, "value": None}
    if isinstance(value, (int, float)):
        return {"type": "float", "value": float(value)}
    if isinstance(value, torch.Tensor):
        number = float(value.detach().float().reshape(-1)[0]) if value.numel() == 1 else None
        return {"type": "Tensor", "value": number}
    return {"type": type(value).__name__, "value": None}
