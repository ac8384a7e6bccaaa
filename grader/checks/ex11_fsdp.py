"""Exercise 11: FullyShardedDP, fully sharded data parallel (ZeRO stage 3) by hand.

One run per world size. Each rank builds the grader's model (different on every
rank, on purpose: the wrapper must start from rank 0's), wraps it in the learner's
FullyShardedDP and trains it three times:

- "sgd": float32, plain SGD. Every torch.distributed call is recorded (with marks
  where forward, backward and finish_gradient_synchronization return), and after
  each step what the rank holds: the storages of every tensor reachable from the
  wrapper (its attributes, containers, hooks and their closures, the learner's
  globals, every .grad), counted once each. In one step a probe inside each unit's
  forward, and one where its backward begins, record which units' full parameters
  are in memory at that moment: found by content (the bytes of each unit's weight
  as full_state_dict() gave them before the step) among the tensors reachable from
  the wrapper and from the learner's running functions, and those autograd saved
  for backward.
- "adamw": float64, AdamW.
- "uneven": float32, SGD, on a model whose units' sizes divide by no world size.

The last two run under a short collective timeout, and an exception there is
recorded rather than raised. The grader replays single-process training of rank
0's model on the global batch, and decides every check.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn

from grader import memory, probes
from grader.checks import ex11_traffic as traffic
from grader.checks.ex11_traffic import padded
from grader.child import RankContext
from grader.compare import tensor_difference
from grader.checks.interface import Grader
from grader.checks.shared.learner_errors import learner_error

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


# --- shared by ranks and grader -------------------------------------------------------------


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


# --- in each rank: the drivers ----------------------------------------------------------------


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


def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    with ctx.group(), probes.watch_collectives(events):
        FullyShardedDP = ctx.function("FullyShardedDP")
        module = ctx.learner()
        learner = (module.__name__, os.path.abspath(module.__file__))
        out = {"sgd": _train(ctx, FullyShardedDP, "sgd", events, learner)}
        # A failure below is an observation: a short timeout turns a peer left waiting into an error.
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        try:
            out["adamw"] = _train(ctx, FullyShardedDP, "adamw", events, learner)
        except Exception as exc:
            out["adamw"] = {"error": learner_error(exc)}
        if _everyone_ok(ctx, out["adamw"]["error"] is None):
            try:
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


# --- in the grader ----------------------------------------------------------------------------


def reference_states(plan: str, world_size: int) -> list[dict]:
    """Rank 0's model trained in one process on the global batch: the state after each step."""
    dtype, _, steps_count = PLANS[plan]
    model = build_model(0, plan)
    trainable = [p for p in model.parameters() if p.requires_grad]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in trainable]
    out = []
    for step in range(steps_count):
        batches = [make_batch(step, rank, plan) for rank in range(world_size)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p, (exp_avg, exp_avg_sq) in zip(trainable, moments):
                if plan != "adamw":
                    p -= LR * p.grad
                    continue
                # torch.optim.AdamW's arithmetic, by hand (the grader's process imports no optimizer).
                lr, (beta1, beta2), eps, decay = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
                p.mul_(1 - lr * decay)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** (step + 1))).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** (step + 1)))
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def grade(g: Grader) -> None:

    for world_size in g.world_sizes:
        observations = g.run(rank_main, world_size).results()
        sgd = [o["sgd"] for o in observations]
        check_keys(g, sgd, "sgd", world_size)
        check_start(g, sgd, world_size)
        check_training(g, "matches-sgd", sgd, "sgd", world_size)
        check_frozen(g, sgd, "sgd", world_size)
        check_held(g, sgd, world_size)
        check_probes(g, sgd, world_size)
        check_collectives(g, sgd, world_size)
        adamw = [o["adamw"] for o in observations]
        if _errors(g, "matches-adamw", adamw, "the float64 model trained with AdamW", world_size):
            check_keys(g, adamw, "adamw", world_size)
            check_training(g, "matches-adamw", adamw, "adamw", world_size)
            check_frozen(g, adamw, "adamw", world_size)
        if any("uneven" not in o for o in observations):
            g.record("uneven-sizes", False, "not run: the run on the float64 model with AdamW failed first (see "
                     "matches-adamw), and the model that needs padding was to run after it", world_size=world_size)
            continue
        uneven = [o["uneven"] for o in observations]
        if _errors(g, "uneven-sizes", uneven, "the model whose unit sizes do not divide by the world size",
                   world_size):
            check_training(g, "uneven-sizes", uneven, "uneven", world_size)
            check_uneven_gathers(g, uneven, world_size)
    if max(g.world_sizes) == 1:  # --world-size 1: each slice is its whole unit
        g.skip("two-units-at-a-time", "needs a world size of 2 or more: with one rank a slice is the whole unit")


