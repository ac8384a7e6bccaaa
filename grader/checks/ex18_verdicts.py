"""Exercise 18's verdicts that need no dense block (grader side): the collectives of each phase, and the three
refusals (a hidden size the world size does not divide, an input of the wrong width, chunks of different lengths).
:mod:`grader.checks.ex18_sequence_parallel` grades the exercise and imports these."""

from __future__ import annotations

import torch

from grader import probes
from grader.checks.ex18_rank import (BATCH, D_MODEL, REFUSALS, chunk_elements, chunk_rows, sizes, uneven_hidden,
                                     uneven_lengths)


def _where(rank: int, world_size: int) -> str:
    seq = sizes(world_size)[0]
    rows = chunk_rows(rank, world_size, seq)
    return f"world size {world_size}, rank {rank} (positions {rows.start}-{rows.stop - 1} of {seq})"


def _no_backward(run: dict) -> str:
    return ("no backward could be run: the output is not a tensor of x's shape that requires grad (it is "
            f"{_describe(run['output'])})")


def _describe(value) -> str:
    return f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else str(value)


# --- messages -----------------------------------------------------------------------------------


def activation_collectives(events: list[dict], world_size: int) -> dict:
    """The collectives of one phase that carry activations (at least one chunk's bytes), by kind: "gather"
    (an all-gather), "scatter" (a reduce-scatter, or the all-to-all torch.distributed.nn emulates it with,
    W scatter calls on gloo), "other" (anything else: an all-reduce, a broadcast, a send)."""
    least = chunk_elements(world_size) * 8  # float64
    out = {"gather": [], "scatter": [], "other": []}
    scatters = []
    for e in events:
        if e["bytes"] < least:
            continue  # a few numbers (the chunks' lengths) or a replicated parameter's gradient
        if e["op"] in probes.ALL_GATHERS:
            out["gather"].append(e)
        elif e["op"] in probes.REDUCE_SCATTERS or e["op"] in ("all_to_all", "all_to_all_single"):
            out["scatter"].append(e)
        elif e["op"] == "scatter":
            scatters.append(e)
        else:
            out["other"].append(e)
    if scatters and len(scatters) % world_size == 0:  # one from each rank in turn: an all-to-all
        out["scatter"] += [{"op": f"{world_size} scatters", "bytes": sum(e["bytes"] for e in scatters)}] * (
            len(scatters) // world_size)
    else:
        out["other"] += scatters
    return out


def _describe_events(events: list[dict]) -> str:
    return ", ".join(f"{e['op']} of {e['bytes']} bytes" for e in events) or "none"


def check_collectives(g, observations: list[dict], world_size: int) -> None:
    for check_id, phase in (("forward-gather-scatter", "forward"), ("backward-gather-scatter", "backward")):
        for rank, obs in enumerate(observations):
            run = obs["main"]
            if phase == "backward" and not run["backward_ran"]:
                g.record(check_id, False, f"{_where(rank, world_size)}: {_no_backward(run)}",
                         rank=rank, world_size=world_size)
                break
            kinds = activation_collectives(run[f"{phase}_events"], world_size)
            if world_size == 1 or (len(kinds["gather"]) == 1 and len(kinds["scatter"]) == 1 and not kinds["other"]):
                continue
            said = (f"{_where(rank, world_size)}: the {phase} made {len(kinds['gather'])} all-gather(s), "
                    f"{len(kinds['scatter'])} reduce-scatter(s) and {len(kinds['other'])} other collective(s) of "
                    f"activations (every call: {_describe_events(run[f'{phase}_events'])}); expected one all-gather "
                    "and one reduce-scatter along the sequence")
            reduces = [e for e in kinds["other"] if e["op"] == "all_reduce"]
            if reduces:
                said += (f". An all-reduce of {reduces[0]['bytes']} bytes carries an activation: every rank gets the "
                         "whole sum where it needs its chunk of it (a reduce-scatter sends half the bytes)")
            g.record(check_id, False, said, rank=rank, world_size=world_size)
            break
        else:
            g.record(check_id, True)


# --- bad input ----------------------------------------------------------------------------------


def _refusal_problem(results: list[dict], what: str) -> tuple[int, str] | None:
    """None when every rank refused with ValueError (or an assert); else (rank, what happened)."""
    for rank, res in enumerate(results):
        if res.get("raised") is None:
            return rank, f"{what}: rank {rank} went on without an error"
        if res["raised"] not in REFUSALS:
            return rank, (f"{what}: rank {rank} raised {res['raised']}: {res['message']!r}, an accident of the input "
                          "rather than a refusal; check it first and raise ValueError saying what was expected")
    return None


def check_hidden(g, observations: list[dict], world_size: int) -> None:
    hidden = uneven_hidden(world_size)
    problem = _refusal_problem([o["hidden"] for o in observations],
                               f"world size {world_size}, fc1 = nn.Linear({D_MODEL}, {hidden}) and fc2 = "
                               f"nn.Linear({hidden}, {D_MODEL}), {hidden} hidden features for {world_size} ranks")
    if world_size > 1 and problem is not None:
        rank, said = problem
        g.record("hidden-not-divisible-refused", False, said + ("" if "raised" in said else
                 ": the block was built; blocks of hidden // W features leave some out"), rank=rank,
                 world_size=world_size)
        return
    g.record("hidden-not-divisible-refused", True)


def check_shape(g, observations: list[dict], world_size: int) -> None:
    results = [o["shape"] for o in observations]
    if any(not r.get("built", True) for r in results):
        rank = next(i for i, r in enumerate(results) if not r.get("built", True))
        g.record("wrong-shape-refused", False, f"world size {world_size}, rank {rank}: the block could not be built: "
                 f"{results[rank].get('error')}", rank=rank, world_size=world_size)
        return
    rows = sizes(world_size)[0] // world_size
    problem = _refusal_problem(results, f"world size {world_size}, x of shape [{rows}, {BATCH}, "
                                        f"{D_MODEL + 1}] into a block whose d is {D_MODEL}")
    if problem is not None:
        rank, said = problem
        g.record("wrong-shape-refused", False, said, rank=rank, world_size=world_size)
        return
    g.record("wrong-shape-refused", True)


def uneven_words(world_size: int, pattern: str) -> str:
    """The lengths of an uneven pattern, and why a check that only adds them up misses it."""
    lengths = uneven_lengths(world_size, pattern)
    if pattern == "sum-hides":
        chunk = sum(lengths) // world_size
        return (f"world size {world_size}, chunks of lengths {lengths} (their sum is {sum(lengths)} = {chunk} x "
                f"{world_size}: a rank holding {chunk} cannot tell from the sum that the lengths differ)")
    return f"world size {world_size}, chunks of lengths {lengths} (a sequence of {sum(lengths)} cut by tensor_split)"


def check_uneven(g, outcome, world_size: int, pattern: str = "one-longer") -> None:
    said = uneven_words(world_size, pattern)
    results = [r.result if r.status == "ok" else None for r in outcome.ranks]
    refused = [rank for rank, res in enumerate(results) if res and res.get("raised") in REFUSALS]
    if refused and len(refused) < world_size:
        other = next(rank for rank in range(world_size) if rank not in refused)
        res = results[other]
        if res is None:
            went = f"rank {other}'s process {_how_it_ended(outcome.ranks[other])}"
        elif res.get("raised"):
            went = (f"rank {other} did not refuse: it went on and raised {res['raised']}: {res['message']!r} "
                    "(left alone in the all-gather)")
        else:
            went = f"rank {other} did not refuse: it went on without an error"
        g.record("uneven-sequence-refused", False,
                 f"{said}: {'rank' if len(refused) == 1 else 'ranks'} {', '.join(map(str, refused))} raised "
                 f"{results[refused[0]]['raised']}, but {went}. The ranks must refuse together: compare every "
                 "rank's length with every other's (an all-reduce of [n, -n] with MAX gives the largest and the "
                 "smallest), not only the total", rank=other, world_size=world_size)
        return
    for rank, r in enumerate(outcome.ranks):
        if r.status != "ok":
            g.record("uneven-sequence-refused", False, f"{said}: rank {rank}'s process {_how_it_ended(r)}. Compare "
                     "the ranks' lengths before the all-gather and raise ValueError on every rank", rank=rank,
                     world_size=world_size)
            return
    problem = _refusal_problem(results, said)
    if problem is not None:
        rank, message = problem
        g.record("uneven-sequence-refused", False, message + ("" if "raised" in message else
                 ". Every rank must raise ValueError: compare the lengths (an all-reduce of [n, -n] with MAX)"),
                 rank=rank, world_size=world_size)
        return
    g.record("uneven-sequence-refused", True)


def _how_it_ended(r) -> str:
    err = r.error or {}
    if err:
        return f"raised {err.get('type')}: {str(err.get('message'))[:200]}"
    lines = [line for line in (r.output or "").splitlines() if line.strip()]
    last = f"; its last output: {lines[-1].strip()[:200]}" if lines else ""
    return f"ended without a result (exit code {r.exitcode}){last}"
