"""Exercise 19, rank side: the data and the MLP every rank builds, which group a rank belongs to, and what a rank
records of the learner's make_groups and train_2d: the groups it made, every collective with its group, the
timeline of each step, the state at the end, and what bad input does."""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.drivers.shared.recording import all_ok
from grader.rank.child import RankContext

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 32, 8  # the stub's
SEED = 19  # the stub's dense_layers()
ROWS = 16  # the global batch
STEPS = 3
LR = 0.3
DTYPE = torch.float64
STALL_TIMEOUT_S = 15.0  # how long a rank waits for its peers in a group call, a new group or a collective
SMALL_MESSAGE = 32  # bytes: up to four float64 numbers (a loss, a count), never a gradient
PARAMETERS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")  # the stub's TensorParallelMLP
STATE_KEYS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")  # what train_2d returns
UNEVEN_ROWS = ROWS + 1  # bad_main: rows that do not split into equal data-parallel shards


def tp_size_for(world_size: int) -> int:
    """The tensor-parallel size graded at ``world_size``: 2 from four ranks on (where it divides the world),
    else 1 (every tensor-parallel group one rank, the data-parallel group the whole world)."""
    return 2 if world_size >= 4 and world_size % 2 == 0 else 1


def groups_of(rank: int, world_size: int, tp_size: int) -> tuple[list[int], list[int]]:
    """Rank ``rank``'s data-parallel group (its column: one rank of each tensor-parallel group) and
    tensor-parallel group (its row: consecutive ranks), as global ranks."""
    row = rank // tp_size
    return list(range(rank % tp_size, world_size, tp_size)), list(range(row * tp_size, (row + 1) * tp_size))


def dense_layers() -> tuple[nn.Linear, nn.Linear]:
    """The stub's fc1 and fc2 (the same seed), float64."""
    torch.manual_seed(SEED)
    fc1 = nn.Linear(IN_FEATURES, HIDDEN, dtype=DTYPE)
    fc2 = nn.Linear(HIDDEN, OUT_FEATURES, dtype=DTYPE)
    return fc1, fc2


def make_data(rows: int = ROWS, seed: int = 1900) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [rows, IN_FEATURES], targets [rows, OUT_FEATURES]), float64, seeded: every row distinct."""
    generator = torch.Generator().manual_seed(seed + rows)
    return (torch.randn(rows, IN_FEATURES, generator=generator, dtype=DTYPE),
            torch.randn(rows, OUT_FEATURES, generator=generator, dtype=DTYPE))


# --- dist.new_group, every rank alike -------------------------------------------------------------


class GroupCallsDiffer(RuntimeError):
    """The ranks' n-th dist.new_group calls differ, or some rank made none (raised by the grader's watch,
    where torch would hang or abort)."""


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@contextlib.contextmanager
def watch_new_groups(calls: list, rank: int, world_size: int):
    """Record every new group made (``{"ranks", "local"}``) and compare each call made without
    use_local_synchronization across the ranks before torch makes the group."""
    original = c10d._new_group_with_tag
    signature = inspect.signature(original)
    counter = {"n": 0}

    def made(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        ranks = bound.get("ranks")
        ranks = sorted(int(r) for r in ranks) if ranks is not None else list(range(world_size))
        local = bool(bound.get("use_local_synchronization", False))
        calls.append({"ranks": ranks, "local": local})
        if not local:
            counter["n"] += 1
            _agree_on_call(counter["n"], ranks, rank, world_size)
        return original(*args, **kwargs)

    c10d._new_group_with_tag = made
    try:
        yield calls
    finally:
        c10d._new_group_with_tag = original


def _agree_on_call(n: int, ranks: list[int], rank: int, world_size: int) -> None:
    store = c10d._get_default_store()
    key = f"ex19/new_group/{n}"
    store.set(f"{key}/{rank}", json.dumps(ranks))
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=STALL_TIMEOUT_S))
    except Exception:
        missing = [r for r in range(world_size) if not store.check([f"{key}/{r}"])]
        raise GroupCallsDiffer(
            f"this rank's {_ordinal(n)} dist.new_group call (ranks {ranks}) has no counterpart on rank(s) "
            f"{missing} within {STALL_TIMEOUT_S:g} s: every rank must call new_group for every group, "
            "in the same order, members or not") from None
    seen = {r: json.loads(store.get(f"{key}/{r}").decode()) for r in range(world_size)}
    if any(other != ranks for other in seen.values()):
        listing = "; ".join(f"rank {r}: {v}" for r, v in seen.items())
        raise GroupCallsDiffer(f"the ranks' {_ordinal(n)} dist.new_group calls differ ({listing}): every rank "
                               "must call new_group for every group, in the same order, members or not")


def shorten_timeouts() -> None:
    """From here on a peer left waiting raises within STALL_TIMEOUT_S (a new group's connection, its
    collectives, the store) instead of hanging until the grader's deadline."""
    c10d.default_pg_timeout = timedelta(seconds=STALL_TIMEOUT_S)  # new groups made without a timeout
    with contextlib.suppress(Exception):
        c10d._get_default_store().set_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    c10d._set_pg_timeout(timedelta(seconds=3 * STALL_TIMEOUT_S))  # the world outlasts a stalled subgroup


