"""Exercise 11's verdicts: keys, start, training, frozen parameters, bytes held, the probes' order and each
step's collectives (pure functions of the records)."""

from __future__ import annotations

import torch

from grader.rank import probes
from grader.rank.drivers.ex11_fsdp import BATCH, FROZEN, PLANS, PROBED_STEP, TOLERANCE, UNITS, build_model, unit_sizes
from grader.checks.ex11_fsdp.reference import expected_held, padded, reference_states
from grader.compare import tensor_difference


def check_no_error(g, check_id: str, observations: list[dict], what: str, world_size: int) -> bool:
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
    collectives_verdict(g, observations, world_size, unit_sizes("sgd"))


def check_uneven_gathers(g, observations: list[dict], world_size: int) -> None:
    uneven_gathers_verdict(g, observations, world_size, unit_sizes("uneven"))

ALL_GATHERS, REDUCE_SCATTERS = probes.ALL_GATHERS, probes.REDUCE_SCATTERS
HARMLESS = ("barrier",)


def _windows(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """The step's events before forward returned, and after (backward and finish_gradient_synchronization)."""
    marks = [i for i, e in enumerate(events) if e["op"] == "mark" and e["what"] == "forward-returned"]
    cut = marks[0] if marks else len(events)
    return events[:cut], events[cut:]


def collectives_verdict(g, observations: list[dict], world_size: int, sizes: dict[str, int]) -> None:
    """``sizes``: the trainable elements of each unit of the model trained."""
    element = 4
    gathered = sorted(padded(n, world_size) * element for n in sizes.values())
    sliced = sorted(padded(n, world_size) // world_size * element for n in sizes.values())
    units = len(sizes)
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs["steps"]):
            where = f"step {step + 1}, rank {rank}"
            forward, backward = _windows(record["events"])
            _check_gathers(g, where, forward, backward, gathered, units, world_size, rank)
            _check_reductions(g, where, forward + backward, sliced, units, world_size, rank)
    # A failure recorded above is kept over these.
    g.record("gathers-per-unit", True)
    g.record("reduce-scatter-grads", True)


def gathered_bytes(events: list[dict], world_size: int, expected: list[int]) -> list[int]:
    """The size of what each all-gather in ``events`` assembled, in bytes, smallest first.

    The probe records the first tensor argument: the output of all_gather_single and its older
    names, the input slice of the list form all_gather(tensor_list, tensor) and of the functional
    collectives (all_gather_tensor, recorded as all_gather_into_tensor). A slice is world_size
    times smaller than what it assembles, so an input that matches no unit but would be one
    unit's slice counts as that unit.
    """
    out = []
    for e in events:
        if e["op"] not in ALL_GATHERS:
            continue
        size = e["bytes"] * (world_size if e["op"] == "all_gather" else 1)
        if size not in expected and size * world_size in expected:
            size *= world_size
        out.append(size)
    return sorted(out)


def reduced_bytes(events: list[dict], world_size: int, expected: list[int]) -> list[int]:
    """The size of what each reduce-scatter in ``events`` left on this rank, in bytes, smallest first.

    The probe records the output slice, but the input of the functional reduce_scatter_tensor:
    an input world_size times a unit's slice counts as that slice.
    """
    out = []
    for e in events:
        if e["op"] not in REDUCE_SCATTERS:
            continue
        size = e["bytes"]
        if size not in expected and size % world_size == 0 and size // world_size in expected:
            size //= world_size
        out.append(size)
    return sorted(out)


def _check_gathers(g, where, forward, backward, gathered, units, world_size, rank) -> bool:
    in_forward = gathered_bytes(forward, world_size, gathered)
    in_backward = gathered_bytes(backward, world_size, gathered)
    text = (f"(the units' padded sizes are {gathered} bytes for {world_size} ranks)")
    if in_forward != gathered:
        return g.record("gathers-per-unit", False,
                        f"{where}: the forward pass all-gathered {len(in_forward)} time(s), {in_forward} bytes; "
                        f"expected one all-gather of each unit's whole padded buffer {text}",
                        rank=rank, world_size=world_size)
    unknown = [b for b in in_backward if b not in gathered]
    if not units - 1 <= len(in_backward) <= units or unknown:
        return g.record("gathers-per-unit", False,
                        f"{where}: backward and finish_gradient_synchronization all-gathered {len(in_backward)} "
                        f"time(s), {in_backward} bytes; expected each unit gathered again, once, before its "
                        f"gradients are computed ({units} all-gathers, or {units - 1} when the first unit's is "
                        f"skipped) {text}", rank=rank, world_size=world_size)
    return True


def _check_reductions(g, where, events, sliced, units, world_size, rank) -> bool:
    reductions = reduced_bytes(events, world_size, sliced)
    others = [e for e in events if e["op"] in probes.COLLECTIVES and e["op"] not in ALL_GATHERS + REDUCE_SCATTERS +
              HARMLESS]
    if others:
        shown = ", ".join(f"{e['op']} of {e['bytes']} bytes" for e in others[:4])
        return g.record("reduce-scatter-grads", False,
                        f"{where}: the step called {shown}{' ...' if len(others) > 4 else ''}; a fully sharded step "
                        "needs only all-gathers of parameters and one reduce-scatter of each unit's gradient (an "
                        "all-reduce sends every rank the gradients of slices it does not own)",
                        rank=rank, world_size=world_size)
    if reductions != sliced:
        return g.record("reduce-scatter-grads", False,
                        f"{where}: {len(reductions)} reduce-scatter(s) of {reductions} bytes (output) in the step; "
                        f"expected one per unit, each leaving this rank its slice: {sliced} bytes",
                        rank=rank, world_size=world_size)
    return True


def uneven_gathers_verdict(g, observations: list[dict], world_size: int, sizes: dict[str, int]) -> None:
    """``sizes``: the trainable elements of each unit of the model whose sizes do not divide evenly."""
    expected = sorted(padded(n, world_size) * 4 for n in sizes.values())
    for rank, obs in enumerate(observations):
        forward, _ = _windows(obs["steps"][0]["events"])
        got = gathered_bytes(forward, world_size, expected)
        if got != expected:
            shown = ", ".join(f"{name} {n} -> {padded(n, world_size)}" for name, n in sizes.items())
            g.record("uneven-sizes", False,
                     f"model with unit sizes that need padding, step 1, rank {rank}: the forward pass all-gathered "
                     f"{got} bytes; each unit's buffer padded to the next multiple of {world_size} gives {expected} "
                     f"(elements per unit: {shown})", rank=rank, world_size=world_size)
            return
    g.record("uneven-sizes", True)
