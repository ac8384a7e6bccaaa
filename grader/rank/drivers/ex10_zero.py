"""Exercise 10: ShardedOptimizer (ZeRO stage 1): the drivers, run in each rank (the checks that decide:
grader/checks/ex10_zero.py). The ranks train the learner's optimizer only: the unsharded AdamW it must equal
is trained by the grader, outside, from the same model and batches.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from grader.rank import probes, rank_timeline
from grader.rank.child import RankContext
from grader.rank.drivers.shared.learner_errors import learner_error


LAYERS = 6  # equal layers: the parameters split evenly over 2, 3 or 6 ranks
WIDTH = 16
STEPS = 3
BATCH = 8
MODEL_SEED = 0
DATA_SEED = 10


# Not AdamW's defaults, so that kwargs that do not reach optimizer_cls show.
OPTIMIZER_KWARGS = {"lr": 0.02, "betas": (0.8, 0.95), "weight_decay": 0.05}
STALL_TIMEOUT_S = 5.0  # the last scenario's collective timeout: a rank that failed leaves the others waiting


def lr_factor(step: int) -> float:
    """The scheduler's factor on the learning rate (LambdaLR): a different rate at every step."""
    return 1.0 / (1 + step)


def build_single_parameter_model() -> nn.Module:
    """One parameter: with two ranks or more, every rank but its owner owns nothing."""
    torch.manual_seed(MODEL_SEED)
    return nn.Linear(WIDTH, WIDTH, bias=False)


def build_model() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED * 10_000 + step * 100 + rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def state_bytes(optimizers: list, exclude: set) -> int:
    """Bytes of the distinct storages of every tensor in the optimizers' ``state``, less ``exclude``."""
    storages: dict[int, int] = {}

    def walk(value, depth=0):
        if depth > 6:
            return
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in exclude:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, depth + 1)

    for optimizer in optimizers:
        walk(dict(getattr(optimizer, "state", None) or {}))
    return sum(storages.values())


def _wrap(model: nn.Module, ctx: RankContext) -> DDP:
    model.to(ctx.device)
    return DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)


def _train_step(ddp: DDP, optimizer, step: int, ctx: RankContext):
    x, y = batch(step, ctx.rank)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(ddp(x.to(ctx.device)), y.to(ctx.device))
    loss.backward()
    optimizer.step()


def _params(model: nn.Module) -> dict:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    ShardedOptimizer = ctx.function("ShardedOptimizer")

    model = build_model()
    ddp = _wrap(model, ctx)
    sharded = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **OPTIMIZER_KWARGS)

    for step in range(STEPS):
        _train_step(ddp, sharded, step, ctx)

    obs = {"sharded": _params(model)}
    index = {id(p): i for i, p in enumerate(model.parameters())}
    local = getattr(sharded, "local_optimizer", None)
    obs["is_optimizer"] = isinstance(sharded, torch.optim.Optimizer)
    obs["local_type"] = None if local is None else f"{type(local).__module__}.{type(local).__qualname__}"
    obs["local_is_adamw"] = isinstance(local, torch.optim.AdamW)
    obs["local_params"] = None if local is None else \
        [index.get(id(p), -1) for group in local.param_groups for p in group["params"]]
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    obs["state_bytes"] = state_bytes([sharded] + ([local] if local is not None else []), parameter_storages)

    sharded.zero_grad()
    obs["grads_after_zero_grad"] = [
        "none" if p.grad is None else ("zero" if not p.grad.any() else "nonzero") for p in model.parameters()
    ]
    obs["scheduled"] = _observe_scheduled(ctx, ShardedOptimizer)
    obs["owns_nothing"] = _observe_owns_nothing(ctx, ShardedOptimizer)
    return obs


def _observe_scheduled(ctx: RankContext, ShardedOptimizer) -> dict:
    """A LambdaLR scheduler on the learner's optimizer: the learning rate changes after every step."""
    from torch.optim.lr_scheduler import LambdaLR

    model = build_model()
    ddp = _wrap(model, ctx)
    sharded = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **OPTIMIZER_KWARGS)
    try:
        scheduler = LambdaLR(sharded, lr_factor)
    except Exception as exc:  # e.g. not a torch.optim.Optimizer: the observation
        return {"error": f"LambdaLR(sharded_optimizer, ...) raised {learner_error(exc)}"}
    for step in range(STEPS):
        _train_step(ddp, sharded, step, ctx)
        scheduler.step()
    return {"error": None, "sharded": _params(model),
            "lrs": [float(group["lr"]) for group in sharded.param_groups]}


def _observe_owns_nothing(ctx: RankContext, ShardedOptimizer) -> dict:
    """A model with one parameter. Last in the run: a rank that fails here may leave the others waiting
    in a broadcast, which the short timeout turns into an error instead of a hang."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    model = build_single_parameter_model()
    ddp = _wrap(model, ctx)
    out: dict = {"error": None}
    try:
        sharded = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **OPTIMIZER_KWARGS)
    except Exception as exc:  # the observation: which rank could not build its share
        sharded, out["error"] = None, f"ShardedOptimizer(...) raised {learner_error(exc)}"
    # Every rank learns whether every rank has an optimizer; if not, none steps (nobody is left waiting).
    flag = torch.tensor([0 if sharded is None else 1], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 0:
        out["skipped"] = True
        return out
    local = getattr(sharded, "local_optimizer", None)
    out["owned"] = 0 if local is None else sum(len(g["params"]) for g in local.param_groups)
    try:
        for step in range(STEPS):
            _train_step(ddp, sharded, step, ctx)
    except Exception as exc:
        out["error"] = f"step() raised {learner_error(exc)}"
        return out
    out["sharded"] = _params(model)
    return out
