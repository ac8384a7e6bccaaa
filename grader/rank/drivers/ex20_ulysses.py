"""Exercise 20, rank side: the inputs every rank builds (the grader builds the same), the scenarios each
rank runs with the learner's ulysses_attention, and what it records: the output and the gradients, every
collective its forward and its backward dispatched (all-to-alls with the bytes each kept and sent off the
rank), and the most heads whose whole sequence it held at once, found byte for byte in memory."""

from __future__ import annotations

import functools
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from grader.rank import memory, probes, rank_timeline
from grader.rank.child import RankContext
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import all_ok, plain_tensor

BATCH, CHUNK, HEAD_DIM = 2, 4, 8  # CHUNK: sequence positions per rank
DTYPE = torch.float64
SEEDS = {"plain": 1, "causal": 2, "gqa": 3, "few-kv": 4, "group": 5, "heads": 6, "kv-heads": 7}
RTOL = 1e-9  # float64: the ranks compute the same sums as one process, in another order at most
ATOL = 1e-9  # times the largest |value| of the expected tensor
SMALL_MESSAGE = 64  # bytes: a collective this small carries a few numbers (a shape, a flag), no activations
STALL_TIMEOUT_S = 5.0  # after the first scenarios: a rank that failed must not leave the others waiting
MEASURED = ("plain", "gqa", "few-kv")  # the scenarios whose memory is measured (non-causal: every head meets every key)
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd")  # dispatched by collectives, moving nothing themselves
PRODUCTS = ("aten.mm.", "aten.bmm.", "aten.addmm.", "aten.baddbmm.", "aten._scaled_dot_product",
            "aten.scaled_dot_product", "aten._flash_attention", "aten._efficient_attention")


# --- shared by ranks and grader -----------------------------------------------------------------


def fewer_kv_heads(world_size: int) -> int:
    """Fewer key/value heads than ranks, dividing W: W's largest proper divisor (1 for 2 and 3, 2 for 4)."""
    return max([d for d in range(1, world_size) if world_size % d == 0] or [1])


def neither_kv_heads(world_size: int) -> int:
    """Key/value heads that neither divide W nor are divisible by it (3 for 2 and 4, 2 for 3)."""
    return next(n for n in range(2, 2 * world_size + 2) if n % world_size and world_size % n)


def shapes(scenario: str, world_size: int) -> tuple[int, int, bool]:
    """(heads, kv_heads, causal) of a scenario on ``world_size`` ranks (the group's size for "group")."""
    heads = 2 * world_size
    if scenario == "causal":
        return heads, heads, True
    if scenario == "gqa":
        # Two key/value heads per rank, each shared by two query heads: a rank's pairing of its own heads shows
        # (h with h // 2, as torch pairs them, or with h % 2, as tiling k.repeat would).
        return 2 * heads, heads, False
    if scenario == "few-kv":
        return heads, fewer_kv_heads(world_size), False
    if scenario == "heads":
        return world_size + 1, 1, False  # one key/value head, which divides W: only the query heads' check refuses
    if scenario == "kv-heads":
        kv = neither_kv_heads(world_size)
        return math.lcm(kv, world_size), kv, False
    return heads, heads, False  # "plain" and "group"


def make_inputs(scenario: str, world_size: int) -> dict[str, torch.Tensor]:
    """q [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq, head_dim] and the output gradient g
    of the whole sequence (seq = CHUNK * W), seeded."""
    heads, kv_heads, _ = shapes(scenario, world_size)
    length = CHUNK * world_size
    generator = torch.Generator().manual_seed(1000 + SEEDS[scenario] * 100 + world_size)
    out = {}
    for name, count in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("g", heads)):
        out[name] = torch.randn(BATCH, count, length, HEAD_DIM, generator=generator, dtype=DTYPE)
    return out


def positions(rank: int, world_size: int) -> slice:
    """The sequence positions rank ``rank`` holds: [r * CHUNK, (r + 1) * CHUNK)."""
    return slice(rank * CHUNK, (rank + 1) * CHUNK)


