"""Exercise 18, rank side: the block every rank builds (seeded, the same everywhere), each rank's rows of the
sequence and block of the hidden width, and what a rank records of the learner's SequenceParallelBlock:
outputs, gradients, parameters, the tensors autograd saved, every collective."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import memory, probes, rank_timeline
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import all_ok, plain_tensor
from grader.rank.child import RankContext

# SEQ and HIDDEN divisible by 2, 3 and 4 (see sizes); no HIDDEN / W equals D_MODEL, so that what autograd saves
# of a hidden block is told from what it saves of the model's width by its last dimension.
SEQ, BATCH, D_MODEL, HIDDEN = 12, 2, 16, 72
NORM_EPS = 1e-3  # not LayerNorm's default 1e-5: a block that ignores the norm's eps gives another output
DTYPE = torch.float64
SEEDS = {"main": 1, "group": 2, "uneven": 3, "hidden": 4, "shape": 5}
RTOL, ATOL = 1e-9, 1e-11  # float64: the ranks sum the hidden blocks in another order than one matmul does
STALL_TIMEOUT_S = 5.0  # after the main scenario: a rank that failed must not leave the others waiting
REFUSALS = ("ValueError", "AssertionError")
SAVED_VALUES_LIMIT = 64 * 1024  # elements of one saved tensor sent back to the grader, at most
REPLICATED = ("norm.weight", "norm.bias", "fc2.bias")  # the parameters every rank holds whole
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # the dimension of each split parameter


def sizes(world_size: int) -> tuple[int, int]:
    """(seq, hidden) of the block graded on ``world_size`` ranks: SEQ and HIDDEN when it divides them
    (2, 3 and 4 do), else multiples of it (--world-size 5)."""
    seq = SEQ if SEQ % world_size == 0 else 3 * world_size
    hidden = HIDDEN if HIDDEN % world_size == 0 else 12 * world_size
    return seq, hidden


def chunk_rows(rank: int, world_size: int, seq: int = SEQ) -> slice:
    """The sequence positions rank ``rank`` holds: [r * seq / W, (r + 1) * seq / W)."""
    size = seq // world_size
    return slice(rank * size, (rank + 1) * size)


def hidden_block(rank: int, world_size: int, hidden: int = HIDDEN) -> slice:
    """This rank's block of fc1's output features (and of fc2's input features)."""
    size = hidden // world_size
    return slice(rank * size, (rank + 1) * size)


def uneven_hidden(world_size: int) -> int:
    """A hidden size the world size does not divide."""
    return 4 * world_size + 1


# Chunks of different lengths, each pattern in a run of its own: "one-longer" is a sequence one longer than
# the graded one cut by torch.tensor_split (rank 0 one longer); in "sum-hides" ranks 0 and 1 are one shorter
# and one longer, so the lengths add up to seq and a rank holding seq / W finds its length times W equal to it.
UNEVEN_PATTERNS = ("one-longer", "sum-hides")


def uneven_lengths(world_size: int, pattern: str = "one-longer") -> list[int]:
    """Each rank's chunk length in the uneven ``pattern`` (see UNEVEN_PATTERNS)."""
    seq = sizes(world_size)[0]
    if pattern == "sum-hides":
        chunk = seq // world_size
        return [chunk - 1, chunk + 1] + [chunk] * (world_size - 2)
    return [len(t) for t in torch.arange(seq + 1).tensor_split(world_size)]


def groups_of(world_size: int) -> list[list[int]]:
    """Two groups, the even global ranks and the odd ones (a group of one when W is 2 or 3), so that a
    rank's place in its group differs from its global rank."""
    if world_size < 2:
        return [[0]]
    return [list(range(0, world_size, 2)), list(range(1, world_size, 2))]


def build(scenario: str, seq: int = SEQ, hidden: int = HIDDEN, salt: int = 0) -> dict:
    """The dense norm, fc1 and fc2, the whole input x [seq, batch, d] and the output's gradient G, seeded.

    The norm's weight and bias are random (not ones and zeros), so that every replicated parameter
    has values of its own and a gradient that depends on them."""
    seed = SEEDS[scenario] * 1000 + seq * 10 + hidden + salt * 100_000
    torch.manual_seed(seed)
    norm = nn.LayerNorm(D_MODEL, eps=NORM_EPS, dtype=DTYPE)
    fc1 = nn.Linear(D_MODEL, hidden, dtype=DTYPE)
    fc2 = nn.Linear(hidden, D_MODEL, dtype=DTYPE)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(D_MODEL, generator=generator, dtype=DTYPE))
        norm.bias.copy_(0.5 * torch.randn(D_MODEL, generator=generator, dtype=DTYPE))
        fc2.bias.copy_(torch.randn(D_MODEL, generator=generator, dtype=DTYPE))
    x = torch.randn(seq, BATCH, D_MODEL, generator=generator, dtype=DTYPE)
    g = torch.randn(seq, BATCH, D_MODEL, generator=generator, dtype=DTYPE)
    return {"norm": norm, "fc1": fc1, "fc2": fc2, "x": x, "g": g}


