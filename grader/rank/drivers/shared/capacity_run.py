"""Real runs of the cost model's transformer under a plan, measured (runs in each rank; 41-43).

``measure_main(ctx)`` trains one step of the model of ``ctx.kwargs["model"]`` under ``ctx.kwargs["plan"]``
(laid out as ``ctx.kwargs["layout"]`` says: :func:`grader.checks.shared.capacity_cases.measure_kwargs` makes them)
(data and context parallel with ZeRO 0-3 by hand on flat buffers, Megatron tensor and sequence parallelism,
GPipe, 1F1B or interleaved 1F1B with send/recv, experts over ranks, bf16-mixed or fp32, recompute none,
selective or full) and records, in this rank, what the cost model predicts, measured rather than assumed:

* ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``: the storages alive (each once) that hold
  the parameters that compute, the gradients and Adam's state, found by walking what the rank keeps
  (:func:`grader.rank.memory.reachable_tensors`, the ``.grad`` of every parameter included). Gradients
  are measured between their reduction and the optimizer step, parameters and optimizer state after
  the step. ``other_bytes``: storages the rank keeps that are none of the three, or counted in two.
* ``activations_bytes``: the peak over the schedule of the storages autograd keeps saved inside the
  transformer layers (``saved_tensors_hooks`` around each layer's forward), each once, parameters
  left out, sampled after every forward and backward of a micro-batch's chunk.
* ``collectives``: ``[dimension, name, payload_bytes]`` of every collective and send, from
  :func:`grader.rank.probes.watch_collectives` (its name and payload: the whole buffer) and the process group
  it ran on (which dimension's group the code passed); receives are left out.
* ``flops``: ``FlopCounterMode`` over the whole step (forward, backward, recomputation), with torch's
  formulas for the flash attention kernel registered for its CPU form.

Nothing is decided here. Sends are ``isend`` (recorded as ``send``), tagged by micro-batch and stage
boundary: two neighbouring stages that each send before they receive, as 1F1B's steady state makes them,
deadlock with gloo's blocking send.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from grader.rank import memory, probes
from grader.rank.drivers.shared import capacity_model as cm
from grader.rank.drivers.shared import capacity_parallel as par
from grader.rank.drivers.shared.capacity_buffers import FlatBuffer

DROPOUT = 0.1
NAMES = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
         "reduce_scatter_single": "reduce-scatter", "_reduce_scatter_base": "reduce-scatter",
         "all_gather": "all-gather", "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
         "_all_gather_base": "all-gather", "send": "send", "isend": "send", "all_to_all_single": "all-to-all"}
RECEIVES = ("recv", "irecv")
WATCHED = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")


# --- in each rank ---------------------------------------------------------------------------------------


def measure_main(ctx) -> dict:
    """One measured training step of the plan in ``ctx.kwargs`` on this rank (plain data)."""
    with ctx.group():
        return measure(ctx.rank, ctx.world_size, ctx.kwargs)


def coordinates(rank: int, plan: dict) -> tuple[int, int, int, int]:
    """(pp_index, dp_index, cp_index, tp_index) of rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index."""
    dp, tp, cp = plan["dp"], plan["tp"], plan.get("cp", 1)
    return rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp


def rank_of(plan: dict, pp_index: int, dp_index: int, cp_index: int, tp_index: int) -> int:
    return ((pp_index * plan["dp"] + dp_index) * plan.get("cp", 1) + cp_index) * plan["tp"] + tp_index


def plan_groups(plan: dict, coords: tuple) -> dict:
    """{dimension: (group or None, its global ranks)} of this rank; every group is made on every rank, in
    the same order (tp, cp, dp, pp, ep, edp); none for a dimension of size 1. dp is the data and context
    ranks (the dense gradients' group), ep consecutive data ranks, edp the data ranks holding the same experts."""
    dp, tp, pp, cp, ep = plan["dp"], plan["tp"], plan["pp"], plan.get("cp", 1), plan.get("ep", 1)
    P, D, C, T = range(pp), range(dp), range(cp), range(tp)
    grids = {
        "tp": [[rank_of(plan, p, d, c, t) for t in T] for p in P for d in D for c in C],
        "cp": [[rank_of(plan, p, d, c, t) for c in C] for p in P for d in D for t in T],
        "dp": [[rank_of(plan, p, d, c, t) for d in D for c in C] for p in P for t in T],
        "pp": [[rank_of(plan, p, d, c, t) for p in P] for d in D for c in C for t in T],
        "ep": [[rank_of(plan, p, d, c, t) for d in range(k, k + ep)] for p in P for k in range(0, dp, ep)
               for c in C for t in T],
        "edp": [[rank_of(plan, p, d, c, t) for d in range(k, dp, ep)] for p in P for k in range(ep) for c in C for t in T],
    }
    me = rank_of(plan, *coords)
    mine = {}
    for dimension, grid in grids.items():
        for ranks in grid:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if me in ranks:
                mine[dimension] = (group, ranks)
    return mine


def batches(model: dict, plan: dict, seed: int, dp_index: int, cp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (micro_batches, micro_batch, seq_len / cp): this data and context rank's part of
    one global batch drawn the same way on every rank."""
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (plan["dp"], plan["micro_batches"], plan["micro_batch"], model["seq_len"] + 1)
    data = torch.randint(model["vocab"], shape, generator=gen)[dp_index]
    local = model["seq_len"] // plan.get("cp", 1)
    window = slice(cp_index * local, (cp_index + 1) * local)
    return data[..., :-1][..., window].contiguous(), data[..., 1:][..., window].contiguous()


class SavedActivations:
    """Storages autograd saves inside the layers, by weak reference; the peak of the live ones."""

    def __init__(self, parameter_storages):
        self.refs: list = []
        self.parameter_storages = parameter_storages  # () -> data_ptrs of the parameters' storages now
        self.peak = 0

    def watch(self):
        return memory.watch_saved(self.refs)

    def live_bytes(self) -> int:
        self.refs[:] = [r for r in self.refs if not r.expired()]
        excluded = self.parameter_storages()
        return sum(s.nbytes() for ptr, s in memory.saved_storages(self.refs).items() if ptr not in excluded)

    def sample(self) -> None:
        self.peak = max(self.peak, self.live_bytes())


def shared_names(spec: cm.Spec, plan: cm.PlanView) -> set[str]:
    """What each tensor rank computes on its own tokens under sequence parallelism: norms, row-parallel biases,
    the position embedding."""
    if not plan.sp or plan.tp == 1:
        return set()
    names = {"pos_emb", "lnf_w", "lnf_b"}
    for i in range(spec.layers):
        names |= {f"layers.{i}.{n}" for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "out_b", "fc2_b")}
    return names


class Trainer:
    """One rank's chunks, flat buffers, ZeRO stage and Adam; ``step`` runs the plan's schedule once."""

    def __init__(self, model: dict, plan: dict, layout: dict, coords: tuple, groups: dict, seed: int, dropout: float):
        self.spec, self.plan = cm.spec_of(model, layout), cm.plan_of(plan, layout)
        self.coords, self.groups, self.plan_dict = coords, groups, plan
        self.stage, self.dp_index, self.cp_index, self.tp_index = coords
        p = self.plan
        self.dtype = torch.bfloat16 if p.precision == "bf16-mixed" else torch.float32
        self.tp_group = groups.get("tp", (None, None))[0]
        shared = shared_names(self.spec, p)
        self.buffers = []  # (chunk, FlatBuffer)
        for spec in cm.local_buffers(self.spec, p, coords, seed):
            group = groups.get("dp" if spec["kind"] == "dense" else "edp", (None, None))[0]
            self.buffers.append((spec["chunk"], FlatBuffer(spec["params"], self.dtype, p.zero, group, p.dp * p.cp, shared)))
        params = {name: t for _, b in self.buffers for name, t in b.params.items()}
        self.chunks = []  # per chunk: its layers
        for c, layers in enumerate(p.chunks[self.stage]):
            self.chunks.append([cm.Layer({short: params[f"layers.{i}.{short}"] for short in cm.layer_shapes(self.spec, i)},
                                         self.spec, p, groups, i, dropout, self.cp_index) for i in layers])
        self.ends = cm.Ends(params, self.spec, p, groups, coords)
        self.activations = SavedActivations(self._parameter_storages)
        self.measured: dict = {}
        self.steps = 0

    def _parameter_storages(self) -> set:
        return set().union(*(b.storages() for _, b in self.buffers))

    def _of(self, chunk: int) -> list:
        return [b for c, b in self.buffers if c == chunk]

    # --- the schedule -----------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, measured: bool = True) -> float:
        """One optimizer step over the plan's micro-batches; the mean loss of the last stage (nan elsewhere)."""
        p = self.plan
        self.steps += 1
        for _, b in self.buffers:
            b.start_step()
        self.in_flight: dict = {}
        self.sends: list = []
        losses = []
        for op, j, c in p.order[self.stage]:
            if op == "F":
                loss = self.forward(j, c, tokens[j], targets[j])
                if loss is not None:
                    losses.append(loss)
            else:
                self.backward(j, c)
            if measured:
                self.activations.sample()
        for work, _ in self.sends:
            work.wait()
        self.sends = []
        for _, b in self.buffers:
            b.reduce(self.tp_group)
        if measured:
            self.measured["grads"] = self.measure()
        for _, b in self.buffers:
            b.update(self.steps)
        if measured:
            self.measured["after"] = self.measure()
        return sum(losses) / p.micro_batches if losses else float("nan")

    def _boundary(self, chunk: int, forward: bool) -> tuple[int, int] | None:
        """(peer rank, virtual stage of the boundary) this chunk receives its input from (forward) or sends
        its output to (not forward); None at the model's two ends."""
        p, s = self.plan, self.stage
        j = chunk * p.pp + s  # this chunk's virtual stage
        other = j - 1 if forward else j + 1
        if other < 0 or other >= p.pp * p.vpp:
            return None
        peer = rank_of(self.plan_dict, other % p.pp, self.dp_index, self.cp_index, self.tp_index)
        return peer, min(j, other)

    def _shape(self) -> tuple:
        p, spec = self.plan, self.spec
        split = p.tp if p.sp or p.scatter_gather else 1
        return p.micro_batch, spec.seq_len // p.cp // split, spec.hidden

    def _tag(self, micro: int, boundary: int, backward: bool) -> int:
        return (micro * self.plan.pp * self.plan.vpp + boundary) * 2 + int(backward)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int, whole: bool = True) -> None:
        p = self.plan
        if whole and self._gathered():  # scatter/gather: this tensor rank's part of the sequence only
            tensor = tensor.chunk(p.tp, dim=1)[self.tp_index]
        out = tensor.detach().contiguous()
        self.sends.append((dist.isend(out, dst=peer, group=self.groups["pp"][0], tag=tag), out))

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        x = torch.empty(self._shape(), dtype=self.dtype)
        dist.recv(x, src=peer, group=self.groups["pp"][0], tag=tag)
        return x

    def _gathered(self) -> bool:
        p = self.plan
        return p.scatter_gather and not p.sp and p.tp > 1

    def forward(self, j: int, c: int, tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
        for b in self._of(c):
            b.before_forward()
        source = self._boundary(c, forward=True)
        if source is None:
            x, first = self.ends.embed(tokens), None
        else:
            first = self._recv(source[0], self._tag(j, source[1], False)).requires_grad_()
            x = par.GatherForward.apply(first, self.tp_group) if self._gathered() else first
        for layer in self.chunks[c]:
            with self.activations.watch():
                x = layer(x)
        value = None
        target = self._boundary(c, forward=False)
        if target is None:
            loss = self.ends.loss(x, targets) / self.plan.micro_batches
            value = loss.item() * self.plan.micro_batches
            self.in_flight[j, c] = (first, loss)
        else:
            self._send(x, target[0], self._tag(j, target[1], False))
            self.in_flight[j, c] = (first, x)
        for b in self._of(c):
            b.after_forward()
        return value

    def backward(self, j: int, c: int) -> None:
        for b in self._of(c):
            b.before_backward()
        first, out = self.in_flight.pop((j, c))
        target = self._boundary(c, forward=False)
        if target is None:
            out.backward()
        else:
            grad = self._recv(target[0], self._tag(j, target[1], True))
            if self._gathered():
                grad = par._gather(grad, self.tp_group, 1)
            torch.autograd.backward(out, grad)
        source = self._boundary(c, forward=True)
        if source is not None:
            self._send(first.grad, source[0], self._tag(j, source[1], True), whole=False)
        del first, out
        for b in self._of(c):
            b.after_backward(self.tp_group)

    # --- measurement ------------------------------------------------------------------------------

    def measure(self) -> dict:
        """Bytes of the distinct storages this rank keeps, by what they hold."""
        roots = {"grads": [], "params": [], "optimizer": []}
        for _, b in self.buffers:
            for key, value in b.roots().items():
                roots[key].append(value)
        found = {key: memory.distinct_storages(memory.reachable_tensors([roots[key]], ""))
                 for key in ("grads", "params", "optimizer")}
        found["params"] = {ptr: s for ptr, s in found["params"].items() if ptr not in found["grads"]}
        everything = memory.distinct_storages(memory.reachable_tensors([self], ""))
        sizes = {key: sum(s.nbytes() for s in storages.values()) for key, storages in found.items()}
        union = sum(s.nbytes() for s in {**found["params"], **found["grads"], **found["optimizer"]}.values())
        # kept but none of the three, plus counted under two of them
        sizes["other"] = sum(s.nbytes() for s in everything.values()) - union + sum(sizes.values()) - union
        return sizes


@contextlib.contextmanager
def watch_dimensions(groups: dict, events: list):
    """Record the dimension of every collective this rank's code makes: the dimension whose process group it
    passed (the same call order as probes.watch_collectives')."""
    dimension_of = {id(group): name for name, (group, _) in groups.items() if group is not None}

    depth = [0]

    def wrap(original):
        def observed(*args, group=None, **kwargs):
            if depth[0] == 0:  # the dimension, and the largest tensor passed (the whole buffer)
                sizes = [a.numel() * a.element_size() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                events.append((dimension_of.get(id(group), "world"), max(sizes, default=0)))
            depth[0] += 1
            try:
                return original(*args, group=group, **kwargs)
            finally:
                depth[0] -= 1
        return observed

    with contextlib.ExitStack() as stack:
        for name in WATCHED:
            stack.enter_context(probes.patched(dist, name, wrap(getattr(dist, name))))
        yield events


def describe_collectives(plain: list[dict], dimensions: list[tuple], groups: dict) -> list:
    """[[dimension, name, payload]] from watch_collectives' events (every call, peers of sends; the payload
    the whole buffer: a reduce-scatter's input, an all-gather's output, an all-reduce's tensor) and the
    (dimension, largest tensor) of each collective in order; receives are left out."""
    pending = list(dimensions)
    out = []
    for event in plain:
        name = NAMES.get(event["op"], event["op"])
        if event["op"] in RECEIVES:
            continue
        if event["op"] in probes.POINT_TO_POINT:
            dimension = next((d for d in ("pp", "cp") if d in groups and event["peer"] in groups[d][1]), "world")
            out.append([dimension, name, int(event["bytes"])])
            continue
        dimension, size = pending.pop(0) if pending else ("world", 0)
        out.append([dimension, name, int(max(event["bytes"], size))])
    return out


def measure(rank: int, world_size: int, kwargs: dict) -> dict:
    """``kwargs``: model and plan (every field), layout, seed; optional ``dropout`` (default 0.1) and ``steps``
    (default 1: the figures are the first step's; later steps add only their losses)."""
    model, plan, layout, seed = kwargs["model"], kwargs["plan"], kwargs["layout"], int(kwargs.get("seed", 0))
    coords = coordinates(rank, plan)
    groups = plan_groups(plan, coords)
    tokens, targets = batches(model, plan, seed, coords[1], coords[2])
    torch.manual_seed(seed * 7919 + coords[1] * 131 + coords[2] * 17 + coords[0])  # dropout: the same on a tensor group
    trainer = Trainer(model, plan, layout, coords, groups, seed, float(kwargs.get("dropout", DROPOUT)))
    plain, dimensions = [], []
    with probes.watch_collectives(plain), watch_dimensions(groups, dimensions):
        with FlopCounterMode(display=False, custom_mapping=par.flash_flops()) as counter:
            losses = [trainer.step(tokens, targets)]
    collectives = describe_collectives(plain, dimensions, groups)
    for _ in range(int(kwargs.get("steps", 1)) - 1):
        losses.append(trainer.step(tokens, targets, measured=False))
    # The last stage's loss, averaged over data and context ranks, for every rank (outside the measurement).
    mine = trainer.stage == plan["pp"] - 1 and coords[3] == 0
    shared = torch.tensor([loss if mine else 0.0 for loss in losses], dtype=torch.float64)
    dist.all_reduce(shared)
    shared /= plan["dp"] * plan["cp"]
    after, before = trainer.measured["after"], trainer.measured["grads"]
    return {
        "rank": rank,
        "coords": list(coords),
        "params_bytes": int(after["params"]),
        "grads_bytes": int(before["grads"]),
        "optimizer_bytes": int(after["optimizer"]),
        "other_bytes": int(max(before["other"], after["other"])),
        "activations_bytes": int(trainer.activations.peak),
        "collectives": collectives,
        "flops": int(counter.get_total_flops()),
        "loss": float(shared[0]),
        "losses": [float(x) for x in shared],
    }
