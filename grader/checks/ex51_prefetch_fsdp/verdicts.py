"""Exercise 51's verdicts: the numbers against single-process training, each step's collectives, the order in
which the all-gathers and reduce-scatters were issued and waited for among the units' marks, and the units in
memory as each unit began (pure functions of the records)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grader.compare import tensor_difference
from grader.rank import probes
from grader.rank.drivers.ex51_prefetch_fsdp import BATCH, PROBED_STEP, UNITS

# Float64, single-process training on the global batch: the same sums in another order (the gradient averaged
# over the ranks after each rank's own batch), nothing more; a stale, unarrived or unaveraged value is off by
# orders of magnitude more.
RTOL, ATOL = 1e-10, 1e-12
HARMLESS = ("barrier",)


def _differs(got, want) -> float | None:
    found = tensor_difference(got, want, rtol=RTOL, atol=ATOL)
    return None if found is None else found.max_abs  # inf where the shapes differ


# --- the numbers --------------------------------------------------------------------------------------------


def check_training(g, observations: list[dict], reference: dict, world_size: int) -> None:
    """Outputs, the slices' gradients and the state after each step, on every rank, against ``reference``
    (:func:`reference.reference_steps`)."""
    sizes = {name: len(slices[0]) for name, slices in reference["steps"][0]["grads"].items()}
    for rank, obs in enumerate(observations):
        message = _initial_mismatch(obs["initial"], reference["initial"])
        if message:
            g.record("matches-training", False, f"rank {rank}: right after PrefetchingFSDP(module), {message}",
                     rank=rank, world_size=world_size)
            return
    for step, expected in enumerate(reference["steps"]):
        for rank, obs in enumerate(observations):
            got = obs["steps"][step]
            where = f"step {step + 1}, rank {rank}"
            found = _differs(got["output"], expected["outputs"][rank])
            if found is not None:
                g.record("matches-training", False,
                         f"{where}: the output of the forward differs from single-process training's on this rank's "
                         f"{BATCH} samples by up to {found:.3g}: a unit computed with parameters that had not "
                         "arrived, or with another unit's, or the previous step's", rank=rank, world_size=world_size)
                return
            message = _grads_mismatch(got["grads"], expected["grads"], sizes, rank, world_size)
            if message:
                g.record("matches-training", False, f"{where}: {message}", rank=rank, world_size=world_size)
                return
            message = _state_mismatch(got["state"], expected["state"])
            if message:
                g.record("matches-training", False, f"{where}, after the optimizer step: {message}",
                         rank=rank, world_size=world_size)
                return
    g.record("matches-training", True)


def _initial_mismatch(got: dict, expected: dict) -> str:
    for key, want in expected.items():
        value = got.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want.shape):
            return f"full_state_dict() has no {key!r} of shape {list(want.shape)} (keys: {_some(list(got))})"
        found = tensor_difference(value, want)
        if found is not None:
            return (f"full_state_dict()[{key!r}] is not rank 0's (differs by up to {found.max_abs:.3g}): broadcast "
                    "every parameter and buffer from rank 0 before cutting the slices")
    return ""


def _grads_mismatch(grads: list, expected: dict, sizes: dict[str, int], rank: int, world_size: int) -> str:
    by_size = {}
    for grad in grads:
        if isinstance(grad, torch.Tensor):
            by_size.setdefault(grad.numel(), grad)
    for name, numel in sizes.items():
        grad = by_size.get(numel)
        if grad is None:
            shown = sorted(g.numel() if isinstance(g, torch.Tensor) else 0 for g in grads)
            return (f"after finish_gradient_synchronization() no trainable parameter of the wrapper holds a .grad of "
                    f"unit {name!r}'s slice ({numel} elements; the .grad sizes found: {shown})")
        found = _differs(grad.reshape(-1), expected[name][rank])
        if found is not None:
            ratio = _ratio(grad.reshape(-1), expected[name][rank])
            return (f"unit {name!r}'s slice .grad differs from the average over the ranks of the gradient "
                    f"(single-process on the global batch, {world_size} x {BATCH} samples) by up to {found:.3g}"
                    f"{ratio}")
    return ""


def _ratio(got: torch.Tensor, want: torch.Tensor) -> str:
    """Name a gradient scaled by an integer (summed over the ranks, not averaged)."""
    want = want.double()
    denom = float((want * want).sum())
    if denom == 0:
        return ""
    factor = float((got.double() * want).sum()) / denom
    if abs(factor - round(factor)) < 1e-3 and round(factor) > 1:
        return f"; it is {round(factor)} x the average: summed over the ranks and not divided by the world size?"
    return ""


def _state_mismatch(got: dict, expected: dict) -> str:
    for key, want in expected.items():
        value = got.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want.shape):
            return f"full_state_dict() has no {key!r} of shape {list(want.shape)}"
        found = _differs(value, want)
        if found is not None:
            return (f"full_state_dict()[{key!r}] differs from single-process training on the global batch by up to "
                    f"{found:.3g}")
    return ""


def _some(keys: list[str], shown: int = 4) -> str:
    return ", ".join(repr(k) for k in keys[:shown]) + (", ..." if len(keys) > shown else "") if keys else "none"


# --- the order of events ------------------------------------------------------------------------------------


@dataclass
class Call:
    """One collective of a step: what it was, which unit its size names, where it was issued and waited for."""

    op: str
    unit: str | None
    issued: int  # index in the step's events
    blocking: bool
    waited: int | None = None  # index of its first wait; None: never waited for in the step


@dataclass
class Step:
    """A step's events read: the collectives by kind and pass, and where each unit's marks are."""

    forward_gathers: list[Call] = field(default_factory=list)
    backward_gathers: list[Call] = field(default_factory=list)
    reduce_scatters: list[Call] = field(default_factory=list)
    others: list[dict] = field(default_factory=list)
    marks: dict[tuple[str, str], int] = field(default_factory=dict)  # (what, unit) -> index of its first mark
    forward_returned: int = 0
    backward_returned: int = 0


def read_step(events: list[dict], world_size: int, gathered: dict[int, str], sliced: dict[int, str]) -> Step:
    """``gathered``/``sliced``: the bytes of each unit's padded buffer and of its slice, and the unit they name."""
    step = Step()
    ends = {e.get("what"): i for i, e in enumerate(events) if e.get("op") == "mark"}
    step.forward_returned = ends.get("forward-returned", len(events))
    step.backward_returned = ends.get("backward-returned", len(events))
    calls: dict[int, Call] = {}
    for index, e in enumerate(events):
        op = e.get("op")
        if op == "mark":
            if e.get("unit"):
                step.marks.setdefault((e["what"], e["unit"]), index)
        elif op == "wait":
            call = calls.get(e.get("id"))
            if call is not None and call.waited is None:
                call.waited = index
        elif op in probes.ALL_GATHERS:
            call = Call(op, _gathered_unit(e, world_size, gathered), index, not e.get("async_op"))
            calls[e.get("id")] = call
            (step.forward_gathers if index < step.forward_returned else step.backward_gathers).append(call)
        elif op in probes.REDUCE_SCATTERS:
            call = Call(op, _sliced_unit(e, world_size, sliced), index, not e.get("async_op"))
            calls[e.get("id")] = call
            step.reduce_scatters.append(call)
        elif op in probes.COLLECTIVES + probes.POINT_TO_POINT and op not in HARMLESS:
            step.others.append(e)
    return step