def chunk_elements(world_size: int) -> int:
    """Elements of one rank's chunk of an activation: (seq / W) * batch * d."""
    return sizes(world_size)[0] // world_size * BATCH * D_MODEL


def _parameters(block: nn.Module) -> list[dict]:
    """Every parameter of the block: its name, value and .grad."""
    return [{"name": name, "value": plain_tensor(p), "grad": plain_tensor(p.grad)} for name, p in block.named_parameters()]


class SavedTensors:
    """What autograd saves for backward during a forward (a saved_tensors_hooks pack hook): each storage
    once, with its bytes and the values of the tensors saved in it. Parameters are left out."""

    def __init__(self, parameters: list[torch.Tensor]):
        self.skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, dict] = {}

    def pack(self, tensor):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own
            return tensor
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return tensor
        entry = self.storages.setdefault(key, {"bytes": storage.nbytes(), "views": []})
        if len(entry["views"]) < 4 and tensor.numel() <= SAVED_VALUES_LIMIT:
            entry["views"].append({"shape": list(tensor.shape), "values": plain_tensor(tensor)})
        elif len(entry["views"]) < 4:
            entry["views"].append({"shape": list(tensor.shape), "values": None})
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def record(self) -> list[dict]:
        return list(self.storages.values())


FUNCTIONAL_NAMESPACES = ("_c10d_functional.", "_c10d_functional_autograd.")
_FUNCOL_FILE = os.path.join("distributed", "_functional_collectives.py")