def _errors(g, check_id: str, observations: list[dict], what: str, world_size: int) -> bool:
    """Record the first rank's exception (the cause, not a peer left waiting); True when none raised."""
    failed = [(rank, o["error"]) for rank, o in enumerate(observations) if o.get("error")]
    if not failed:
        return True
    failed.sort(key=lambda item: any(w in item[1].lower() for w in ("by peer", "timed out", "timeout")))
    rank, error = failed[0]
    g.record(check_id, False, f"on {what}, rank {rank} raised {error}", rank=rank, world_size=world_size)
    return False


def _plan_text(plan: str) -> str:
    return {"sgd": "float32 model, SGD", "adamw": "float64 model, AdamW",
            "uneven": "model with unit sizes that need padding, SGD"}[plan]


def check_keys(g, observations: list[dict], plan: str, world_size: int) -> None:
    expected = {k: v for k, v in build_model(0, plan).state_dict().items()}
    for rank, obs in enumerate(observations):
        got = obs["initial"]
        missing = [k for k in expected if k not in got]
        extra = [k for k in got if k not in expected]
        if missing or extra:
            g.record("full-state-dict", False,
                     f"{_plan_text(plan)}, rank {rank}: full_state_dict() lacks {len(missing)} of the module's "
                     f"{len(expected)} keys ({_some(missing)}) and has {len(extra)} others ({_some(extra)})",
                     rank=rank, world_size=world_size)
            return
        for key, want in expected.items():
            value = got[key]
            if not isinstance(value, torch.Tensor):
                g.record("full-state-dict", False, f"{_plan_text(plan)}, rank {rank}: full_state_dict()[{key!r}] is "
                         f"{value}, not a tensor", rank=rank, world_size=world_size)
                return
            if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
                g.record("full-state-dict", False,
                         f"{_plan_text(plan)}, rank {rank}: full_state_dict()[{key!r}] has shape "
                         f"{list(value.shape)} and dtype {_dtype(value)}; the parameter has shape "
                         f"{list(want.shape)} and dtype {_dtype(want)}", rank=rank, world_size=world_size)
                return
    g.record("full-state-dict", True)


def _some(keys: list[str], shown: int = 3) -> str:
    listed = ", ".join(repr(k) for k in keys[:shown])
    return listed + (", ..." if len(keys) > shown else "") if keys else "none"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _comparable(got: dict, expected: dict) -> dict:
    return {k: v for k, v in got.items() if k in expected and isinstance(v, torch.Tensor)
            and tuple(v.shape) == tuple(expected[k].shape)}


def check_start(g, observations: list[dict], world_size: int) -> None:
    expected = build_model(0, "sgd").state_dict()
    for rank, obs in enumerate(observations):
        got = _comparable(obs["initial"], expected)
        for key, value in got.items():
            found = tensor_difference(value, expected[key])
            if found is not None:
                g.record("starts-from-rank0", False,
                         f"rank {rank}: right after FullyShardedDP(module), full_state_dict()[{key!r}] is not rank "
                         f"0's (differs by up to {found.max_abs:.3g}); broadcast every parameter and buffer from "
                         "rank 0 before sharding", rank=rank, world_size=world_size)
                break
    g.record("starts-from-rank0", True)


def check_training(g, check_id: str, observations: list[dict], plan: str, world_size: int) -> None:
    reference = reference_states(plan, world_size)
    dtype = PLANS[plan][0]
    rtol, atol = TOLERANCE[dtype]
    trainable = [n for n, p in build_model(0, plan).named_parameters() if p.requires_grad]
    for step, expected in enumerate(reference):
        for rank, obs in enumerate(observations):
            got = _comparable(obs["steps"][step]["state"], expected)
            for name in trainable:
                if name not in got:
                    g.record(check_id, False, f"{_plan_text(plan)}, rank {rank}: full_state_dict() has no "
                             f"{name!r} of the right shape", rank=rank, world_size=world_size)
                    return
                found = tensor_difference(got[name], expected[name], rtol=rtol, atol=atol)
                if found is not None:
                    g.record(check_id, False,
                             f"{_plan_text(plan)}, after step {step + 1}, rank {rank}: {name!r} differs from "
                             f"single-process training on the global batch ({world_size} x {BATCH} samples) by up "
                             f"to {found.max_abs:.3g} (relative {found.relative:.2g})"
                             f"{_ratio_text(obs, step, name, expected, plan)}",
                             rank=rank, world_size=world_size)
                    return
    g.record(check_id, True)


def _ratio_text(obs: dict, step: int, name: str, expected: dict, plan: str) -> str:
    """On the first SGD step, name an update scaled by an integer (gradients summed over the ranks)."""
    got_before = obs["initial"].get(name)
    if plan == "adamw" or step != 0 or not isinstance(got_before, torch.Tensor):
        return ""
    want = (expected[name] - build_model(0, plan).state_dict()[name]).double()
    got = (obs["steps"][0]["state"][name] - got_before).double()
    denom = (want * want).sum().item()
    if denom == 0:
        return ""
    factor = (got * want).sum().item() / denom
    if abs(factor - round(factor)) < 1e-2 and round(factor) > 1:
        return f"; the update is {round(factor)} x the expected one: gradients summed over the ranks, not averaged?"
    return ""