def _gathered_unit(event: dict, world_size: int, gathered: dict[int, str]) -> str | None:
    """The unit an all-gather's size names: the output of all_gather_single and its older names, the input slice
    of the list form all_gather(tensor_list, tensor)."""
    size = int(event.get("bytes") or 0) * (world_size if event["op"] == "all_gather" else 1)
    return gathered.get(size) or gathered.get(size * world_size)


def _sliced_unit(event: dict, world_size: int, sliced: dict[int, str]) -> str | None:
    size = int(event.get("bytes") or 0)
    return sliced.get(size) or (sliced.get(size // world_size) if size % world_size == 0 else None)


def check_collectives(g, observations: list[dict], world_size: int, gathered: dict[int, str],
                      sliced: dict[int, str]) -> None:
    units = list(gathered.values())
    for rank, obs in enumerate(observations):
        for number, record in enumerate(obs["steps"], start=1):
            step = read_step(record["events"], world_size, gathered, sliced)
            message = _collectives_message(step, units, gathered, sliced)
            if message:
                g.record("collectives-per-step", False, f"step {number}, rank {rank}: {message}",
                         rank=rank, world_size=world_size)
                return
    g.record("collectives-per-step", True)


def _collectives_message(step: Step, units: list[str], gathered: dict[int, str], sliced: dict[int, str]) -> str:
    sizes = ", ".join(f"{name} {size}" for size, name in gathered.items())
    if step.others:
        shown = ", ".join(f"{e['op']} of {e.get('bytes')} bytes" for e in step.others[:3])
        return (f"the step called {shown}{' ...' if len(step.others) > 3 else ''}; a fully sharded step needs only "
                "all-gathers of the units' parameters and one reduce-scatter of each unit's gradient (an all-reduce "
                "sends every rank the gradients of slices it does not own)")
    forward = [c.unit for c in step.forward_gathers]
    if sorted(map(str, forward)) != sorted(units):
        return (f"the forward all-gathered {_names(forward)}; expected each unit's whole padded buffer once "
                f"(bytes: {sizes})")
    backward = [c.unit for c in step.backward_gathers]
    if len(set(backward)) != len(backward) or None in backward or not set(units[:-1]) <= set(backward):
        return (f"backward and finish_gradient_synchronization all-gathered {_names(backward)}; expected each unit "
                f"once more before its gradients are computed (the last unit's may be kept from the forward) "
                f"(bytes: {sizes})")
    reduced = [c.unit for c in step.reduce_scatters]
    if sorted(map(str, reduced)) != sorted(units):
        slices = ", ".join(f"{name} {size}" for size, name in sliced.items())
        return (f"the step reduce-scattered {_names(reduced)}; expected each unit's full gradient once, into this "
                f"rank's slice (bytes of each slice: {slices})")
    return ""


def _names(units: list) -> str:
    if not units:
        return "nothing"
    return ", ".join("a buffer of no unit's size" if u is None else repr(u) for u in units)


def check_forward_prefetch(g, observations: list[dict], world_size: int, gathered: dict[int, str],
                           sliced: dict[int, str]) -> None:
    units = list(gathered.values())
    for rank, obs in enumerate(observations):
        for number, record in enumerate(obs["steps"], start=1):
            step = read_step(record["events"], world_size, gathered, sliced)
            for before, unit in zip(units, units[1:]):
                call = next((c for c in step.forward_gathers if c.unit == unit), None)
                message = _prefetch_message(call, step, unit, before, "forward")
                if message:
                    g.record("prefetch-forward", False, f"step {number}, rank {rank}: {message}",
                             rank=rank, world_size=world_size)
                    return
    g.record("prefetch-forward", True)


def check_backward_prefetch(g, observations: list[dict], world_size: int, gathered: dict[int, str],
                            sliced: dict[int, str]) -> None:
    units = list(gathered.values())[::-1]  # the order backward runs them
    for rank, obs in enumerate(observations):
        for number, record in enumerate(obs["steps"], start=1):
            step = read_step(record["events"], world_size, gathered, sliced)
            for before, unit in zip(units, units[1:]):
                call = next((c for c in step.backward_gathers if c.unit == unit), None)
                message = _prefetch_message(call, step, unit, before, "backward")
                if message:
                    g.record("prefetch-backward", False, f"step {number}, rank {rank}: {message}",
                             rank=rank, world_size=world_size)
                    return
    g.record("prefetch-backward", True)


def _prefetch_message(call: Call | None, step: Step, unit: str, before: str, phase: str) -> str:
    """What is wrong with the all-gather of ``unit`` in ``phase``, which should travel while ``before`` computes."""
    ended = step.marks.get((f"{phase}-ends", before))
    begins = step.marks.get((f"{phase}-begins", unit))
    if call is None or ended is None or begins is None:
        return ""  # no such all-gather, or a unit that never ran: collectives-per-step and the numbers say so
    hook = "pre-forward hook" if phase == "forward" else "backward pre-hook (a hook on its output's gradient)"
    if call.blocking:
        return (f"the {phase} all-gather of unit {unit!r} was a blocking call (no async_op=True): it finished before "
                f"anything else ran, so nothing computed while it travelled; issue it with async_op=True while unit "
                f"{before!r} is about to compute, and wait for the work it returns when unit {unit!r} begins")
    if call.issued > ended:
        return (f"the {phase} all-gather of unit {unit!r} was issued after the {phase} of unit {before!r} had "
                f"ended, so nothing computed while it travelled; issue it before unit {before!r} computes (in unit "
                f"{before!r}'s {hook}) with async_op=True")
    if call.waited is None or call.waited > begins:
        return (f"the {phase} all-gather of unit {unit!r} was not waited for before unit {unit!r}'s {phase} began: "
                "its values may not have arrived when they were used; wait for its work first thing when the "
                f"{phase} of unit {unit!r} begins")
    if call.waited < ended:
        return (f"the {phase} all-gather of unit {unit!r} was waited for before the {phase} of unit {before!r} "
                f"ended: waiting at once leaves nothing to overlap it with; wait for it only when unit {unit!r}'s "
                f"{phase} begins")
    return ""


def check_reduce_scatters(g, observations: list[dict], world_size: int, gathered: dict[int, str],
                          sliced: dict[int, str]) -> None:
    units = list(gathered.values())
    for rank, obs in enumerate(observations):
        for number, record in enumerate(obs["steps"], start=1):
            step = read_step(record["events"], world_size, gathered, sliced)
            for index, unit in enumerate(units):
                call = next((c for c in step.reduce_scatters if c.unit == unit), None)
                message = _reduce_scatter_message(call, step, unit, units[index - 1] if index else None)
                if message:
                    g.record("reduce-scatter-overlapped", False, f"step {number}, rank {rank}: {message}",
                             rank=rank, world_size=world_size)
                    return
    g.record("reduce-scatter-overlapped", True)


def _reduce_scatter_message(call: Call | None, step: Step, unit: str, next_in_backward: str | None) -> str:
    if call is None:
        return ""  # collectives-per-step says so
    if call.blocking:
        return (f"unit {unit!r}'s reduce-scatter was a blocking call (no async_op=True): backward stopped until it "
                "was done; issue it with async_op=True and wait for it only in finish_gradient_synchronization")
    if call.issued > step.backward_returned:
        return (f"unit {unit!r}'s reduce-scatter was issued after backward had returned (in "
                "finish_gradient_synchronization), when nothing was left to compute under it; issue it as soon as the "
                "unit's full gradient exists (full.register_post_accumulate_grad_hook)")
    ended = step.marks.get(("backward-ends", next_in_backward)) if next_in_backward else None
    if ended is not None and call.issued > ended:
        return (f"unit {unit!r}'s reduce-scatter was issued only after the backward of unit {next_in_backward!r} "
                f"had ended, though unit {unit!r}'s gradient was complete before that unit began; issue it as soon "
                "as the unit's full gradient exists (full.register_post_accumulate_grad_hook)")
    if call.waited is not None and call.waited < step.backward_returned:
        return (f"unit {unit!r}'s reduce-scatter was waited for during backward: the units still to compute waited "
                "for it; wait for every reduce-scatter only in finish_gradient_synchronization")
    if call.waited is None:
        return (f"unit {unit!r}'s reduce-scatter was never waited for (Work.wait()) in the step: its slice's "
                "gradient may not have arrived when the optimizer stepped; wait for it in "
                "finish_gradient_synchronization")
    return ""


# --- memory -------------------------------------------------------------------------------------------------


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
            where = "as the forward of unit" if record["phase"] == "forward" else "as the backward of unit"
            g.record("two-units-at-a-time", False,
                     f"step {PROBED_STEP + 1}, rank {rank}: {where} {record['unit']!r} began (every all-gather issued "
                     f"by then allowed to arrive), the full parameters of {len(record['gathered'])} units were in "
                     f"memory ({', '.join(record['gathered'])}); at most two may be: the unit computing and the one "
                     "prefetched. Prefetch one unit ahead, and free each unit in place "
                     "(untyped_storage().resize_(0)) right after its forward and its backward",
                     rank=rank, world_size=world_size)
            return
    g.record("two-units-at-a-time", True)