def groups_of(world_size: int) -> list[list[int]]:
    """Two groups, the even global ranks and the odd ones (a group of one when W is 2 or 3), so that a
    rank's place in its group differs from its global rank."""
    if world_size < 2:
        return [[0]]
    return [list(range(0, world_size, 2)), list(range(1, world_size, 2))]


def replication(kv_heads: int, world_size: int) -> int:
    """How many copies of each key/value head travel: W / kv_heads when there are fewer than W, else 1."""
    return world_size // kv_heads if kv_heads < world_size else 1


def heads_share(kv_heads: int, heads: int, world_size: int) -> dict[str, int]:
    """The heads of each tensor whose whole sequence a rank may hold at once: its own share."""
    kv_share = max(kv_heads // world_size, 1)
    return {"q": heads // world_size, "k": kv_share, "v": kv_share}


# --- in each rank: what travels ------------------------------------------------------------------


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _process_group(value):
    """A ProcessGroup from a dispatched collective's argument (a boxed group, or a functional group's name)."""
    try:
        if isinstance(value, str):  # a functional collective's group name, or another string ("sum")
            return dist.distributed_c10d._resolve_process_group(value)
        if type(value).__name__ == "ScriptObject":
            return torch._C._distributed_c10d.ProcessGroup.unbox(value)
    except (RuntimeError, ValueError, TypeError):
        pass
    return None


def describe_collective(func, args) -> dict:
    """One dispatched collective: its name, its data's bytes, the global ranks of its group, and for an
    all-to-all the bytes this rank kept (its own part) and sent to the others."""
    name = str(func)
    event = {"op": name, "bytes": 0, "group": None, "kept": None, "sent": None, "dtype": None}
    group = next((g for g in map(_process_group, args) if g is not None), None)
    if group is not None:
        event["group"] = sorted(dist.get_process_group_ranks(group))
    first = next((a for a in args if isinstance(a, (torch.Tensor, list, tuple)) and _bytes(a)), None)
    if "alltoall_base_" in name or "all_to_all_single" in name:
        data = args[1] if "alltoall_base_" in name else args[0]  # c10d's op takes (output, input, ...)
        splits = args[4] if "alltoall_base_" in name else args[2]  # the input's split sizes
        size, me = (group.size(), group.rank()) if group is not None else (1, 0)
        rows = data.shape[0] if data.dim() else 1
        row_bytes = _bytes(data) // max(rows, 1)
        mine = list(splits)[me] if splits else rows // max(size, 1)
        event.update(bytes=_bytes(data), kept=int(mine) * row_bytes, dtype=str(data.dtype).removeprefix("torch."))
    elif "alltoall_" in name:  # c10d's list form: (outputs, inputs, group, ...)
        inputs = list(args[1])
        me = group.rank() if group is not None else 0
        event.update(bytes=_bytes(inputs), kept=_bytes(inputs[me]) if me < len(inputs) else 0)
    else:
        event["bytes"] = _bytes(first)
    if event["kept"] is not None:
        event["sent"] = event["bytes"] - event["kept"]
    return event


@functools.cache
def _watch_class():
    """The dispatch mode below, defined on first use."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        """Records every collective dispatched (torch.distributed's, the functional ones, and those autograd
        runs from C++), and calls ``probe`` after each one and before each matrix product."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # nothing here is compiled: without this the first use imports torch._dynamo (2 s)

        def __init__(self, events: list, probe):
            super().__init__()
            self.events = events
            self.probe = probe

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace in COLLECTIVE_NAMESPACES:
                name = str(func)
                message = not any(word in name for word in NOT_MESSAGES)
                if message:
                    self.events.append(describe_collective(func, args))
                out = func(*args, **kwargs)
                op = name.split(".")[1]
                self.probe(f"after the collective {op}" if message else f"when a collective's result arrived ({op})",
                           [args, out])
                return out
            if str(func).startswith(PRODUCTS):
                self.probe(f"before {str(func).split('.')[1]}", [args])
            return func(*args, **kwargs)

    return Watch


# --- in each rank: what is held ------------------------------------------------------------------


class HeldHeads:
    """The most heads of q, k and v whose whole sequence this rank holds at once, looked for byte for byte
    (each position's row of head_dim values) in the storages its learner's running frames, module, autograd
    graph, saved tensors and the operation at hand reach."""

    def __init__(self, rows: dict, learner, learner_file: str):
        self.rows = rows  # (name, head, position) -> the row's bytes, batch 0 of the whole sequence
        self.by_word = {}
        for key, raw in rows.items():
            self.by_word.setdefault(raw[:8], []).append((key, raw))
        self.keys = torch.tensor([int.from_bytes(w, "little", signed=True) for w in self.by_word], dtype=torch.int64)
        self.length = 1 + max((p for _, _, p in rows), default=0)
        self.learner = learner
        self.learner_file = learner_file
        self.globals = [value for name, value in vars(learner).items() if not name.startswith("__")]
        self.saved: list = []  # weak references to what autograd saved (memory.watch_saved)
        self.graph: list = []  # the output and its autograd nodes, once forward returned
        self.phase = "forward"
        self.most = {"q": [], "k": [], "v": []}
        self.where = {"q": "", "k": "", "v": ""}
        self.probes = 0

    def probe(self, where: str, extra: list | None = None) -> None:
        if not self.rows:
            return
        self.probes += 1
        roots = self.globals + self.graph + memory.running_locals(self.learner_file) + list(extra or [])
        storages = memory.distinct_storages(memory.reachable_tensors(roots, self.learner.__name__))
        storages.update(memory.saved_storages(self.saved))
        found = set()
        for storage in storages.values():
            raw = _contents(storage)
            found |= self._rows_in(raw)
            raw[:] = bytes(len(raw))  # no copy of another rank's rows may stay behind in freed memory
        for name in ("q", "k", "v"):
            whole = sorted({h for (n, h, _) in found if n == name
                            and all((name, h, p) in found for p in range(self.length))})
            if len(whole) > len(self.most[name]):
                self.most[name], self.where[name] = whole, f"in {self.phase}, {where}"

    def _rows_in(self, raw: bytearray) -> set:
        if len(raw) < 8 or len(raw) % 8:
            return set()
        words = torch.frombuffer(raw, dtype=torch.int64)
        out = set()
        for index in torch.isin(words, self.keys).nonzero().flatten().tolist():
            start = index * 8
            for key, row in self.by_word.get(bytes(raw[start:start + 8]), ()):
                if raw[start:start + len(row)] == row:
                    out.add(key)
        return out

    def record(self) -> dict:
        return {"most": self.most, "where": self.where, "probes": self.probes}


def _contents(storage: torch.UntypedStorage) -> bytearray:
    """A copy of a storage's bytes, which the caller zeroes after use."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if view.device.type == "cpu":
        return bytearray(view.numpy())
    host = view.cpu()
    out = bytearray(host.numpy())
    host.zero_()
    return out


def _rows(full: dict) -> dict:
    """Each position's row of every head of q, k and v (batch 0), as bytes."""
    out = {}
    for name in ("q", "k", "v"):
        tensor = full[name][0]
        for head in range(tensor.shape[0]):
            for position in range(tensor.shape[1]):
                out[(name, head, position)] = tensor[head, position].numpy().tobytes()
    return out


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


# --- in each rank: the scenarios -----------------------------------------------------------------


def _run(ctx: RankContext, call, scenario: str, learner, learner_file: str, *, members: list[int],
         group=None, measure: bool = False) -> dict:
    """Forward and backward of one scenario on this rank's chunk: the tensors, the collectives of each, and
    (``measure``) the most heads of each tensor held whole at once; a region of the timeline named as the
    checks name the case."""
    heads, kv_heads, causal = shapes(scenario, len(members))
    name = f"{scenario}: {heads} heads, {kv_heads} kv{', causal' if causal else ''}"
    with rank_timeline.region(name):
        return _run_case(ctx, call, scenario, learner, learner_file, members=members, group=group, measure=measure)


def _run_case(ctx: RankContext, call, scenario: str, learner, learner_file: str, *, members: list[int],
              group=None, measure: bool = False) -> dict:
    size, me = len(members), members.index(ctx.rank)
    full = make_inputs(scenario, size)
    rows = _rows(full) if measure else {}
    chunk = {name: t[:, :, positions(me, size)].clone().to(ctx.device) for name, t in full.items()}
    for t in full.values():  # no other rank's values left in memory the learner's buffers could be given
        t.zero_()
    del full
    q, k, v = (chunk[name].requires_grad_(True) for name in ("q", "k", "v"))
    held = HeldHeads(rows, learner, learner_file)
    forward_events: list = []
    with memory.watch_saved(held.saved), _watch_class()(forward_events, held.probe):
        out = call(q, k, v, shapes(scenario, size)[2])
    run = {"output": plain_tensor(out), "forward_events": forward_events, "backward_events": [], "backward_ran": False,
           "grads": {"q": None, "k": None, "v": None}}
    ok = isinstance(out, torch.Tensor) and out.requires_grad and tuple(out.shape) == tuple(q.shape)
    if measure:
        held.graph = _graph_nodes(out) if isinstance(out, torch.Tensor) else [out]
        held.probe("after forward (what is kept for backward)")
    if all_ok(ok, ctx.device, group):
        held.phase = "backward"
        with _watch_class()(run["backward_events"], held.probe):
            (out * chunk["g"]).sum().backward()
        run["backward_ran"] = True
        run["grads"] = {"q": plain_tensor(q.grad), "k": plain_tensor(k.grad), "v": plain_tensor(v.grad)}
    held.graph = []
    run["held"] = held.record()
    return run


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        ulysses_attention = ctx.function("ulysses_attention")
        learner = ctx.learner()
        return _observe(ctx, learner, ulysses_attention)


def _observe(ctx: RankContext, learner, ulysses_attention) -> dict:
    learner_file = os.path.abspath(learner.__file__)
    everyone = list(range(ctx.world_size))

    def call(q, k, v, causal):
        return ulysses_attention(q, k, v, causal=causal)

    obs = {}
    for scenario in ("plain", "causal"):
        obs[scenario] = _run(ctx, call, scenario, learner, learner_file, members=everyone,
                             measure=scenario in MEASURED)

    # From here on a rank that fails may leave the others waiting: a short timeout turns that into an error.
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    for scenario in ("gqa", "few-kv"):
        try:
            obs[scenario] = _run(ctx, call, scenario, learner, learner_file, members=everyone,
                                 measure=scenario in MEASURED)
        except Exception as exc:  # the observation; nothing after it runs (peers may be mid-exchange)
            obs[scenario] = {"error": learner_error(exc, 500)}
            return obs

    if not ctx.kwargs.get("groups"):
        return obs
    # Every rank makes every group, in the same order; each rank then runs in its own.
    groups = groups_of(ctx.world_size)
    handles = [dist.new_group(members) for members in groups]
    mine = next(i for i, members in enumerate(groups) if ctx.rank in members)
    members = groups[mine]

    def in_group(q, k, v, causal):
        return ulysses_attention(q, k, v, causal=causal, group=handles[mine])

    try:
        obs["group"] = _run(ctx, in_group, "group", learner, learner_file, members=members, group=handles[mine])
    except Exception as exc:
        obs["group"] = {"error": learner_error(exc, 500)}
    obs["group"]["members"] = members
    return obs


def refusal_main(ctx: RankContext) -> dict:
    """Heads the world size does not split (kwargs["pattern"]: "heads" or "kv-heads"): what
    ulysses_attention does with them."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        ulysses_attention = ctx.function("ulysses_attention")
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        pattern = ctx.kwargs["pattern"]
        full = make_inputs(pattern, ctx.world_size)
        chunk = {name: t[:, :, positions(ctx.rank, ctx.world_size)].clone().to(ctx.device) for name, t in full.items()}
        q, k, v = (chunk[name].requires_grad_(True) for name in ("q", "k", "v"))
        # Every rank connected before any may leave: a right answer refuses without a message, and a rank
        # still joining the group when a peer exits fails in gloo's connection instead.
        all_ok(True, ctx.device)
        events: list = []
        try:
            with _watch_class()(events, lambda *args: None):
                out = ulysses_attention(q, k, v)
        except NotImplementedError:
            raise
        except Exception as exc:  # the observation: a refusal, or an accident of the shapes
            return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                    "message": learner_error(exc, 500), "events": events}
        return {"raised": None, "output": plain_tensor(out), "events": events}
