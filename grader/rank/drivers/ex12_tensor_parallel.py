"""Exercise 12, rank side: the layers every rank builds (seeded, the same everywhere) and what a rank records
of the learner's classes in each scenario."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import all_ok, plain_tensor
from grader.rank.child import RankContext

D_MODEL = 16  # the MLP's input and output features
HIDDEN = 48  # divisible by 2, 3 and 4
BATCH, SEQ = 2, 3  # inputs are (BATCH, SEQ, features), as in a transformer
SEEDS = {"mlp": 0, "column": 1, "row": 2, "no_bias": 3}
RTOL, ATOL = 1e-5, 1e-6  # the sums over ranks are taken in another order than the dense matmul's
STALL_TIMEOUT_S = 5.0  # for the last two scenarios: a rank that failed must not leave the others waiting
# For the uneven scenario, where layers that split unevenly run forward and backward: a peer that is
# merely slow (a busy machine) must not pass for one that failed.
UNEVEN_TIMEOUT_S = 20.0


def uneven(world_size: int) -> int:
    """A feature count the world size does not divide."""
    return 4 * world_size + 1


UNEVEN_CLASSES = ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP")
# What a layer may raise at construction to refuse a split: a ValueError (the statement), or an
# AssertionError (Megatron's ensure_divisibility, picotron). Anything else is an accident of the split.
REFUSALS = ("ValueError", "AssertionError")


def build(scenario: str) -> dict:
    """The full layers, the input and the output's gradient G of one scenario, seeded, on the CPU."""
    torch.manual_seed(1000 + SEEDS[scenario])
    if scenario == "column":
        layers = {"full": nn.Linear(D_MODEL, HIDDEN)}
        x, g = (BATCH, SEQ, D_MODEL), (BATCH, SEQ, HIDDEN)
    elif scenario == "row":
        layers = {"full": nn.Linear(HIDDEN, D_MODEL)}
        x, g = (BATCH, SEQ, HIDDEN), (BATCH, SEQ, D_MODEL)
    else:
        bias = scenario != "no_bias"
        layers = {"fc1": nn.Linear(D_MODEL, HIDDEN, bias=bias), "fc2": nn.Linear(HIDDEN, D_MODEL, bias=bias)}
        x, g = (BATCH, SEQ, D_MODEL), (BATCH, SEQ, D_MODEL)
    generator = torch.Generator().manual_seed(2000 + SEEDS[scenario])
    return {**layers, "x": torch.randn(*x, generator=generator), "g": torch.randn(*g, generator=generator)}


def build_uneven(world_size: int) -> dict:
    """The layers, inputs and output gradients of the uneven scenario (n = uneven(world_size) features
    on the split dimension), seeded, on the CPU. "x_row" is the row layer's whole input (n features)."""
    n = uneven(world_size)
    torch.manual_seed(4000 + n)
    layers = {"column": nn.Linear(D_MODEL, n), "row": nn.Linear(n, D_MODEL),
              "fc1": nn.Linear(D_MODEL, n), "fc2": nn.Linear(n, D_MODEL)}
    generator = torch.Generator().manual_seed(5000 + n)
    shapes = {"x": (BATCH, SEQ, D_MODEL), "x_row": (BATCH, SEQ, n), "g_column": (BATCH, SEQ, n),
              "g": (BATCH, SEQ, D_MODEL)}
    return {**layers, **{k: torch.randn(*shape, generator=generator) for k, shape in shapes.items()}}


def block(n: int, rank: int, world_size: int) -> slice:
    size = n // world_size
    return slice(rank * size, (rank + 1) * size)


