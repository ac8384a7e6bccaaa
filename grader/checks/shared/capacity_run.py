"""Real runs of :mod:`grader.capacity`'s transformer under a plan, measured (runs in each rank; 41-43).

``measure_main(ctx)`` trains one step of the model of ``ctx.kwargs["model"]`` under
``ctx.kwargs["plan"]`` (data parallel with ZeRO 0-3 by hand on one flat buffer, Megatron tensor
parallelism, GPipe or 1F1B pipelining with send/recv, bf16-mixed or fp32, recompute none, selective
or full) and records, in this rank, what the cost model predicts, measured rather than assumed:

* ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``: the storages alive (each once) that hold
  the parameters that compute, the gradients and Adam's state, found by walking what the rank keeps
  (:func:`grader.memory.reachable_tensors`, the ``.grad`` of every parameter included). Gradients
  are measured between their reduction and the optimizer step, parameters and optimizer state after
  the step. ``other_bytes``: storages the rank keeps that are none of the three, or counted in two.
* ``activations_bytes``: the peak over the schedule of the storages autograd keeps saved inside the
  transformer layers (``saved_tensors_hooks`` around each layer's forward), each once, parameters
  left out, sampled after every forward and backward of a micro-batch.
* ``collectives``: ``[dimension, name, payload_bytes]`` of every collective and send, from
  :func:`grader.probes.watch_collectives` and :func:`grader.probes.watch_groups` (the group's ranks
  say the dimension, the whole buffer is the payload); receives are left out.
* ``flops``: ``FlopCounterMode`` over the whole step (forward, backward, recomputation).

Nothing is decided here. Sends are ``isend`` (recorded as ``send``): two neighbouring stages that
each send before they receive, as 1F1B's steady state makes them, deadlock with gloo's blocking send.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from grader import memory, probes
from grader.checks.shared import capacity_model as cm

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8
DROPOUT = 0.1
NAMES = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
         "reduce_scatter_single": "reduce-scatter", "_reduce_scatter_base": "reduce-scatter",
         "all_gather": "all-gather", "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
         "_all_gather_base": "all-gather", "send": "send", "isend": "send"}
RECEIVES = ("recv", "irecv")


# --- in each rank ---------------------------------------------------------------------------------------


def measure_main(ctx) -> dict:
    """One measured training step of the plan in ``ctx.kwargs`` on this rank (plain data)."""
    with ctx.group():
        return measure(ctx.rank, ctx.world_size, ctx.kwargs)


def coordinates(rank: int, plan: dict) -> tuple[int, int, int]:
    """(pp_index, dp_index, tp_index) of ``rank`` = (pp_index * dp + dp_index) * tp + tp_index."""
    dp, tp = plan["dp"], plan["tp"]
    return rank // (dp * tp), rank // tp % dp, rank % tp


def rank_of(plan: dict, pp_index: int, dp_index: int, tp_index: int) -> int:
    return (pp_index * plan["dp"] + dp_index) * plan["tp"] + tp_index


def make_groups(plan: dict, coords: tuple[int, int, int]) -> dict:
    """{dimension: (group or None, its global ranks)} of this rank; every group is made on every rank,
    in the same order (tensor, data, pipeline); none for a dimension of size 1."""
    dp, tp, pp = plan["dp"], plan["tp"], plan["pp"]
    mine = {}
    grids = {
        "tp": [[rank_of(plan, p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank_of(plan, p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank_of(plan, p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    me = rank_of(plan, *coords)
    for dimension in ("tp", "dp", "pp"):
        for ranks in grids[dimension]:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if me in ranks:
                mine[dimension] = (group, ranks)
    return mine


def batches(model: dict, plan: dict, seed: int, dp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each (micro_batches, micro_batch, seq_len): this data rank's part of one
    global batch drawn the same way on every rank."""
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (plan["dp"], plan["micro_batches"], plan["micro_batch"], model["seq_len"] + 1)
    data = torch.randint(model["vocab"], shape, generator=gen)[dp_index]
    return data[..., :-1].contiguous(), data[..., 1:].contiguous()


def schedule(plan: dict, stage: int) -> list[tuple[str, int]]:
    """[("F" or "B", micro-batch)] of ``stage``: GPipe every forward then every backward; 1F1B
    min(p - stage - 1, m) forwards of warm-up, then one forward and one backward in turn, then the
    backwards left (at most min(p - stage, m) micro-batches in flight)."""
    m, p = plan["micro_batches"], plan["pp"]
    if plan["schedule"] == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(p - stage - 1, m)
    ops = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        ops += [("F", warm + j), ("B", j)]
    return ops + [("B", j) for j in range(m - warm, m)]


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