def _in_recorded_funcol_call() -> bool:
    """Whether a functional collective's Python wrapper (which watch_collectives records) is running."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_FUNCOL_FILE) and frame.f_code.co_name in probes.FUNCTIONAL_COLLECTIVES:
            return True
        frame = frame.f_back
    return False


def _functional_watch(events: list):
    """The functional collectives autograd runs from C++ (the backward of all_gather_tensor_autograd is a
    reduce_scatter_tensor no Python wrapper sees), recorded into ``events`` (probes.watch_dispatched_collectives)."""

    def record(func, args) -> None:
        name = str(func)
        if name.startswith(FUNCTIONAL_NAMESPACES) and "wait_tensor" not in name and not _in_recorded_funcol_call():
            first = args[0] if args else None
            first = first[0] if isinstance(first, (list, tuple)) and first else first
            nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
            events.append({"op": name.split(".")[1], "bytes": nbytes, "peer": None, "via": "dispatch",
                           "dtype": str(first.dtype).removeprefix("torch.") if nbytes else None})

    return probes.watch_dispatched_collectives(record)


def _run(ctx: RankContext, block, data: dict, rows: slice, events: list, group=None, measure: bool = False) -> dict:
    """Forward on this rank's chunk, then backward of sum(output * G): what each did and sent (the
    collectives of torch.distributed, and the functional ones autograd runs below Python)."""
    x = data["x"][rows].clone().to(ctx.device).requires_grad_(True)
    g = data["g"][rows].clone().to(ctx.device)
    saved = SavedTensors(list(block.parameters()))
    first = len(events)
    with _functional_watch(events):
        if measure:
            with saved.hooks():
                y = block(x)
        else:
            y = block(x)
    run = {"output": plain_tensor(y), "forward_events": [dict(e) for e in events[first:]], "backward_events": [],
           "backward_ran": False, "input_grad": None, "saved": saved.record() if measure else None}
    ok = isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(x.shape) and y.requires_grad
    if not all_ok(ok, ctx.device, group):
        run["params"] = _parameters(block)
        return run
    first = len(events)
    with _functional_watch(events):
        (y * g).sum().backward()
    run["backward_events"] = [dict(e) for e in events[first:]]
    run["backward_ran"] = True
    run["input_grad"] = plain_tensor(x.grad)
    run["params"] = _parameters(block)
    return run


def _held(block, learner) -> int:
    """Bytes of the distinct storages the block holds (and the learner's module-level names)."""
    roots = [block] + [value for name, value in vars(learner).items() if not name.startswith("__")]
    return memory.held_bytes(roots, learner.__name__)


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    with probes.watch_collectives(events), ctx.group():
        block_class = ctx.function("SequenceParallelBlock")
        learner = ctx.learner()
        return _observe(ctx, block_class, learner, events)


def _observe(ctx: RankContext, block_class, learner, events: list) -> dict:
    world_size, rank = ctx.world_size, ctx.rank
    seq, hidden = sizes(world_size)
    data = build("main", seq, hidden)
    block = block_class(data["norm"], data["fc1"], data["fc2"])
    obs = {"held_bytes": _held(block, learner)}
    obs["main"] = _run(ctx, block, data, chunk_rows(rank, world_size, seq), events, measure=True)
    if obs["main"]["backward_ran"]:
        # A second step on the same block, its gradients cleared as an optimizer's zero_grad does: hooks
        # registered, or state kept, by one forward must not change the next.
        for p in block.parameters():
            p.grad = None
        obs["second"] = _run(ctx, block, data, chunk_rows(rank, world_size, seq), events)

    # From here on a rank that fails may leave the others waiting: a short timeout turns that into an error.
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    if ctx.kwargs.get("groups"):
        obs["group"] = _observe_group(ctx, block_class, events)
    obs["hidden"] = _observe_hidden(ctx, block_class)
    obs["shape"] = _observe_shape(ctx, block_class)
    return obs


def _observe_group(ctx: RankContext, block_class, events: list) -> dict:
    """Every rank makes both groups, in the same order; each runs a block of its own group, on its sequence."""
    groups = groups_of(ctx.world_size)
    handles = [dist.new_group(members, timeout=timedelta(seconds=STALL_TIMEOUT_S)) for members in groups]
    mine = next(i for i, members in enumerate(groups) if ctx.rank in members)
    members = groups[mine]
    seq, hidden = sizes(len(members))
    data = build("group", seq, hidden, salt=mine)  # each group's dense layers and sequence differ
    try:
        block = block_class(data["norm"], data["fc1"], data["fc2"], group=handles[mine])
        run = _run(ctx, block, data, chunk_rows(members.index(ctx.rank), len(members), seq), events,
                   group=handles[mine])
    except Exception as exc:  # the observation; nothing after it runs in this group
        return {"error": learner_error(exc), "members": members}
    run["members"] = members
    return run


def _observe_hidden(ctx: RankContext, block_class) -> dict:
    """A hidden size the world size does not divide: what construction does."""
    data = build("hidden", hidden=uneven_hidden(ctx.world_size))
    try:
        block_class(data["norm"], data["fc1"], data["fc2"])
    except Exception as exc:  # the observation: a refusal, or an accident of the split
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}
    return {"raised": None}


def _observe_shape(ctx: RankContext, block_class) -> dict:
    """An input whose last dimension is not the model's: what forward does (on every rank alike)."""
    seq, hidden = sizes(ctx.world_size)
    data = build("shape", seq, hidden)
    try:
        block = block_class(data["norm"], data["fc1"], data["fc2"])
    except Exception as exc:
        return {"raised": None, "built": False, "error": learner_error(exc)}
    x = torch.randn(seq // ctx.world_size, BATCH, D_MODEL + 1, dtype=DTYPE, device=ctx.device)
    try:
        y = block(x)
    except Exception as exc:  # the observation
        return {"raised": type(exc).__name__, "message": str(exc)[:300], "built": True}
    return {"raised": None, "built": True, "output_shape": list(y.shape) if isinstance(y, torch.Tensor) else None}


def uneven_main(ctx: RankContext) -> dict:
    """Chunks of different lengths (kwargs["pattern"], one of UNEVEN_PATTERNS): what the block's forward does."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        block_class = ctx.function("SequenceParallelBlock")
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        lengths = uneven_lengths(ctx.world_size, ctx.kwargs.get("pattern", "one-longer"))
        data = build("uneven", seq=sum(lengths), hidden=sizes(ctx.world_size)[1])
        block = block_class(data["norm"], data["fc1"], data["fc2"])
        start = sum(lengths[:ctx.rank])
        x = data["x"][start:start + lengths[ctx.rank]].clone().to(ctx.device).requires_grad_(True)
        try:
            y = block(x)
        except NotImplementedError:
            raise
        except Exception as exc:  # the observation: a refusal, or an accident of the lengths
            return {"raised": type(exc).__name__, "message": str(exc)[:300], "length": lengths[ctx.rank]}
        return {"raised": None, "length": lengths[ctx.rank], "output": plain_tensor(y)}
