"""Exercise 11, rank side: the model every rank builds (units of padded flat buffers' sizes, probes on each
unit's forward and backward), the batches, and what a rank records of the learner's FullyShardedDP."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from grader.rank import memory, probes, rank_timeline
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.child import RankContext

# Every unit's trainable size divides by 2, 3 and 4 (no padding): 576, 600, 600, 900 elements; and no
# unit's slice has another unit's size (a collective's size then names its unit, whichever tensor was recorded).
EVEN = {"inputs": 23, "width": 24, "hidden": 24, "outputs": 36}
# None divides evenly: 104, 182, 168 and 65 elements (each world size 2, 3 and 4 needs padding somewhere).
UNEVEN = {"inputs": 7, "width": 13, "hidden": 12, "outputs": 5}
UNITS = ("embed", "block", "hidden", "head")
WEIGHT_OF = {"embed": "embed.weight", "block": "block.linear.weight", "hidden": "hidden.weight",
             "head": "head.weight"}  # each unit's largest parameter: more than any one rank's slice
FROZEN = "block.gain"
STEPS = 3
UNEVEN_STEPS = 2
PROBED_STEP = 1  # the second step: values that differ from the initial ones
BATCH = 4
LR = 0.05
ADAMW = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1}
PLANS = {"sgd": ("float32", EVEN, STEPS), "adamw": ("float64", EVEN, STEPS),
         "uneven": ("float32", UNEVEN, UNEVEN_STEPS)}
TOLERANCE = {"float32": (1e-5, 1e-6), "float64": (1e-9, 1e-11)}  # (rtol, atol): a sum in another order
HELD_SLACK_BYTES = 1024  # small tensors a wrapper may keep (a counter, a flag)
STALL_TIMEOUT_S = 5.0  # collective timeout of the guarded runs: a rank that failed leaves the others waiting

_PROBE: list = [None]  # set by a rank's driver during the probed step: probe(phase, unit)


def _probe_forward(unit: nn.Module) -> None:
    if _PROBE[0] is not None:
        _PROBE[0]("forward", unit)


class _BackwardProbe(torch.autograd.Function):
    """Identity on a unit's output; its backward runs after the hooks on that output, before the unit's own."""

    @staticmethod
    def forward(ctx, output, unit):
        ctx.unit = unit
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        if _PROBE[0] is not None:
            _PROBE[0]("backward", ctx.unit)
        return grad, None


def _probe_backward(unit: nn.Module, output: torch.Tensor) -> torch.Tensor:
    if _PROBE[0] is None or not output.requires_grad:
        return output
    return _BackwardProbe.apply(output, unit)


class Linear(nn.Linear):
    """nn.Linear with the grader's probes (no-ops outside the probed step)."""

    def forward(self, x):
        _probe_forward(self)
        return _probe_backward(self, super().forward(x))


class Block(nn.Module):
    """A unit with a nested Linear, a frozen parameter and a buffer."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.empty(width).uniform_(0.5, 1.5), requires_grad=False)
        self.register_buffer("offset", torch.empty(width).uniform_(-0.1, 0.1))

    def forward(self, x):
        _probe_forward(self)
        return _probe_backward(self, torch.tanh(self.linear(x)) * self.gain + self.offset)


class Net(nn.Module):
    def __init__(self, dims: dict):
        super().__init__()
        self.embed = Linear(dims["inputs"], dims["width"])
        self.block = Block(dims["width"])
        self.hidden = Linear(dims["width"], dims["hidden"])
        self.head = Linear(dims["hidden"], dims["outputs"])

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        h = self.block(h)
        h = torch.tanh(self.hidden(h))
        return self.head(h)


def build_model(rank: int, plan: str) -> Net:
    """Rank ``rank``'s model before the wrapper: different on every rank, on purpose."""
    dtype, dims, _ = PLANS[plan]
    torch.manual_seed(1100 + 10 * rank + list(PLANS).index(plan))
    return Net(dims).to(getattr(torch, dtype))