# --- the timeline of train_2d ---------------------------------------------------------------------


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in module.parameters()] or
                     [torch.zeros(0, dtype=torch.float64)])


def _local_name(name: str) -> str:
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


class Timeline(list):
    """Events in order. Forwards of an outermost module come from module hooks; collectives from
    ``probes.watch_groups``, which appends each as it is called: each is marked with whether a forward
    was running and whether the model's parameters changed since the last forward began."""

    def __init__(self):
        super().__init__()
        self.depth = threading.local()
        self.module: nn.Module | None = None
        self.at_forward: torch.Tensor | None = None
        self.forwards = 0

    def in_forward(self) -> bool:
        return getattr(self.depth, "value", 0) > 0

    def append(self, event) -> None:
        if isinstance(event, dict) and "group" in event:
            event = {**event, "kind": "collective", "in_forward": self.in_forward(), "after_forwards": self.forwards,
                     "updated": self._updated()}
        super().append(event)

    def _updated(self) -> bool | None:
        if self.module is None or self.at_forward is None:
            return None
        now = _flat(self.module)
        return not (now.shape == self.at_forward.shape and torch.equal(now, self.at_forward))

    def before_forward(self, module: nn.Module, args) -> None:
        depth = getattr(self.depth, "value", 0)
        self.depth.value = depth + 1
        if depth:
            return
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.module = module
        self.at_forward = _flat(module)
        self.forwards += 1
        super().append({
            "kind": "forward", "grad": torch.is_grad_enabled(), "module": type(module).__name__,
            "input": None if first is None else first.detach().to("cpu", copy=True),
            "params": {_local_name(n): p.detach().to("cpu", copy=True) for n, p in module.named_parameters()},
        })

    def after_forward(self, *_) -> None:
        self.depth.value = max(0, getattr(self.depth, "value", 1) - 1)


