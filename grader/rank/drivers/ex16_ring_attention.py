"""Exercise 16, rank side: the inputs every rank builds (seeded, the same everywhere), the positions of each
rank's chunk (contiguous or zigzag), and what a rank records of the learner's ring_attention: outputs,
gradients, every message with its peer and bytes, the block products it computed, the other ranks' K and V
blocks it held at once."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from grader.rank import memory, probes, rank_timeline
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import all_ok, plain_tensor
from grader.rank.child import RankContext

BATCH, HEADS, CHUNK, HEAD_DIM = 2, 2, 4, 8  # CHUNK: positions per rank (even, so that zigzag halves it)
DTYPE = torch.float64
SEEDS = {"plain": 1, "causal": 2, "large": 3, "zigzag": 4, "group": 5, "uneven": 6}
LARGE = 1000.0  # the stability scenario multiplies the queries by this: logits of about 1e3
RTOL = 1e-9  # float64: the ring sums the blocks in another order than one softmax does
ATOL = 1e-9  # times the largest |value| of the expected tensor
SMALL_MESSAGE = 64  # bytes: a message or collective this small carries a few numbers (lengths, a shape), no block
STALL_TIMEOUT_S = 5.0  # after the first two scenarios: a rank that failed must not leave the others waiting
FORWARD_PER_BLOCK = 2  # block products per block in forward: q k^T and p v
BACKWARD_PER_BLOCK = 6  # at most, in backward: 5 recomputing the scores, 6 recomputing the output too
MOST_HELD = 2  # other ranks' K/V blocks a rank may hold at once: the one it computes with, the one arriving
REFUSALS = ("ValueError", "AssertionError")


def make_inputs(scenario: str, length: int) -> dict[str, torch.Tensor]:
    """q, k, v and the output gradient g of the whole sequence, [batch, heads, length, head_dim], seeded."""
    generator = torch.Generator().manual_seed(1000 + SEEDS[scenario] * 100 + length)
    shape = (BATCH, HEADS, length, HEAD_DIM)
    out = {name: torch.randn(shape, generator=generator, dtype=DTYPE) for name in ("q", "k", "v", "g")}
    if scenario == "large":
        out["q"] = out["q"] * LARGE
    return out


def positions(rank: int, world_size: int, zigzag: bool = False) -> list[int]:
    """The sequence positions rank ``rank`` holds: its contiguous chunk, or chunks rank and 2W - 1 - rank."""
    if not zigzag:
        return list(range(rank * CHUNK, (rank + 1) * CHUNK))
    half = CHUNK // 2
    late = 2 * world_size - 1 - rank
    return list(range(rank * half, (rank + 1) * half)) + list(range(late * half, (late + 1) * half))


# Chunks of different lengths, each pattern in a run of its own: "one-longer" is a sequence of CHUNK * W + 1
# cut by torch.tensor_split (rank 0 one longer); in "sum-hides" ranks 0 and 1 are one shorter and one longer,
# so the lengths add up to CHUNK * W and a rank holding CHUNK finds its length times W equal to the total.
UNEVEN_PATTERNS = ("one-longer", "sum-hides")


def uneven_lengths(world_size: int, pattern: str = "one-longer") -> list[int]:
    """Each rank's chunk length in the uneven ``pattern`` (see UNEVEN_PATTERNS)."""
    if pattern == "sum-hides":
        return [CHUNK - 1, CHUNK + 1] + [CHUNK] * (world_size - 2)
    return [len(t) for t in torch.arange(CHUNK * world_size + 1).tensor_split(world_size)]


def uneven_positions(world_size: int, pattern: str = "one-longer") -> list[list[int]]:
    """Each rank's positions in the uneven ``pattern``: contiguous chunks of uneven_lengths, in rank order."""
    lengths = uneven_lengths(world_size, pattern)
    starts = [sum(lengths[:rank]) for rank in range(world_size)]
    return [list(range(start, start + n)) for start, n in zip(starts, lengths)]