def _attribute(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


def _parameters(module: nn.Module, paths: list[str]) -> dict:
    """For each attribute path ("fc1.weight"): its value and .grad, or what is there instead."""
    out = {}
    trained = {id(p) for p in module.parameters()}  # what an optimizer over module.parameters() steps
    for path in paths:
        value = _attribute(module, path)
        if value is None:
            out[path] = {"missing": True}
        elif not isinstance(value, torch.Tensor):
            out[path] = {"missing": False, "value": plain_tensor(value)}
        else:
            out[path] = {"missing": False, "value": plain_tensor(value), "grad": plain_tensor(value.grad),
                         "in_parameters": id(value) in trained}
    return out


def held_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages of every tensor the module holds: parameters, buffers and
    tensors kept in attributes (in lists, dicts and nested modules too). A slice of a bigger tensor
    counts as its whole storage, which it keeps alive."""
    storages: dict[int, int] = {}
    seen: set[int] = set()

    def walk(value, depth: int = 0) -> None:
        if depth > 8 or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if hasattr(value, "to_local"):  # a DTensor: what this rank stores
                value = value.to_local()
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, nn.Module):
            for item in vars(value).values():
                walk(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                walk(item, depth + 1)

    walk(module)
    return sum(storages.values())


def _forward_backward(module, x: torch.Tensor, g: torch.Tensor, events: list, ctx: RankContext) -> dict:
    """module(x), then backward of sum(output * g); the output, x's gradient and the collectives of each."""
    x = x.clone().requires_grad_(True)
    start = len(events)
    y = module(x)
    forward = events[start:]
    shape_ok = isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(g.shape)
    ok = shape_ok and y.requires_grad
    run = {"output": plain_tensor(y), "forward_events": [dict(e) for e in forward], "backward_ran": False,
           "backward_events": [], "requires_grad": isinstance(y, torch.Tensor) and y.requires_grad,
           "input_grad": None}
    if not all_ok(ok, ctx.device):
        return run
    start = len(events)
    (y * g).sum().backward()
    run["backward_events"] = [dict(e) for e in events[start:]]
    run["backward_ran"] = True
    run["input_grad"] = plain_tensor(x.grad)
    return run


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    with probes.watch_collectives(events), ctx.group():
        classes = {name: ctx.function(name) for name in ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP")}
        return _observe(ctx, classes, events)


def _on_device(data: dict, ctx: RankContext) -> dict:
    return {key: value.to(ctx.device) for key, value in data.items()}


def _observe(ctx: RankContext, classes: dict, events: list) -> dict:
    obs = {}
    for scenario, name in (("column", "ColumnParallelLinear"), ("row", "RowParallelLinear")):
        data = _on_device(build(scenario), ctx)
        layer = classes[name](data["full"])
        x = data["x"]
        if scenario == "row":  # the row-parallel layer takes this rank's block of the input features
            x = x[..., block(HIDDEN, ctx.rank, ctx.world_size)].contiguous()
        g = data["g"]
        if scenario == "column":  # and the column-parallel one returns this rank's block of the output
            g = g[..., block(HIDDEN, ctx.rank, ctx.world_size)].contiguous()
        with rank_timeline.region(name):
            run = _forward_backward(layer, x, g, events, ctx)
        run["params"] = _parameters(layer, ["weight", "bias"])
        obs[scenario] = run

    # The MLP: the numbers, the collectives and the bytes held.
    data = _on_device(build("mlp"), ctx)
    mlp = classes["ParallelMLP"](data["fc1"], data["fc2"])
    with rank_timeline.region("ParallelMLP"):
        run = _forward_backward(mlp, data["x"], data["g"], events, ctx)
    run["params"] = _parameters(mlp, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
    run["held_bytes"] = held_bytes(mlp)
    obs["mlp"] = run

    # From here on a rank that fails may leave the others in a collective: a short timeout turns that
    # into an error instead of a hang.
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    obs["no_bias"] = _observe_no_bias(ctx, classes, events)
    obs["uneven"] = _observe_uneven(ctx, classes, events)
    return obs


def _observe_no_bias(ctx: RankContext, classes: dict, events: list) -> dict:
    data = _on_device(build("no_bias"), ctx)
    try:
        mlp = classes["ParallelMLP"](data["fc1"], data["fc2"])
    except Exception as exc:  # the observation: a layer without bias is not supported
        mlp, error = None, f"ParallelMLP(fc1, fc2) with bias=False layers raised {learner_error(exc)}"
    else:
        error = None
    if not all_ok(error is None, ctx.device):
        return {"error": error or "another rank could not build its ParallelMLP"}
    try:
        run = _forward_backward(mlp, data["x"], data["g"], events, ctx)
    except Exception as exc:
        return {"error": f"forward or backward with bias=False layers raised {learner_error(exc)}"}
    run["params"] = _parameters(mlp, ["fc1.weight", "fc2.weight"])
    run["biases"] = {path: type(_attribute(mlp, path)).__name__ for path in ("fc1.bias", "fc2.bias")
                     if _attribute(mlp, path) is not None}
    run["error"] = None
    return run


def _observe_uneven(ctx: RankContext, classes: dict, events: list) -> dict:
    """Each class built with a split dimension the world size does not divide: whether it refused (what it
    raised), and for what it built on every rank, its forward and backward (as in the other scenarios).

    Every rank makes the same collectives of the grader's own (which classes every rank built, the
    widths of their blocks) before any forward; a rank whose forward or backward raises makes no
    collective after it (the others time out where they wait for it)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=UNEVEN_TIMEOUT_S))
    data = _on_device(build_uneven(ctx.world_size), ctx)
    makers = {
        "ColumnParallelLinear": lambda: classes["ColumnParallelLinear"](data["column"]),
        "RowParallelLinear": lambda: classes["RowParallelLinear"](data["row"]),
        "ParallelMLP": lambda: classes["ParallelMLP"](data["fc1"], data["fc2"]),
    }
    out, built = {}, {}
    for name, make in makers.items():
        try:
            built[name] = make()
        except Exception as exc:  # the observation: a refusal, or an accident of the split
            out[name] = {"raised": type(exc).__name__, "message": str(exc)[:300]}
            continue
        weight = _attribute(built[name], "weight" if name != "ParallelMLP" else "fc1.weight")
        shape = list(plain_tensor(weight).shape) if isinstance(weight, torch.Tensor) else None
        out[name] = {"raised": None, "weight_shape": shape}
    # The widths of the column layer's block (weight rows) and of the row layer's (weight columns),
    # -1 where unknown, gathered so that each rank knows where its block starts.
    widths = torch.tensor([_width(out["ColumnParallelLinear"], 0, D_MODEL, 1),
                           _width(out["RowParallelLinear"], 1, D_MODEL, 0),
                           *[1 if name in built else 0 for name in UNEVEN_CLASSES]], device=ctx.device)
    gathered = [torch.zeros_like(widths) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, widths)
    table = [t.tolist() for t in gathered]
    everywhere = {name: all(row[2 + i] for row in table) for i, name in enumerate(UNEVEN_CLASSES)}
    for name in UNEVEN_CLASSES:
        out[name]["everywhere"] = everywhere[name]
    for i, name in enumerate(("ColumnParallelLinear", "RowParallelLinear")):
        out[name]["widths"] = [row[i] for row in table]
    for name in UNEVEN_CLASSES:
        if not everywhere[name]:
            continue
        x, g = data["x"], data["g"]
        if name != "ParallelMLP":
            widths_of = out[name]["widths"]
            if any(w < 0 for w in widths_of):
                out[name]["run"] = None  # the block of some rank is unknown: nothing can be fed
                continue
            start = sum(widths_of[:ctx.rank])
            part = slice(start, start + widths_of[ctx.rank])
            if name == "ColumnParallelLinear":
                g = data["g_column"][..., part].contiguous()
            else:
                x = data["x_row"][..., part].contiguous()
        try:
            run = _forward_backward(built[name], x, g, events, ctx)
        except Exception as exc:  # the observation; this rank makes no more collectives
            out[name]["error"] = learner_error(exc)
            break
        out[name]["run"] = {k: run[k] for k in ("output", "input_grad", "backward_ran")}
    return out


def _width(seen: dict, dim: int, other: int, other_dim: int) -> int:
    """The width of a built layer's block: its weight's size along ``dim`` (-1: unknown)."""
    shape = seen.get("weight_shape")
    if seen["raised"] is not None or not shape or len(shape) != 2 or shape[other_dim] != other:
        return -1
    return int(shape[dim])
