"""Exercise 37, rank side: the model, the layouts and the rank splits graded (the grader builds the same), and
one job per world size. Every rank builds one DeviceMesh per split of the world into trainer and inference
ranks; for each split and each scenario (a layout and a dtype) the trainer ranks shard the model with FSDP2's
fully_shard over their mesh and fill their shards with the scenario's weights, the inference ranks build the
model on the meta device (shapes and dtypes, no values), and every rank calls the learner's push_weights under
a watch: every c10d operation dispatched (a ProcessGroup's own send and recv, the functional collectives that
DTensor runs) with its peer and bytes, and after each of them, after each Work.wait() and when push_weights
returns, the whole parameters found in what the rank can reach, byte for byte."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from grader.rank import memory, probes, rank_timeline
from grader.rank.child import RankContext
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import MessageJournal, all_ok, storage_words

DIM, BLOCKS = 7, 2  # DIM odd: FSDP2's Shard(0) over two trainers holds 4 rows and 3 of it
SEED = 3700
STALL_TIMEOUT_S = 5.0  # once the meshes exist: a rank that failed must not leave the others waiting
NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd")  # dispatched around collectives, moving nothing
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
MAX_EVENTS = 2000  # what a rank records of one push at most (a runaway loop must not flood the record)
OP_WORDS = {"send": "a send", "recv_": "a receive", "recv_any_source_": "a receive", "broadcast_": "a broadcast",
            "allgather_": "an all-gather", "all_gather_into_tensor": "an all-gather", "_allgather_base_":
            "an all-gather", "wait_tensor": "a functional collective's wait", "allreduce_": "an all-reduce"}

# Column-parallel up projections and head, row-parallel down projections, the rest replicated: the usual
# (Megatron's, vLLM's) layout. The second engine splits the input projection by its inputs and keeps the last
# block and the head replicated: push_weights must read the layout, not the names.
LAYOUTS = {
    "a": {"blocks.0.up": "colwise", "blocks.0.down": "rowwise", "blocks.1.up": "colwise",
          "blocks.1.down": "rowwise", "out": "colwise"},
    "b": {"inp": "rowwise", "blocks.0.up": "colwise", "blocks.0.down": "rowwise"},
}
DTYPES = {"a": "float32", "b": "float64"}
SCENARIOS = ("a", "b")


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, d_in: int, dim: int, hidden: int, d_out: int, n_blocks: int = BLOCKS):
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.out = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


# --- shared by ranks and grader -----------------------------------------------------------------


def splits(world_size: int) -> list[dict]:
    """How a world is split into trainer and inference ranks: the trainers first (the first W // 2 ranks), and
    in an odd world also the other way round (the last half the trainers, rank 0 first among the inference
    ranks), so that no rank's place in its list is its global rank. A world of one has no split."""
    if world_size < 2:
        return []
    trainers = world_size // 2
    out = [{"trainers": list(range(trainers)), "inference": list(range(trainers, world_size)), "order": "usual"}]
    if world_size % 2:
        first = world_size - (trainers + 1)
        out.append({"trainers": list(range(first, world_size)), "inference": list(range(first)),
                    "order": "reversed"})
    return out


def dims(inference: int) -> dict:
    """The model's sizes for ``inference`` inference ranks: every dimension a layout splits divides by it."""
    split = 12 if 12 % inference == 0 else 6 * inference
    side = split // 2 if (split // 2) % inference == 0 else split
    return {"d_in": side, "dim": DIM, "hidden": split, "d_out": side}


def build_model(inference: int, dtype: str, device="cpu") -> Model:
    torch.manual_seed(SEED)
    d = dims(inference)
    return Model(d["d_in"], d["dim"], d["hidden"], d["d_out"]).to(dtype=getattr(torch, dtype), device=device)


def shapes(inference: int) -> dict[str, list[int]]:
    """Every parameter's name and whole shape, in the model's order."""
    with torch.device("meta"):
        model = build_model(inference, "float32", "meta")
    return {name: list(p.shape) for name, p in model.named_parameters()}


def trainer_rows(rows: int, trainers: int, k: int) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 the k-th trainer holds: FSDP2's Shard(0), cut as torch.chunk cuts
    (ceil(rows / trainers) each, the last ones fewer or none)."""
    per = math.ceil(rows / trainers)
    return min(k * per, rows), min((k + 1) * per, rows)


def weights(scenario: str, split_index: int, inference: int) -> dict[str, torch.Tensor]:
    """The trainer's weights of one push, whole, by parameter name: seeded, in the scenario's dtype."""
    dtype = getattr(torch, DTYPES[scenario])
    out = {}
    for index, (name, shape) in enumerate(shapes(inference).items()):
        generator = torch.Generator().manual_seed(SEED * 1000 + SCENARIOS.index(scenario) * 100 + split_index * 10
                                                  + index)
        out[name] = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    return out


def fingerprints(full: dict[str, torch.Tensor]) -> dict[str, list[bytes]]:
    """What finds each parameter whole in memory: the bytes of every row of a matrix (a rank holds the whole
    matrix when it holds all its rows, wherever each lies), the bytes of a vector."""
    out = {}
    for name, tensor in full.items():
        rows = [tensor] if tensor.dim() < 2 else list(tensor)
        # Read in place (numpy views of contiguous CPU rows): a copy freed here could come back, unzeroed, as
        # memory the learner allocates, and be found in it.
        out[name] = [row.numpy().tobytes() for row in rows]
    return out


# --- in each rank: what a rank sends and holds ----------------------------------------------------


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _process_group(value):
    try:
        if isinstance(value, str):  # a functional collective's group name
            return dist.distributed_c10d._resolve_process_group(value)
        if type(value).__name__ == "ScriptObject":
            return torch._C._distributed_c10d.ProcessGroup.unbox(value)
    except (RuntimeError, ValueError, TypeError):
        pass
    return None


def describe_message(func, args) -> dict:
    """One dispatched c10d operation: its name (c10d.send.default -> send), bytes, dtype, its group's global
    ranks and, for a send or a receive, the peer's global rank."""
    name = str(func)
    group = next((g for g in map(_process_group, args) if g is not None), None)
    data = args[0] if args else None
    first = data[0] if isinstance(data, (list, tuple)) and data and isinstance(data[0], torch.Tensor) else data
    event = {"op": name.split(".")[1] if "." in name else name, "bytes": _bytes(data), "peer": None,
             "group": sorted(dist.get_process_group_ranks(group)) if group is not None else None,
             "dtype": str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else None}
    if event["op"] in ("send", "recv_") and group is not None:
        with contextlib.suppress(Exception):
            event["peer"] = int(dist.get_global_rank(group, int(args[2])))
    return event


@functools.cache
def _watch_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Messages(TorchDispatchMode):
        """Every c10d operation dispatched, and a look at memory after each."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # nothing here is compiled: without this the first use imports torch._dynamo

        def __init__(self, events: list, after, note=None):
            super().__init__()
            self.events, self.after, self.note = events, after, note

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            event = describe_message(func, args) if func.namespace in NAMESPACES and \
                not any(word in name for word in NOT_MESSAGES) else None
            if event is not None and self.note is not None:
                self.note(event, args)  # before it goes: a message that does not match its peer's aborts the rank
            out = func(*args, **(kwargs or {}))
            if func.namespace in NAMESPACES:
                if event is not None and len(self.events) < MAX_EVENTS:
                    self.events.append(event)
                op = name.split(".")[1]
                self.after(f"after {OP_WORDS.get(op, op)}", [args, out])
            return out

    return Messages


@contextlib.contextmanager
def watched(events: list, after, note=None):
    """The watch around one push: every c10d operation (``note`` called before each goes), and a look at memory
    after each Work.wait()."""
    work = torch._C._distributed_c10d.Work
    real_wait = work.wait

    def wait(self, timeout: timedelta = timedelta(0)):
        # A wait without a timeout waits as long as the process group's first timeout (the grading's deadline):
        # a message that never comes must end the push in seconds instead.
        out = real_wait(self, timeout if timeout else timedelta(seconds=STALL_TIMEOUT_S))
        after("after a Work.wait()", [])
        return out

    work.wait = wait
    try:
        with _watch_class()(events, after, note):
            yield
    finally:
        work.wait = real_wait


class Held:
    """The whole parameters this rank holds, found byte for byte in the storages its learner's module, its
    running frames, the model and the operation at hand reach: each name with where it was first found."""

    def __init__(self, learner, model: nn.Module, prints: dict[str, list[bytes]]):
        self.learner = learner
        self.learner_file = os.path.abspath(learner.__file__)
        self.model = model
        self.prints = prints
        self.found: dict[str, str] = {}
        self.looks = 0
        self.busy = False
        self.failed: str | None = None

    def look(self, where: str, extra: list) -> None:
        if self.busy or len(self.found) == len(self.prints):
            return
        self.busy = True
        try:
            roots = [v for k, v in vars(self.learner).items() if not k.startswith("__")]
            roots += memory.running_locals(self.learner_file) + [self.model] + list(extra)
            tensors = [t for t in memory.reachable_tensors(roots, self.learner.__name__) if t.device.type != "meta"]
            contents = [memory.storage_bytes(s) for s in memory.distinct_storages(tensors).values()]
            self.looks += 1
            for name, rows in self.prints.items():
                if name not in self.found and all(any(row in raw for raw in contents) for row in rows):
                    self.found[name] = where
        except Exception as exc:  # the grader's look must never fail the learner's call
            self.failed = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.busy = False


# --- in each rank: the job -------------------------------------------------------------------------


def _returned(value) -> dict:
    """What push_weights returned, as plain data: None, or a dict's entries (tensors copied to the CPU)."""
    if value is None:
        return {"kind": "none"}
    if not isinstance(value, dict):
        return {"kind": type(value).__name__}
    entries = {}
    for key, tensor in list(value.items())[:200]:
        label = key if isinstance(key, str) else repr(key)[:80]
        if isinstance(tensor, torch.Tensor) and hasattr(tensor, "to_local"):
            entries[label] = "a DTensor"
        elif isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            entries[label] = "a tensor on the meta device"
        elif isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            copy = torch.empty(tensor.shape, dtype=tensor.dtype)
            copy.copy_(tensor.detach().to("cpu"))
            entries[label] = copy
        else:
            entries[label] = f"a {type(tensor).__name__}"
    return {"kind": "dict", "entries": entries, "count": len(value)}


def _trainer_model(ctx: RankContext, inference: int, dtype: str, mesh, local_rows: dict) -> nn.Module:
    """The model sharded as FSDP2 shards it over the trainer ranks, each local shard set to its rows."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(inference, dtype, ctx.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(local_rows[name].to(ctx.device))
    return model


def _push(ctx: RankContext, learner, push_weights, split_index: int, split: dict, scenario: str, mesh,
          journal: MessageJournal) -> dict:
    trainers, inference = split["trainers"], split["inference"]
    role = "trainer" if ctx.rank in trainers else "inference"
    record = {"split": split_index, "scenario": scenario, "role": role, "events": [], "held": {}, "looks": 0,
              "returned": None, "error": None}
    full = weights(scenario, split_index, len(inference))
    prints = fingerprints(full)
    if role == "trainer":
        k = trainers.index(ctx.rank)
        local_rows = {}
        for name, tensor in full.items():
            start, stop = trainer_rows(tensor.shape[0], len(trainers), k)
            local_rows[name] = tensor[start:stop].clone()
        model = _trainer_model(ctx, len(inference), DTYPES[scenario], mesh, local_rows)
        for tensor in local_rows.values():  # no copy of the weights outside the model stays in memory
            tensor.zero_()
        del local_rows
    else:
        with torch.device("meta"):
            model = build_model(len(inference), DTYPES[scenario], "meta")
    for tensor in full.values():
        tensor.zero_()
    del full
    held = Held(learner, model, prints)
    layout = {key: value for key, value in LAYOUTS[scenario].items()}
    pushed = f"push_weights: trainers {', '.join(map(str, trainers))}, layout {scenario}"
    name_of = storage_words({f"its rows of {name}": p.to_local().detach() for name, p in model.named_parameters()}
                            if role == "trainer" else {})

    def note(event: dict, args) -> None:
        journal.message(event["op"], event["peer"], args, pushed, name_of)

    try:
        with watched(record["events"], held.look, note), rank_timeline.region(pushed):
            value = push_weights(model, layout, list(trainers), list(inference))
        held.look("when push_weights returned", [value])
    except NotImplementedError:
        raise
    except Exception as exc:  # the observation; what was seen before it is still judged
        record["error"] = learner_error(exc)
        value = None
    record["returned"] = _returned(value) if record["error"] is None else None
    record["held"], record["looks"], record["look_failed"] = dict(held.found), held.looks, held.failed
    return record


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    probes.torchrun_environment(ctx.rank, ctx.world_size)
    torch.set_num_threads(1)
    with ctx.group():
        push_weights = ctx.function("push_weights")
        learner = ctx.learner()
        device_type = "cuda" if ctx.backend == "nccl" else "cpu"
        plan = splits(ctx.world_size)
        meshes = [DeviceMesh(device_type, split["trainers"]) for split in plan]  # every rank, in the same order
        # The grader's own agreement between pushes waits longer than a learner's message may: a rank left
        # waiting by a peer that failed gives up first, records it, and then agrees.
        control = dist.new_group(list(range(ctx.world_size)), timeout=timedelta(seconds=4 * STALL_TIMEOUT_S))
        for group in [None] + [mesh.get_group() for mesh in meshes if ctx.rank in mesh.mesh.tolist()]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S), group)
        obs = {"pushes": []}
        journal = MessageJournal(ctx.run_dir, ctx.rank)
        try:
            for split_index, split in enumerate(plan):
                for scenario in SCENARIOS:
                    record = _push(ctx, learner, push_weights, split_index, split, scenario, meshes[split_index],
                                   journal)
                    obs["pushes"].append(record)
                    if not all_ok(record["error"] is None, ctx.device, control):
                        return obs  # a peer failed: the next push would meet it mid-exchange
        finally:
            journal.close()
        return obs