def make_batch(step: int, rank: int, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, dims, _ = PLANS[plan]
    generator = torch.Generator().manual_seed(11_000 + 100 * step + rank)
    x = torch.randn(BATCH, dims["inputs"], generator=generator)
    y = torch.randn(BATCH, dims["outputs"], generator=generator)
    return x.to(getattr(torch, dtype)), y.to(getattr(torch, dtype))


def unit_sizes(plan: str) -> dict[str, int]:
    """Trainable elements of each unit."""
    model = build_model(0, plan)
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
    with ctx.group(), probes.watch_collectives(events):
        FullyShardedDP = ctx.function("FullyShardedDP")
        module = ctx.learner()
        learner = (module.__name__, os.path.abspath(module.__file__))
        with rank_timeline.region("sgd"):
            out = {"sgd": _train(ctx, FullyShardedDP, "sgd", events, learner)}
        # A failure below is an observation: a short timeout turns a peer left waiting into an error.
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        try:
            with rank_timeline.region("adamw"):
                out["adamw"] = _train(ctx, FullyShardedDP, "adamw", events, learner)
        except Exception as exc:
            out["adamw"] = {"error": learner_error(exc)}
        if _everyone_ok(ctx, out["adamw"]["error"] is None):
            try:
                with rank_timeline.region("uneven"):
                    out["uneven"] = _train(ctx, FullyShardedDP, "uneven", events, learner)
            except Exception as exc:
                out["uneven"] = {"error": learner_error(exc)}
        return out


def _everyone_ok(ctx: RankContext, ok: bool) -> bool:
    """Whether every rank's run ended well (else the group may be unusable: the next run is skipped)."""
    flag = torch.tensor([1 if ok else 0], device=ctx.device)
    try:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    except Exception:
        return False
    return bool(flag.item() == 1)


def _train(ctx: RankContext, FullyShardedDP, plan: str, events: list, learner: tuple[str, str]) -> dict:
    _, _, steps_count = PLANS[plan]
    model = build_model(ctx.rank, plan).to(ctx.device)
    names = {id(unit): name for name, unit in model.named_children()}
    wrapper = FullyShardedDP(model)
    del model  # from here on, what holds the model is the wrapper
    initial = _state(wrapper)
    trainable = [p for p in wrapper.parameters() if p.requires_grad]
    if plan == "adamw":
        optimizer = torch.optim.AdamW(trainable, **ADAMW)
    else:
        optimizer = torch.optim.SGD(trainable, lr=LR)
    obs = {"error": None, "initial": initial, "trainable_numel": sum(p.numel() for p in trainable),
           "steps": []}
    for step in range(steps_count):
        x, y = (t.to(ctx.device) for t in make_batch(step, ctx.rank, plan))
        before = obs["steps"][-1]["state"] if obs["steps"] else initial
        records: list = []
        probed = plan == "sgd" and step == PROBED_STEP
        first = len(events)
        if probed:
            _probed_step(wrapper, x, y, events, records, names, _fingerprints(before), learner)
        else:
            _step(wrapper, x, y, events)
        step_events = [dict(e) for e in events[first:]]
        optimizer.step()
        optimizer.zero_grad()
        # Between steps: what the wrapper holds, before full_state_dict() gathers anything.
        storages = memory.distinct_storages(memory.reachable_tensors([wrapper], learner[0]))
        held = sum(s.nbytes() for s in storages.values())
        contents = [memory.storage_bytes(s) for s in storages.values()]
        del storages
        state = _state(wrapper)
        obs["steps"].append({"events": step_events, "probes": records, "held": held,
                             "held_units": memory.found_in(contents, _fingerprints(state)), "state": state})
    return obs


def _step(wrapper, x, y, events: list) -> None:
    out = wrapper(x)
    events.append({"op": "mark", "what": "forward-returned"})
    F.mse_loss(out, y).backward()
    events.append({"op": "mark", "what": "backward-returned"})
    wrapper.finish_gradient_synchronization()
    events.append({"op": "mark", "what": "finish-returned"})


def _probed_step(wrapper, x, y, events: list, records: list, names: dict, fingerprints: dict,
                 learner: tuple[str, str]) -> None:
    """One step with the probes on: which units' full parameters are in memory as each unit runs."""
    saved: list = []  # weak references to the storages of every tensor autograd saved for backward

    def probe(phase: str, unit: nn.Module) -> None:
        storages = memory.distinct_storages(
            memory.reachable_tensors([wrapper] + memory.running_locals(learner[1]), learner[0]))
        storages.update(memory.saved_storages(saved))
        found = memory.found_in([memory.storage_bytes(s) for s in storages.values()], fingerprints)
        records.append({"phase": phase, "unit": names.get(id(unit), "?"), "gathered": found})

    _PROBE[0] = probe
    try:
        with memory.watch_saved(saved):
            out = wrapper(x)
        events.append({"op": "mark", "what": "forward-returned"})
        F.mse_loss(out, y).backward()
        events.append({"op": "mark", "what": "backward-returned"})
        wrapper.finish_gradient_synchronization()
        events.append({"op": "mark", "what": "finish-returned"})
    finally:
        _PROBE[0] = None
    records.append({"phase": "fingerprints", "units": sorted(fingerprints)})