def groups_of(world_size: int) -> list[list[int]]:
    """Every rank but rank 1, whose ring skips a global rank (rank 0's neighbours are 2 and W - 1), and
    rank 1 alone, a ring of one."""
    if world_size < 2:
        return [[0]]
    return [[r for r in range(world_size) if r != 1], [1]]


def block_macs() -> int:
    """Multiply-adds of one block product: a chunk of queries times a chunk of keys (or p times v)."""
    return BATCH * HEADS * CHUNK * CHUNK * HEAD_DIM


def _macs(func, args) -> int:
    """Multiply-adds of one aten matrix product (0 for anything else)."""
    name = str(func)
    try:
        if name.startswith(("aten.mm.", "aten.bmm.")):
            a, b = args[0], args[1]
        elif name.startswith(("aten.addmm.", "aten.baddbmm.")):
            a, b = args[1], args[2]
        elif "scaled_dot_product" in name:
            backward = "backward" in name
            q, k = (args[1], args[2]) if backward else (args[0], args[1])
            products = 5 if backward else 2
            return products * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
        else:
            return 0
        return math.prod(a.shape) * b.shape[-1]
    except (AttributeError, IndexError, TypeError):
        return 0


@functools.cache
def _watch_class():
    """The dispatch mode below, defined on first use (ranks that never count do not import its module)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        """Counts the multiply-adds of matrix products, and calls ``before_product`` before each."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Nothing here is compiled: without this, torch wraps __torch_dispatch__ in torch._dynamo.disable,
            # and the first use imports torch._dynamo (2 s in every rank).
            return False

        def __init__(self, before_product):
            super().__init__()
            self.macs = 0
            self.before_product = before_product

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            macs = _macs(func, args)
            if macs:
                self.macs += macs
                self.before_product()
            return func(*args, **(kwargs or {}))

    return Watch


class HeldBlocks:
    """Which other ranks' K/V blocks a rank holds, looked for byte for byte in the storages alive."""

    def __init__(self, fingerprints: dict[int, list[bytes]], learner, learner_file: str):
        self.fingerprints = fingerprints
        self.learner = learner
        self.learner_file = learner_file
        # The learner's own globals (a cache at module level counts), not the module's machinery.
        self.globals = [value for name, value in vars(learner).items() if not name.startswith("__")]
        self.saved: list = []  # weak references to what autograd saved in forward (memory.watch_saved)
        self.graph: list = []  # the output and its autograd nodes, once forward returned
        self.most: list[int] = []
        self.where = ""
        self.probes = 0

    def probe(self, where: str) -> None:
        if not self.fingerprints:
            return
        self.probes += 1
        roots = self.globals + self.graph + memory.running_locals(self.learner_file)
        storages = memory.distinct_storages(memory.reachable_tensors(roots, self.learner.__name__))
        storages.update(memory.saved_storages(self.saved))
        contents = [_contents(s) for s in storages.values()]
        found = sorted(rank for rank, prints in self.fingerprints.items()
                       if any(p in raw for p in prints for raw in contents))
        for raw in contents:  # no copy of another rank's block may stay behind in freed memory
            raw[:] = bytes(len(raw))
        if len(found) > len(self.most):
            self.most, self.where = found, where

    def record(self) -> dict:
        return {"most": self.most, "where": self.where, "probes": self.probes}


def _contents(storage: torch.UntypedStorage) -> bytearray:
    """A copy of a storage's bytes, which the caller zeroes after use (memory.storage_bytes would leave its
    copies of other ranks' blocks in freed memory, where a buffer the learner allocates next could find them)."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if view.device.type == "cpu":
        return bytearray(view.numpy())
    host = view.cpu()
    out = bytearray(host.numpy())
    host.zero_()
    return out


def _block_bytes(tensor: torch.Tensor) -> bytes:
    """A block's bytes (kept alive while its scenario runs); the tensor is zeroed after."""
    out = tensor.contiguous().numpy().tobytes()
    tensor.zero_()
    return out


