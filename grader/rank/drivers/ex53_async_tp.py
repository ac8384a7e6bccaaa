"""Exercise 53, rank side: this rank's inputs, drawn from the grading's seed, and what it records of each call of
the learner's allgather_matmul and matmul_reduce_scatter and of its backward: the output and the gradients, and,
in order, every point-to-point and collective call (issued, waited for), every matrix product, and at each product
the contents of what the rank held then (the storages reachable from the learner's running functions, those
autograd saved, the product's own operands), each distinct content kept once. The grader looks for the inputs'
chunks in those contents; nothing here knows another rank's input."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta

import torch

from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank import memory, order, probes, rank_timeline
from grader.rank.child import RankContext

ROWS = 3  # rows of the input each rank holds (a chunk)
GATHER = {"k": 16, "m": 5}  # allgather_matmul: x_shard [ROWS, k], weight [k, m]
REDUCE = {"k": 5, "m": 16}  # matmul_reduce_scatter: x [W * ROWS, k], weight_shard [k, m]
FUNCTIONS = ("allgather_matmul", "matmul_reduce_scatter")
DTYPE = torch.float64
STALL_TIMEOUT_S = 5.0  # collective timeout: a rank that failed leaves the others waiting this long at most
SMALLEST_KEPT = ROWS * min(GATHER["k"], REDUCE["m"]) * 8  # a storage smaller than one chunk holds none


def groups_of(scenario: str, world_size: int) -> list[list[int]]:
    """The groups a scenario calls the functions on: the whole world, or the even and the odd ranks."""
    if scenario == "world":
        return [list(range(world_size))]
    return [[r for r in range(world_size) if r % 2 == parity] for parity in (0, 1)]


def inputs(seed: int, scenario: str, function: str, rank: int, group_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s arguments of one call, and the gradient its output is given in backward."""
    generator = torch.Generator().manual_seed(seed * 100 + 10 * FUNCTIONS.index(function) + rank
                                              + (50 if scenario != "world" else 0))
    if function == "allgather_matmul":
        k, m = GATHER["k"], GATHER["m"]
        shapes = {"x": (ROWS, k), "weight": (k, m), "grad": (group_size * ROWS, m)}
    else:
        k, m = REDUCE["k"], REDUCE["m"]
        shapes = {"x": (group_size * ROWS, k), "weight": (k, m), "grad": (ROWS, m)}
    return {name: torch.randn(shape, generator=generator, dtype=DTYPE) for name, shape in shapes.items()}


class Held:
    """The distinct contents of the storages a rank held at its matrix products, each kept once."""

    def __init__(self):
        self.contents: list[torch.Tensor] = []
        self._index: dict[bytes, int] = {}

    def note(self, storages) -> list[int]:
        ids = set()
        for storage in storages:
            if storage.nbytes() < SMALLEST_KEPT:
                continue
            raw = memory.storage_bytes(storage)
            key = hashlib.blake2b(raw, digest_size=16).digest()
            if key not in self._index:
                self._index[key] = len(self.contents)
                self.contents.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            ids.add(self._index[key])
        return sorted(ids)


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    seed = int(ctx.kwargs["seed"])
    events: list = []
    held = Held()
    out: dict = {}
    with ctx.group(), order.watch_issue_and_wait(events):
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        functions = {name: ctx.function(name) for name in FUNCTIONS}  # imported with the probes on
        module = ctx.learner()
        learner = (module.__name__, os.path.abspath(module.__file__))
        for scenario in ctx.kwargs["scenarios"]:
            members = groups_of(scenario, ctx.world_size)
            made = [torch.distributed.new_group(ranks) for ranks in members] if scenario != "world" else \
                [torch.distributed.group.WORLD]
            mine = next(i for i, ranks in enumerate(members) if ctx.rank in ranks)
            group, size = made[mine], len(members[mine])
            out[scenario] = {}
            for name in FUNCTIONS:
                args = inputs(seed, scenario, name, ctx.rank, size)
                with rank_timeline.region(f"{scenario}: {name}"):
                    record = _call(name, functions[name], args, group, events, held, learner)
                out[scenario][name] = record
                if not _everyone_ok(ctx, record["error"] is None):
                    return {"calls": out, "contents": held.contents, "stopped": f"{scenario}: {name}"}
    return {"calls": out, "contents": held.contents, "stopped": None}


def _everyone_ok(ctx: RankContext, ok: bool) -> bool:
    """Whether every rank's call ended well (else the group may be unusable: the next calls are skipped)."""
    flag = torch.tensor([1 if ok else 0])
    try:
        with rank_timeline.by_grader():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    except Exception:
        return False
    return bool(flag.item() == 1)


def _call(name: str, function, args: dict, group, events: list, held: Held, learner: tuple[str, str]) -> dict:
    """One call and its backward: the values, and the events between its first and last mark."""
    x = args["x"].clone().requires_grad_(True)
    weight = args["weight"].clone().requires_grad_(True)
    saved: list = []

    def snapshot(op: str, operands) -> None:
        tensors = memory.reachable_tensors(memory.running_locals(learner[1]), learner[0])
        tensors += [t for t in operands if isinstance(t, torch.Tensor)]
        storages = dict(memory.distinct_storages(tensors))
        storages.update(memory.saved_storages(saved))
        events.append({"op": "matmul", "what": op, "held": held.note(storages.values())})

    first = len(events)
    record = {"output": None, "grads": {}, "error": None, "returned": None}
    try:
        with order.watch_matmuls(snapshot), memory.watch_saved(saved):
            events.append({"op": "mark", "what": "call-begins"})
            with rank_timeline.phase("forward", name):
                output = function(x, weight, group)
            events.append({"op": "mark", "what": "call-returned"})
        record["returned"] = len(events) - first - 1
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"returned {type(output).__name__}, not a tensor")
        record["output"] = output.detach().clone()
        with order.watch_matmuls(snapshot):
            # Its gradient is args["grad"], exactly; backward(gradient=) would import sympy (torch 2.13).
            (output * args["grad"]).sum().backward()
            events.append({"op": "mark", "what": "backward-returned"})
        record["grads"] = {name: t.grad.detach().clone() for name, t in (("x", x), ("weight", weight))
                           if t.grad is not None}
    except NotImplementedError:
        raise  # a stub: the grading stops with "not implemented yet"
    except Exception as exc:
        record["error"] = learner_error(exc)
    record["events"] = [dict(e) for e in events[first:]]
    return record
