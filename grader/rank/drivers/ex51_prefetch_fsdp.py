"""Exercise 51, rank side: the model every rank builds (units that mark where their forward and backward
begin and end), the batches drawn from the grading's seed, and what a rank records of the learner's
PrefetchingFSDP: each step's output, its slices' gradients, the state after the step, and the order in which
collectives were issued and waited for among the units' marks."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from grader.rank import memory, order, probes, rank_timeline
from grader.rank.child import RankContext

# Each unit's trainable size, padded for 2, 3 and 4 ranks, differs from every other unit's and from every
# slice (132, 156, 182 and 90 elements; 183 and 184, 92 padded): a collective's size names its unit.
DIMS = {"inputs": 10, "width": 12, "hidden": 14, "outputs": 6}
UNITS = ("embed", "block", "hidden", "head")
WEIGHT_OF = {"embed": "embed.weight", "block": "block.linear.weight", "hidden": "hidden.weight",
             "head": "head.weight"}  # each unit's largest parameter: more than any one rank's slice
STEPS = 3
PROBED_STEP = 1  # the second step: values that differ from the initial ones
BATCH = 4
LR = 0.05
DTYPE = torch.float64
STALL_TIMEOUT_S = 5.0  # collective timeout: a rank that failed leaves the others waiting this long at most
MARKS = ("forward-begins", "forward-ends", "backward-begins", "backward-ends")

_EVENTS: list = [None]  # the event list of the step now running (None: marks are not recorded)
_PROBE: list = [None]  # set during the probed step: probe(phase, unit)


def _mark(what: str, unit: str) -> None:
    if _EVENTS[0] is not None:
        _EVENTS[0].append({"op": "mark", "what": what, "unit": unit})


class _BackwardMark(torch.autograd.Function):
    """Identity; its backward marks a moment of the unit's backward: on the unit's output it runs after the
    hooks on that output, before the unit's own gradients; on the unit's input, once they are computed."""

    @staticmethod
    def forward(ctx, x, what, unit):
        ctx.what, ctx.unit = what, unit
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.what == "backward-begins" and _PROBE[0] is not None:
            _PROBE[0]("backward", ctx.unit)
        _mark(ctx.what, ctx.unit)
        return grad, None, None


def _backward_mark(x: torch.Tensor, what: str, unit: str) -> torch.Tensor:
    return _BackwardMark.apply(x, what, unit) if x.requires_grad else x


class Unit(nn.Module):
    """What every unit does around its own computation: the four marks, and the probe as its forward begins."""

    unit_name = ""

    def forward(self, x):
        _mark("forward-begins", self.unit_name)
        if _PROBE[0] is not None:
            _PROBE[0]("forward", self.unit_name)
        x = _backward_mark(x, "backward-ends", self.unit_name)
        y = _backward_mark(self.compute(x), "backward-begins", self.unit_name)
        _mark("forward-ends", self.unit_name)
        return y


class Linear(Unit):
    def __init__(self, name: str, fan_in: int, fan_out: int):
        super().__init__()
        self.unit_name = name
        self.weight = nn.Parameter(torch.empty(fan_out, fan_in).uniform_(-fan_in ** -0.5, fan_in ** -0.5))
        self.bias = nn.Parameter(torch.empty(fan_out).uniform_(-fan_in ** -0.5, fan_in ** -0.5))

    def compute(self, x):
        return F.linear(x, self.weight, self.bias)


class Block(Unit):
    """A unit with a nested Linear, a frozen parameter and a buffer."""

    def __init__(self, width: int):
        super().__init__()
        self.unit_name = "block"
        self.linear = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.empty(width).uniform_(0.5, 1.5), requires_grad=False)
        self.register_buffer("offset", torch.empty(width).uniform_(-0.1, 0.1))

    def compute(self, x):
        return torch.tanh(self.linear(x)) * self.gain + self.offset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Linear("embed", DIMS["inputs"], DIMS["width"])
        self.block = Block(DIMS["width"])
        self.hidden = Linear("hidden", DIMS["width"], DIMS["hidden"])
        self.head = Linear("head", DIMS["hidden"], DIMS["outputs"])

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        h = self.block(h)
        h = torch.tanh(self.hidden(h))
        return self.head(h)


def build_model(seed: int, rank: int) -> Net:
    """Rank ``rank``'s model before the wrapper: different on every rank, on purpose."""
    torch.manual_seed(seed * 10 + rank)
    return Net().to(DTYPE)


