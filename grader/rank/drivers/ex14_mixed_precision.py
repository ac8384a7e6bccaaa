"""Exercise 14: train_step_amp, a mixed-precision step under DistributedDataParallel: the drivers, run in each
rank (the checks that decide: grader/checks/ex14_mixed_precision.py).

For each graded dtype, wrap a small float32 model in torch's DDP, give it plain SGD and a GradScaler of the
grader's settings, and call the learner's train_step_amp for a few steps with the grader's batches and
max_norm values. Two steps are not finite on the last rank only: at one, a gradient hook turns one gradient
entry into inf before DDP averages it (every rank's loss finite); at another, the rank's batch holds an inf,
so its own loss is NaN while the other ranks' are finite (a bad batch). Recorded per step: the parameters
before and after, the scale before and after, the dtype each linear layer computed in, the value returned, the
gradients left behind, and when the step raised, where and in what state the scaler was when the call began.
"""

from __future__ import annotations

import torch
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.child import describe_exception, RankContext


SIZES = (8, 32, 4)  # in, hidden, classes
BATCH = 8  # per rank
LR = 0.1
SEED = 14
DTYPES = ("bfloat16", "float16")  # graded on the CPU and on GPUs alike (torch 2.13 autocasts both on the CPU)


# The scaler's settings: a modest initial scale (no natural overflow in float16 on this model),
# and growth after every 2 good steps, so that a missing or repeated update() shows.
INIT_SCALE = 2.0 ** 8
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2
STEPS = 6
INF_STEP = 2  # the step whose gradient is made non-finite by a hook, on the last rank only


# The step whose batch holds an inf on the last rank only: that rank's loss is NaN, the others' finite.
# The last step but one: a rank that skipped update() there raises at the last step, after the last
# backward, so that no rank is left waiting in a collective the other never joins.
BAD_BATCH_STEP = 4
NONFINITE_STEPS = (INF_STEP, BAD_BATCH_STEP)


# What GradScaler raises when unscale_ or step comes again before update(): when a step begins
# before update() ended the previous one, or when one call unscales or steps twice.
SCALER_NOT_UPDATED = ("unscale_() is being called after step()", "step() has already been called since the last update()",
                      "unscale_() has already been called on this optimizer since the last update()")


def build_model() -> nn.Module:
    g = torch.Generator().manual_seed(SEED)
    model = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2]))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def batch(rank: int, step: int, dtype_index: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(14_000 + 1000 * dtype_index + 10 * step + rank)
    x, y = torch.randn(BATCH, SIZES[0], generator=g) * 2, torch.randint(0, SIZES[2], (BATCH,), generator=g)
    if step == BAD_BATCH_STEP and rank == world_size - 1:
        x[0, 0] = float("inf")  # one bad sample: this rank's loss is NaN, the other ranks' finite
    return x, y


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        train_step_amp = ctx.function("train_step_amp")
        return {"runs": [_observe(ctx, train_step_amp, index, getattr(torch, name), ctx.kwargs["max_norms"][index])
                         for index, name in enumerate(DTYPES)]}


def _observe(ctx: RankContext, train_step_amp, dtype_index: int, dtype: torch.dtype, max_norms: list) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    device = ctx.device
    model = build_model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_factor=GROWTH_FACTOR,
                                  backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL)
    computed_in: list = []
    hooks = [m.register_forward_hook(lambda module, args, out: computed_in.append(str(out.dtype)))
             for m in model.modules() if isinstance(m, nn.Linear)]
    first_weight = model[0].weight
    steps = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(ctx.rank, step, dtype_index, ctx.world_size))
        poison = None
        if step == INF_STEP and ctx.rank == ctx.world_size - 1:
            # Before DDP averages it: the inf reaches every rank through the all-reduce.
            poison = first_weight.register_hook(_make_inf)
        computed_in.clear()
        record = {"before": _params(model), "scale_before": float(scaler.get_scale()), "error": None,
                  "stage_before": _scaler_stage(scaler, optimizer)}
        try:
            returned = train_step_amp(ddp, optimizer, scaler, (x, y), float(max_norms[step]), dtype)
        except NotImplementedError:
            raise
        except Exception as exc:
            if step not in NONFINITE_STEPS and not any(m in str(exc) for m in SCALER_NOT_UPDATED):
                raise
            record["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            record["where"] = describe_exception(exc, ctx.learner_path)["where"]
            returned = None
        finally:
            if poison is not None:
                poison.remove()
        record.update({
            "after": _params(model),
            "scale_after": float(scaler.get_scale()),
            "computed_in": sorted(set(computed_in)),
            "returned": _describe_value(returned),
            "grads_after": [n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.any())],
        })
        steps.append(record)
        if record["error"]:
            break  # the scaler is left half-way through a step: nothing after this can be graded
    for h in hooks:
        h.remove()
    return {"dtype": str(dtype).replace("torch.", ""), "steps": steps}


def _scaler_stage(scaler, optimizer) -> str:
    """GradScaler's stage for this optimizer as a call begins: READY after update() (or before the
    first step), UNSCALED or STEPPED when the previous call left it half-way. Read from the scaler's
    own record, without touching it (indexing its defaultdict would add an entry)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    entry = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = entry.get("stage") if isinstance(entry, dict) else None
    return getattr(stage, "name", "READY")


def _make_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def _params(model: nn.Module) -> dict:
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


def _describe_value(value) -> dict:
    if value is None or isinstance(value, bool):
        return {"type": type(value).__name__, "value": None}
    if isinstance(value, (int, float)):
        return {"type": "float", "value": float(value)}
    if isinstance(value, torch.Tensor):
        number = float(value.detach().float().reshape(-1)[0]) if value.numel() == 1 else None
        return {"type": "Tensor", "value": number}
    return {"type": type(value).__name__, "value": None}