class _NoWatch(contextlib.nullcontext):
    """What a scenario that neither counts products nor looks at memory watches with."""

    macs = 0

    def __init__(self, before_product):
        super().__init__()


def _graph_nodes(output) -> list:
    """The output and every node of its autograd graph (a custom Function's ctx keeps what it was given)."""
    nodes, stack, seen = [], [getattr(output, "grad_fn", None)], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return [output] + nodes


def _own_chunk(full: dict, rows: list[int], ctx: RankContext) -> dict:
    """This rank's chunk of each tensor; the whole tensors are zeroed, so that no other rank's values
    stay behind in memory the learner's buffers could be given."""
    index = torch.tensor(rows)
    out = {name: t.index_select(2, index).to(ctx.device) for name, t in full.items()}
    for t in full.values():
        t.zero_()
    return out


def _fingerprints(full: dict, ctx: RankContext, members: list[int], zigzag: bool) -> dict[int, list[bytes]]:
    """The bytes of every other rank's K and V blocks, each copy zeroed after use."""
    out = {}
    for group_rank, rank in enumerate(members):
        if rank == ctx.rank:
            continue
        index = torch.tensor(positions(group_rank, len(members), zigzag))
        prints = []
        for name in ("k", "v"):
            prints.append(_block_bytes(full[name].index_select(2, index)))
        out[rank] = prints
    return out


def _run_case(ctx: RankContext, call, scenario: str, *args, **kwargs) -> dict:
    with rank_timeline.region(scenario):  # one part of the timeline per scenario
        return _run_scenario(ctx, call, scenario, *args, **kwargs)


def _run_scenario(ctx: RankContext, call, scenario: str, events: list, learner, learner_file: str, *,
                  rows: list[int], length: int, members: list[int], zigzag: bool = False, count: bool = True,
                  measure: bool = False) -> dict:
    """Forward and backward of one scenario on this rank's chunk: the tensors, the messages, the block
    products (``count``) and the most other ranks' blocks held at once (``measure``)."""
    full = make_inputs(scenario, length)
    prints = _fingerprints(full, ctx, members, zigzag) if measure else {}
    chunk = _own_chunk(full, rows, ctx)
    del full
    q, k, v = (chunk[name].requires_grad_(True) for name in ("q", "k", "v"))
    held = HeldBlocks(prints, learner, learner_file)
    watch = _watch_class() if count or measure else _NoWatch
    forward_watch = watch(lambda: held.probe("in forward"))
    first = len(events)
    with memory.watch_saved(held.saved), forward_watch, rank_timeline.phase("forward", scenario):
        out = call(q, k, v)
    forward_events = [dict(e) for e in events[first:]]
    run = {"output": plain_tensor(out), "forward_events": forward_events, "backward_events": [],
           "forward_macs": forward_watch.macs, "backward_macs": 0, "backward_ran": False,
           "grads": {"q": None, "k": None, "v": None}}
    ok = isinstance(out, torch.Tensor) and out.requires_grad and tuple(out.shape) == tuple(q.shape)
    if measure:
        held.graph = _graph_nodes(out) if isinstance(out, torch.Tensor) else [out]
        held.probe("after forward (what is kept for backward)")
    if not all_ok(ok, ctx.device):
        run["held"] = held.record()
        return run
    backward_watch = watch(lambda: held.probe("in backward"))
    first = len(events)
    with backward_watch:
        (out * chunk["g"]).sum().backward()
    run["backward_events"] = [dict(e) for e in events[first:]]
    run["backward_macs"] = backward_watch.macs
    run["backward_ran"] = True
    run["grads"] = {"q": plain_tensor(q.grad), "k": plain_tensor(k.grad), "v": plain_tensor(v.grad)}
    held.graph = []
    run["held"] = held.record()
    return run


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    with probes.watch_collectives(events), ctx.group():
        ring_attention = ctx.function("ring_attention")
        learner = ctx.learner()
        return _observe(ctx, learner, ring_attention, events)