def make_batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1000 + 100 * step + rank + 1)
    x = torch.randn(BATCH, DIMS["inputs"], generator=generator, dtype=DTYPE)
    y = torch.randn(BATCH, DIMS["outputs"], generator=generator, dtype=DTYPE)
    return x, y


def unit_sizes() -> dict[str, int]:
    """Trainable elements of each unit, in the order the units run."""
    model = build_model(0, 0)
    return {name: sum(p.numel() for p in unit.parameters() if p.requires_grad)
            for name, unit in model.named_children()}


def _state(wrapper) -> dict:
    return {str(k): v.detach().cpu().clone() if isinstance(v, torch.Tensor) else repr(v)[:80]
            for k, v in wrapper.full_state_dict().items()}


def _find(state: dict, key: str):
    """``state[key]``, or the entry whose key ends with it (a prefix such as 'module.' still finds it)."""
    if key in state:
        return state[key]
    return next((v for k, v in state.items() if k.endswith("." + key)), None)


def _fingerprints(state: dict) -> dict[str, bytes]:
    out = {}
    for unit, key in WEIGHT_OF.items():
        value = _find(state, key)
        if isinstance(value, torch.Tensor) and value.numel():
            out[unit] = memory.tensor_bytes(value)
    return out


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    seed = int(ctx.kwargs["seed"])
    with ctx.group(), order.watch_issue_and_wait(events) as calls:
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        PrefetchingFSDP = ctx.function("PrefetchingFSDP")
        module = ctx.learner()
        learner = (module.__name__, os.path.abspath(module.__file__))
        model = build_model(seed, ctx.rank)
        wrapper = PrefetchingFSDP(model)
        del model  # from here on, what holds the model is the wrapper
        initial = _state(wrapper)
        trainable = [p for p in wrapper.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=LR)
        steps = []
        for step in range(STEPS):
            x, y = make_batch(seed, step, ctx.rank)
            x.requires_grad_(True)  # so that the first unit's backward ends with a mark too
            before = steps[-1]["state"] if steps else initial
            first = len(events)
            records: list = []
            with rank_timeline.region(f"step {step + 1}"):
                if step == PROBED_STEP:
                    out = _probed_step(wrapper, x, y, events, records, calls, _fingerprints(before), learner)
                else:
                    out = _step(wrapper, x, y, events)
                grads = [p.grad.detach().clone() if p.grad is not None else None for p in trainable]
                optimizer.step()
                optimizer.zero_grad()
            step_events = [dict(e) for e in events[first:]]
            steps.append({"output": out, "grads": grads, "events": step_events, "probes": records,
                          "state": _state(wrapper)})
        return {"initial": initial, "steps": steps}


def _step(wrapper, x, y, events: list) -> torch.Tensor:
    _EVENTS[0] = events
    try:
        out = wrapper(x)
        events.append({"op": "mark", "what": "forward-returned"})
        F.mse_loss(out, y).backward()
        events.append({"op": "mark", "what": "backward-returned"})
        wrapper.finish_gradient_synchronization()
        events.append({"op": "mark", "what": "finish-returned"})
    finally:
        _EVENTS[0] = None
    return out.detach().clone()


def _probed_step(wrapper, x, y, events: list, records: list, calls, fingerprints: dict,
                 learner: tuple[str, str]) -> torch.Tensor:
    """One step with the probes on: which units' full parameters are in memory as each unit begins its forward
    and its backward, every collective in flight finished first (unrecorded), so that what a prefetch brings
    is there to be found."""
    saved: list = []  # weak references to the storages of every tensor autograd saved for backward

    def probe(phase: str, unit: str) -> None:
        calls.settle(STALL_TIMEOUT_S)
        storages = memory.distinct_storages(
            memory.reachable_tensors([wrapper] + memory.running_locals(learner[1]), learner[0]))
        storages.update(memory.saved_storages(saved))
        found = memory.found_in([memory.storage_bytes(s) for s in storages.values()], fingerprints)
        records.append({"phase": phase, "unit": unit, "gathered": found})

    _PROBE[0] = probe
    try:
        with memory.watch_saved(saved):
            return _step(wrapper, x, y, events)
    finally:
        _PROBE[0] = None
        records.append({"phase": "fingerprints", "units": sorted(fingerprints)})
