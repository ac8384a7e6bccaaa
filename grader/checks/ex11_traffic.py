"""Exercise 11's checks of what each rank sent: the all-gathers and reduce-scatters of one step, unit by
unit, read from the probes' events (grader side)."""

from __future__ import annotations

import math

from grader import probes

ALL_GATHERS, REDUCE_SCATTERS = probes.ALL_GATHERS, probes.REDUCE_SCATTERS
HARMLESS = ("barrier",)


def padded(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size


def _windows(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """The step's events before forward returned, and after (backward and finish_gradient_synchronization)."""
    marks = [i for i, e in enumerate(events) if e["op"] == "mark" and e["what"] == "forward-returned"]
    cut = marks[0] if marks else len(events)
    return events[:cut], events[cut:]


def check_collectives(g, observations: list[dict], world_size: int, sizes: dict[str, int]) -> None:
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


def check_uneven_gathers(g, observations: list[dict], world_size: int, sizes: dict[str, int]) -> None:
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