def _observe(ctx: RankContext, learner, ring_attention, events: list) -> dict:
    world_size, rank = ctx.world_size, ctx.rank
    learner_file = os.path.abspath(learner.__file__)
    everyone = list(range(world_size))
    common = {"rows": positions(rank, world_size), "length": CHUNK * world_size, "members": everyone}
    # Memory is measured without causal masking, where every block meets every rank's queries, and only
    # with enough ranks: with W - 1 <= 2 other ranks no rank can hold too many of their blocks.
    measure = world_size > MOST_HELD + 1
    obs = {}
    for scenario, causal in (("plain", False), ("causal", True)):
        obs[scenario] = _run_case(ctx, lambda q, k, v, causal=causal: ring_attention(q, k, v, causal=causal),
                                  scenario, events, learner, learner_file, measure=measure and not causal, **common)

    # From here on a rank that fails may leave the others waiting: a short timeout turns that into an error.
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    try:
        obs["large"] = _run_case(ctx, lambda q, k, v: ring_attention(q, k, v), "large", events, learner,
                                 learner_file, count=False, **common)
    except Exception as exc:  # the observation; nothing after it runs (peers may be mid-ring)
        obs["large"] = {"error": learner_error(exc)}
        return obs

    zigzag = getattr(learner, "zigzag_ring_attention", None)
    if zigzag is None:
        obs["zigzag"] = {"absent": True}
    else:
        try:
            obs["zigzag"] = _run_case(ctx, lambda q, k, v: zigzag(q, k, v), "zigzag", events, learner,
                                      learner_file, rows=positions(rank, world_size, zigzag=True),
                                      length=CHUNK * world_size, members=everyone, zigzag=True)
        except NotImplementedError:
            obs["zigzag"] = {"not_implemented": True}
        except Exception as exc:
            obs["zigzag"] = {"error": learner_error(exc)}
            return obs

    if not ctx.kwargs.get("groups"):
        return obs
    # Every rank makes every group, in the same order; each rank then runs the ring of its own.
    groups = groups_of(world_size)
    handles = [dist.new_group(members) for members in groups]
    mine = next(i for i, members in enumerate(groups) if rank in members)
    members = groups[mine]
    try:
        obs["group"] = _run_case(ctx, lambda q, k, v: ring_attention(q, k, v, group=handles[mine]),
                                 "group", events, learner, learner_file,
                                 rows=positions(members.index(rank), len(members)), length=CHUNK * len(members),
                                 members=members, count=False)
        obs["group"]["members"] = members
    except Exception as exc:
        obs["group"] = {"error": learner_error(exc), "members": members}
    return obs


def uneven_main(ctx: RankContext) -> dict:
    """Chunks of different lengths (kwargs["pattern"], one of UNEVEN_PATTERNS): what ring_attention does with them."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        ring_attention = ctx.function("ring_attention")
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        pattern = ctx.kwargs.get("pattern", "one-longer")
        rows = uneven_positions(ctx.world_size, pattern)[ctx.rank]
        length = sum(uneven_lengths(ctx.world_size, pattern))
        chunk = _own_chunk(make_inputs("uneven", length), rows, ctx)
        q, k, v = (chunk[name].requires_grad_(True) for name in ("q", "k", "v"))
        try:
            out = ring_attention(q, k, v)
        except NotImplementedError:
            raise
        except Exception as exc:  # the observation: a refusal, or an accident of the lengths
            return {"raised": type(exc).__name__, "message": str(exc)[:300], "length": len(rows)}
        run = {"raised": None, "length": len(rows), "output": plain_tensor(out), "grads": None}
        try:
            (out * chunk["g"]).sum().backward()
            run["grads"] = {"q": plain_tensor(q.grad), "k": plain_tensor(k.grad), "v": plain_tensor(v.grad)}
        except Exception as exc:
            run["backward_error"] = learner_error(exc)
        return run