@contextlib.contextmanager
def watch_forwards(timeline: Timeline):
    """Global module hooks for the time of train_2d: every module called, the outermost one recorded."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(lambda m, a: timeline.before_forward(m, a)),
               register_module_forward_hook(lambda m, a, o: timeline.after_forward())]
    try:
        yield timeline
    finally:
        for handle in handles:
            handle.remove()


# --- what a rank records ----------------------------------------------------------------------------


def _failure(exc: BaseException, learner_path: str | None = None) -> dict:
    line = None
    if learner_path:
        for frame in traceback.extract_tb(exc.__traceback__):
            if frame.filename == learner_path:
                line = f"line {frame.lineno}: {(frame.line or '').strip()}"
    return {"type": type(exc).__name__, "message": str(exc)[:500], "line": line,
            "group_calls": isinstance(exc, GroupCallsDiffer)}


def describe_groups(returned) -> dict:
    """What make_groups returned: two groups, each as global ranks (None where torch cannot say)."""
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        kind = type(returned).__name__ + (f" of {len(returned)}" if isinstance(returned, (tuple, list)) else "")
        return {"shape": kind}
    out = {"shape": None}
    for name, group in zip(("dp", "tp"), returned):
        out[name] = probes.group_ranks(group) if group is not None else None
        out[f"{name}_type"] = type(group).__name__
    return out


def probe_groups(returned, rank: int, world_size: int) -> dict:
    """Which global ranks take part in an all-reduce on each group returned (a one-hot vector summed)."""
    out = {}
    for name, group in zip(("dp", "tp"), returned):
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            out[name] = {"error": "not a group this rank belongs to"}
            continue
        with contextlib.suppress(Exception):
            c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S), group)
        flag = torch.zeros(world_size, dtype=torch.float64)
        flag[rank] = 1.0
        try:
            dist.all_reduce(flag, group=group)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        out[name] = {"joined": [r for r in range(world_size) if flag[r] != 0],
                     "counts": [float(v) for v in flag]}
    return out


def describe_state(value) -> dict:
    """What train_2d returned: a dict of CPU float64 copies of its tensors, or what it was instead."""
    if not isinstance(value, dict):
        return {"kind": type(value).__name__}
    tensors, other = {}, {}
    for key, item in value.items():
        if isinstance(item, torch.Tensor):
            tensors[str(key)] = item.detach().to("cpu", copy=True)
        else:
            other[str(key)] = type(item).__name__
    return {"kind": "dict", "tensors": tensors, "other": other}


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    tp_size = ctx.kwargs["tp_size"]
    calls: list = []
    timeline = Timeline()
    with ctx.group(), watch_new_groups(calls, ctx.rank, ctx.world_size), probes.watch_groups(timeline):
        make_groups = ctx.function("make_groups")
        train_2d = ctx.function("train_2d")
        shorten_timeouts()
        obs = {"tp_size": tp_size, "groups": None, "groups_error": None, "probe": None, "new_groups": calls,
               "train_error": None, "returned": None, "sequence": [], "trained": False}
        try:
            returned = make_groups(ctx.world_size, tp_size)
        except NotImplementedError:
            raise
        except Exception as exc:
            obs["groups_error"] = _failure(exc, ctx.learner_path)
            returned = None
        if returned is not None:
            obs["groups"] = describe_groups(returned)
            if obs["groups"]["shape"] is None:
                obs["probe"] = probe_groups(returned, ctx.rank, ctx.world_size)
        obs["make_groups_calls"] = len(calls)
        ready = obs["groups_error"] is None and obs["probe"] is not None and \
            not any("error" in p for p in obs["probe"].values())
        if not all_ok(ready):
            return obs  # a rank without working groups: training would only wait on it

        del timeline[:]
        inputs, targets = make_data()
        try:
            with watch_forwards(timeline):
                result = train_2d(ctx.rank, ctx.world_size, tp_size, (inputs, targets), STEPS, LR)
        except NotImplementedError:
            raise
        except Exception as exc:
            obs["train_error"] = _failure(exc, ctx.learner_path)
            result = None
        obs["trained"] = obs["train_error"] is None
        obs["returned"] = describe_state(result) if obs["trained"] else None
        obs["sequence"] = [dict(e) for e in timeline]
        obs["new_groups_in_train"] = calls[obs["make_groups_calls"]:]
        return obs


# --- bad input ----------------------------------------------------------------------------------------


def bad_cases(world_size: int) -> list[dict]:
    """Each bad call bad_main makes, in order: what is wrong, and the arguments."""
    tp_size = tp_size_for(world_size)
    inputs, targets = make_data()
    wrong_tp = next(t for t in range(2, world_size + 2) if world_size % t != 0)
    return [
        {"name": "tp_size", "what": f"tp_size = {wrong_tp}, which does not divide world_size = {world_size}",
         "function": "make_groups", "tp_size": wrong_tp},
        {"name": "input_features", "what": f"inputs of shape [{ROWS}, {IN_FEATURES + 1}], not [N, {IN_FEATURES}]",
         "function": "train_2d", "tp_size": tp_size,
         "data": (torch.cat([inputs, inputs[:, :1]], dim=1), targets)},
        {"name": "target_rows", "what": f"targets of shape [{ROWS - 2}, {OUT_FEATURES}] for {ROWS} rows of inputs",
         "function": "train_2d", "tp_size": tp_size, "data": (inputs, targets[:-2])},
        {"name": "uneven_rows", "what": f"{UNEVEN_ROWS} rows, which do not split into {world_size // tp_size} equal "
         "data-parallel shards", "function": "train_2d", "tp_size": tp_size, "data": make_data(UNEVEN_ROWS)},
    ]


def bad_main(ctx: RankContext) -> dict:
    """Each bad call in turn; what it raised (or returned). Stops after the first case that fails on
    some rank in a way that may leave peers mid-collective."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    calls: list = []
    with ctx.group(), watch_new_groups(calls, ctx.rank, ctx.world_size):
        functions = {"make_groups": ctx.function("make_groups"), "train_2d": ctx.function("train_2d")}
        shorten_timeouts()
        out = []
        for case in bad_cases(ctx.world_size):
            before = len(calls)
            record = {"name": case["name"], "raised": None, "message": None, "returned": None}
            try:
                if case["function"] == "make_groups":
                    value = functions["make_groups"](ctx.world_size, case["tp_size"])
                    record["returned"] = describe_groups(value)
                else:
                    value = functions["train_2d"](ctx.rank, ctx.world_size, case["tp_size"], case["data"], STEPS, LR)
                    record["returned"] = describe_state(value)
            except NotImplementedError:
                raise
            except Exception as exc:
                record["raised"] = type(exc).__name__
                record["message"] = str(exc)[:300]
            record["new_groups"] = len(calls) - before
            out.append(record)
            # Go on only when every rank came through the same way (a refusal everywhere, or a result).
            if not all_ok(record["raised"] in (None, "ValueError")):
                break
        return {"cases": out}