class Trainer:
    """One rank's model, flat buffers, ZeRO stage and Adam; ``step`` runs the plan's schedule once."""

    def __init__(self, model: dict, plan: dict, coords: tuple[int, int, int], groups: dict, seed: int,
                 dropout: float):
        self.model, self.plan, self.coords, self.groups = model, plan, coords, groups
        self.stage, self.dp_index, _ = coords
        self.first, self.last = self.stage == 0, self.stage == plan["pp"] - 1
        self.dtype = torch.bfloat16 if plan["precision"] == "bf16-mixed" else torch.float32
        self.mixed = plan["precision"] == "bf16-mixed"
        self.zero, self.dp = plan["zero"], plan["dp"]
        named = cm.local_parameters(model, plan, coords, seed)
        self.layout = []  # (name, offset, shape)
        offset = 0
        for name, value in named:
            self.layout.append((name, offset, tuple(value.shape)))
            offset += value.numel()
        self.count = offset
        self.shard = -(-self.count // self.dp)
        self.padded = self.shard * self.dp
        init = torch.cat([value.reshape(-1) for _, value in named])  # float32, count
        padded_init = torch.cat([init, init.new_zeros(self.padded - self.count)])
        mine = slice(self.dp_index * self.shard, (self.dp_index + 1) * self.shard)
        self.params = {name: torch.empty(0, dtype=self.dtype).requires_grad_() for name, _ in named}
        self.grad_flat = self.grad_shard = self.grad_full = self.shard_param = None
        self.exp_avg = self.exp_avg_sq = None
        if self.zero < 3:  # whole parameters: views of one flat buffer of this rank's count elements
            self.flat = init.to(self.dtype)
            self._bind_data(self.flat)
        else:  # only the shard stays; the whole buffer (padded) is gathered for forward and backward
            self.shard_param = padded_init[mine].to(self.dtype).clone()
            self.flat = torch.empty(self.padded, dtype=self.dtype)
            self._bind_data(self.flat)
            self.flat.untyped_storage().resize_(0)
        if self.mixed:  # the float32 master copy: whole under ZeRO-0, this rank's shard otherwise
            self.master = init.clone() if self.zero == 0 else padded_init[mine].clone()
        else:
            self.master = None
        self.stage_params = {name.rsplit(".", 1)[-1]: p for name, p in self.params.items()
                             if not name.startswith("layers.")}
        per_stage = model["layers"] // plan["pp"]
        tp_group = groups.get("tp", (None, None))[0]
        self.layers = []
        for i in range(self.stage * per_stage, (self.stage + 1) * per_stage):
            params = {short: self.params[f"layers.{i}.{short}"] for short in cm.LAYER_NAMES}
            self.layers.append(cm.Layer(params, model["heads"], tp_group, plan["tp"], dropout, plan["recompute"]))
        self.activations = SavedActivations(self._parameter_storages)
        self.measured: dict = {}
        self.steps = 0

    # --- flat buffers -------------------------------------------------------------------------------

    def _bind_data(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for name, offset, shape in self.layout:
                self.params[name].data = flat[offset:offset + math.prod(shape)].view(shape)

    def _bind_grads(self, flat: torch.Tensor | None) -> None:
        for name, offset, shape in self.layout:
            self.params[name].grad = None if flat is None else flat[offset:offset + math.prod(shape)].view(shape)

    def _parameter_storages(self) -> set:
        return {p.untyped_storage().data_ptr() for p in self.params.values()} | {self.flat.untyped_storage().data_ptr()}

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole buffer of a reduce-scatter: ``flat`` (count elements) padded to dp x shard."""
        if flat.numel() == self.padded:
            return flat
        return torch.cat([flat, flat.new_zeros(self.padded - flat.numel())])

    def _mine(self, flat: torch.Tensor) -> torch.Tensor:
        """A shard-sized copy of this rank's part of ``flat``, zero past its end."""
        return self._padded(flat)[self.dp_index * self.shard:(self.dp_index + 1) * self.shard].clone()

    def _reduce_scatter(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sum over the data group of ``whole`` (padded), averaged."""
        out = torch.empty(self.shard, dtype=whole.dtype)
        if self.dp > 1:
            dist.reduce_scatter_single(out, whole, group=self.groups["dp"][0])
        else:
            out.copy_(whole[:self.shard])
        return out.div_(self.dp)

    def _all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        if self.dp > 1:
            dist.all_gather_single(out, shard, group=self.groups["dp"][0])
        else:
            out.copy_(shard)

    def _gather_parameters(self) -> None:  # ZeRO-3
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        self._all_gather(self.shard_param, self.flat)

    def _release_parameters(self) -> None:  # ZeRO-3
        self.flat.untyped_storage().resize_(0)

    # --- the schedule -----------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, measured: bool = True) -> float:
        """One optimizer step over the plan's micro-batches; the mean loss of the last stage (nan elsewhere)."""
        plan = self.plan
        self.steps += 1
        m = plan["micro_batches"]
        if self.zero < 2:
            if self.grad_flat is None:
                self.grad_flat = torch.zeros(self.count, dtype=self.dtype)
            self.grad_flat.zero_()
            self._bind_grads(self.grad_flat)
        else:
            self.grad_shard = torch.zeros(self.shard, dtype=self.dtype)
        self.in_flight: dict = {}
        self.sends: list = []
        losses = []
        for op, j in schedule(plan, self.stage):
            if op == "F":
                loss = self.forward(j, tokens[j], targets[j])
                if loss is not None:
                    losses.append(loss)
            else:
                self.backward(j)
            if measured:
                self.activations.sample()
        for work, _ in self.sends:
            work.wait()
        self.sends = []
        self.reduce()
        if measured:
            self.measured["grads"] = self.measure()
        self.update()
        if measured:
            self.measured["after"] = self.measure()
        return sum(losses) / m if losses else float("nan")

    def _neighbour(self, stage: int) -> int:
        return rank_of(self.plan, stage, self.dp_index, self.coords[2])

    def forward(self, j: int, tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
        plan, model = self.plan, self.model
        if self.zero == 3:
            self._gather_parameters()
        shape = (plan["micro_batch"], model["seq_len"], model["hidden"])
        if self.first:
            x, first = cm.embed(self.stage_params, tokens), None
        else:
            x = torch.empty(shape, dtype=self.dtype)
            dist.recv(x, src=self._neighbour(self.stage - 1), group=self.groups["pp"][0])
            first = x.requires_grad_()
        for layer in self.layers:
            with self.activations.watch():
                x = layer(x)
        value = None
        if self.last:
            loss = cm.head_loss(self.stage_params, x, targets) / plan["micro_batches"]
            value = loss.item() * plan["micro_batches"]
            self.in_flight[j] = (first, loss)
        else:
            out = x.detach()
            work = dist.isend(out, dst=self._neighbour(self.stage + 1), group=self.groups["pp"][0])
            self.sends.append((work, out))
            self.in_flight[j] = (first, x)
        if self.zero == 3:
            self._release_parameters()
        return value

    def backward(self, j: int) -> None:
        plan, model = self.plan, self.model
        if self.zero == 3:
            self._gather_parameters()
            self.grad_full = torch.zeros(self.padded, dtype=self.dtype)
            self._bind_grads(self.grad_full)
        elif self.zero == 2:  # this micro-batch's whole gradient, until its reduce-scatter
            self.grad_full = torch.zeros(self.count, dtype=self.dtype)
            self._bind_grads(self.grad_full)
        first, out = self.in_flight.pop(j)
        if self.last:
            out.backward()
        else:
            grad = torch.empty((plan["micro_batch"], model["seq_len"], model["hidden"]), dtype=self.dtype)
            dist.recv(grad, src=self._neighbour(self.stage + 1), group=self.groups["pp"][0])
            torch.autograd.backward(out, grad)
        if not self.first:
            sent = first.grad
            self.sends.append((dist.isend(sent, dst=self._neighbour(self.stage - 1), group=self.groups["pp"][0]),
                               sent))
        del first, out
        if self.zero >= 2:  # sharded gradients: reduce this micro-batch's now, keep the shard only
            self.grad_shard.add_(self._reduce_scatter(self._padded(self.grad_full)))
            self._bind_grads(None)
            self.grad_full = None
        if self.zero == 3:
            self._release_parameters()

    # --- gradients and the optimizer --------------------------------------------------------------

    def reduce(self) -> None:
        """ZeRO-0: one all-reduce of the whole flat gradient; ZeRO-1: one reduce-scatter, the shard
        written back into the whole gradient's own place (ZeRO-2/3 reduced per micro-batch)."""
        if self.zero == 0:
            if self.dp > 1:
                dist.all_reduce(self.grad_flat, group=self.groups["dp"][0])
            self.grad_flat.div_(self.dp)
        elif self.zero == 1:
            reduced = self._reduce_scatter(self._padded(self.grad_flat))
            start = self.dp_index * self.shard
            end = min(self.count, start + self.shard)
            if end > start:
                self.grad_flat[start:end].copy_(reduced[:end - start])

    def update(self) -> None:
        """Adam on the whole flat buffer (ZeRO-0) or this rank's shard, then the parameters that compute."""
        if self.zero == 0:
            grad = self.grad_flat.float()
            target = self.master if self.mixed else self.flat
        elif self.zero in (1, 2):  # the shard of the whole parameters, updated and gathered back
            grad = (self._mine(self.grad_flat) if self.zero == 1 else self.grad_shard).float()
            target = self.master if self.mixed else self._mine(self.flat)
        else:
            grad = self.grad_shard.float()
            target = self.master if self.mixed else self.shard_param
        if self.exp_avg is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(target), torch.zeros_like(target)
        adam(target, grad, self.exp_avg, self.exp_avg_sq, step=self.steps)
        del grad
        with torch.no_grad():
            if self.zero == 0:
                if self.mixed:
                    self.flat.copy_(self.master)
            elif self.zero in (1, 2):
                whole = torch.empty(self.padded, dtype=self.dtype)
                self._all_gather(target.to(self.dtype), whole)
                self.flat.copy_(whole[:self.count])
            elif self.mixed:
                self.shard_param.copy_(self.master)

    # --- measurement ------------------------------------------------------------------------------

    def measure(self) -> dict:
        """Bytes of the distinct storages this rank keeps, by what they hold."""
        params = [self.flat, self.shard_param, list(self.params.values())]
        grads = [self.grad_flat, self.grad_shard, self.grad_full] + [p.grad for p in self.params.values()]
        optimizer = [self.master, self.exp_avg, self.exp_avg_sq]
        found = {key: memory.distinct_storages(memory.reachable_tensors([roots], "")) for key, roots in
                 (("grads", grads), ("params", params), ("optimizer", optimizer))}
        found["params"] = {ptr: s for ptr, s in found["params"].items() if ptr not in found["grads"]}
        everything = memory.distinct_storages(memory.reachable_tensors([self], ""))
        sizes = {key: sum(s.nbytes() for s in storages.values()) for key, storages in found.items()}
        union = sum(s.nbytes() for s in {**found["params"], **found["grads"], **found["optimizer"]}.values())
        # kept but none of the three, plus counted under two of them
        sizes["other"] = sum(s.nbytes() for s in everything.values()) - union + sum(sizes.values()) - union
        return sizes


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
    """torch.optim.Adam's update, by hand (no torch.optim: it imports torch._dynamo)."""
    beta1, beta2 = BETAS
    with torch.no_grad():
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(EPS)
        param.addcdiv_(exp_avg, denom, value=-LR / (1 - beta1 ** step))


def describe_collectives(plain: list[dict], grouped: list[dict], groups: dict, world_size: int) -> list:
    """[[dimension, name, payload]] from watch_collectives' events (every call, peers of sends) and
    watch_groups' (the same collectives in the same order, with their groups' ranks). The payload is
    the whole buffer: the larger of what the two recorded (a reduce-scatter's input, an all-gather's
    output, an all-reduce's tensor)."""
    by_ranks = {tuple(ranks): dimension for dimension, (_, ranks) in groups.items()}
    pending = list(grouped)
    out = []
    for event in plain:
        name = NAMES.get(event["op"], event["op"])
        if event["op"] in RECEIVES:
            continue
        if event["op"] in probes.POINT_TO_POINT:
            dimension = next((d for d, (_, ranks) in groups.items() if d == "pp" and event["peer"] in ranks),
                             next((d for d, (_, ranks) in groups.items() if event["peer"] in ranks), "world"))
            out.append([dimension, name, int(event["bytes"])])
            continue
        match = pending.pop(0) if pending else {"group": None, "bytes": 0, "op": event["op"]}
        ranks = tuple(match["group"] or ())
        dimension = by_ranks.get(ranks, "world" if len(ranks) == world_size else f"ranks {list(ranks)}")
        out.append([dimension, name, int(max(event["bytes"], match["bytes"]))])
    return out


def measure(rank: int, world_size: int, kwargs: dict) -> dict:
    """``kwargs``: model, plan, seed; optional ``dropout`` (default 0.1) and ``steps`` (default 1: the
    figures are the first step's; later steps add only their losses)."""
    model, plan, seed = kwargs["model"], kwargs["plan"], int(kwargs.get("seed", 0))
    coords = coordinates(rank, plan)
    groups = make_groups(plan, coords)
    tokens, targets = batches(model, plan, seed, coords[1])
    torch.manual_seed(seed * 7919 + coords[1] * 131 + coords[0])  # dropout: the same on a tensor group's ranks
    trainer = Trainer(model, plan, coords, groups, seed, float(kwargs.get("dropout", DROPOUT)))
    plain, grouped = [], []
    with probes.watch_collectives(plain), probes.watch_groups(grouped):
        with FlopCounterMode(display=False) as counter:
            losses = [trainer.step(tokens, targets)]
    collectives = describe_collectives(plain, grouped, groups, world_size)
    for _ in range(int(kwargs.get("steps", 1)) - 1):
        losses.append(trainer.step(tokens, targets, measured=False))
    # The last stage's loss, averaged over data ranks, for every rank (outside the measurement).
    mine = trainer.last and coords[2] == 0
    shared = torch.tensor([loss if mine else 0.0 for loss in losses], dtype=torch.float64)
    dist.all_reduce(shared)
    shared /= plan["dp"]
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