def check_frozen(g, observations: list[dict], plan: str, world_size: int) -> None:
    initial = build_model(0, plan).state_dict()[FROZEN]
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs["steps"]):
            value = record["state"].get(FROZEN)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(initial.shape):
                g.record("frozen-untouched", False, f"{_plan_text(plan)}, rank {rank}: full_state_dict() has no "
                         f"{FROZEN!r} of shape {list(initial.shape)}, so the frozen parameter cannot be followed",
                         rank=rank, world_size=world_size)
                return
            found = tensor_difference(value, initial)
            if found is not None:
                g.record("frozen-untouched", False,
                         f"{_plan_text(plan)}, after step {step + 1}, rank {rank}: the frozen parameter {FROZEN!r} "
                         f"(requires_grad=False) changed by up to {found.max_abs:.3g} from rank 0's initial value",
                         rank=rank, world_size=world_size)
                return
    g.record("frozen-untouched", True)


def expected_held(world_size: int, plan: str = "sgd") -> dict:
    """The bytes a rank holds between steps: its slices (twice: a gradient slice may stay allocated),
    the frozen parameter and the buffer, and a little slack."""
    model = build_model(0, plan)
    size = next(model.parameters()).element_size()
    full = sum(unit_sizes(plan).values()) * size
    slices = sum(padded(n, world_size) // world_size for n in unit_sizes(plan).values()) * size
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    return {"full": full, "slices": slices, "whole": whole, "limit": 2 * slices + whole + HELD_SLACK_BYTES}


def check_held(g, observations: list[dict], world_size: int) -> None:
    sizes = expected_held(world_size)
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs["steps"]):
            if record["held_units"] and world_size > 1:  # with one rank, the slice is the whole unit
                g.record("sharded-between-steps", False,
                         f"after step {step + 1}, rank {rank}: the full parameters of unit(s) "
                         f"{', '.join(record['held_units'])} are still in memory, in a tensor reachable from the "
                         "FullyShardedDP (free each unit's full buffer after its backward)",
                         rank=rank, world_size=world_size)
                return
            if record["held"] > sizes["limit"]:
                extra = record["held"] - sizes["slices"] - sizes["whole"]
                copies = extra / sizes["full"]
                like = f" ({copies:.1f} x the model's full parameters)" if copies >= 0.5 else ""
                g.record("sharded-between-steps", False,
                         f"after step {step + 1}, rank {rank} holds {record['held']} bytes in tensors reachable from "
                         f"the FullyShardedDP: its 1/{world_size} slices are {sizes['slices']} bytes of the "
                         f"model's {sizes['full']} trainable bytes, the frozen parameter and buffer {sizes['whole']}, "
                         f"and {extra} bytes more{like}; at most {sizes['limit']} allowed. The trainable parameters "
                         f"it yields hold {obs['trainable_numel']} elements", rank=rank, world_size=world_size)
                return
    g.record("sharded-between-steps", True)


def check_probes(g, observations: list[dict], world_size: int) -> None:
    if world_size == 1:
        return  # a slice is the whole unit: the unit is found in memory all along
    for rank, obs in enumerate(observations):
        records = obs["steps"][PROBED_STEP]["probes"]
        measured = next((r["units"] for r in records if r["phase"] == "fingerprints"), [])
        if len(measured) < len(UNITS):
            g.record("two-units-at-a-time", False,
                     f"rank {rank}: full_state_dict() lacks the weights of unit(s) "
                     f"{', '.join(u for u in UNITS if u not in measured)}, so the units in memory could not be "
                     "followed", rank=rank, world_size=world_size)
            return
        for record in records:
            if record["phase"] == "fingerprints" or len(record["gathered"]) <= 2:
                continue
            where = "as unit" if record["phase"] == "forward" else "as the backward of unit"
            g.record("two-units-at-a-time", False,
                     f"step {PROBED_STEP + 1}, rank {rank}: {where} {record['unit']!r} began, the full parameters "
                     f"of {len(record['gathered'])} units were in memory ({', '.join(record['gathered'])}); at most "
                     "two may be. Memory that autograd saved for backward counts: free the storage itself "
                     "(untyped_storage().resize_(0)), not only your reference", rank=rank, world_size=world_size)
            return
    g.record("two-units-at-a-time", True)


def check_collectives(g, observations: list[dict], world_size: int) -> None:
    traffic.check_collectives(g, observations, world_size, unit_sizes("sgd"))


def check_uneven_gathers(g, observations: list[dict], world_size: int) -> None:
    traffic.check_uneven_gathers(g, observations, world_size, unit_sizes("uneven"))
