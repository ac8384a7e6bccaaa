"""Exercise 53's verdicts: the values against the all-gather and reduce-scatter computed here, what each rank held
at its matrix products, whom it sent how many bytes, and whether each transfer was in flight across a matrix
product (pure functions of the records)."""

from __future__ import annotations

import numpy as np
import torch

from grader.compare import tensor_difference
from grader.rank import probes
from grader.rank.drivers.ex53_async_tp import GATHER, REDUCE, ROWS, groups_of

RTOL, ATOL = 1e-10, 1e-12  # float64: the same products summed in another order, nothing more
CLOSE = 1e-9  # a computed product found in memory to within this, relative to its largest value
SENDS, RECEIVES = ("send", "isend"), ("recv", "irecv")
WORDS = {"allgather_matmul": "allgather_matmul(x_shard, weight, group)",
         "matmul_reduce_scatter": "matmul_reduce_scatter(x, weight_shard, group)"}


def first_error(records: list[dict]) -> tuple[int, str] | None:
    """The first rank's exception (the cause, not a peer left waiting), or None."""
    failed = [(rank, r["error"]) for rank, r in enumerate(records) if r.get("error")]
    if not failed:
        return None
    failed.sort(key=lambda item: any(w in item[1].lower() for w in ("by peer", "timed out", "timeout", "closed")))
    return failed[0]


def calls_of(observations: list[dict], scenario: str, function: str) -> list[dict] | None:
    """Each rank's record of one call, or None when the run stopped before it."""
    try:
        return [o["calls"][scenario][function] for o in observations]
    except (KeyError, TypeError):
        return None


# --- values ---------------------------------------------------------------------------------------------------


def check_values(g, check_id: str, records: list[dict] | None, expected: list[dict], function: str, part: str,
                 world_size: int, where: str = "") -> bool:
    """``part``: "output" or "grads". True when every rank's values match."""
    call = WORDS[function] + where
    if records is None:
        return g.record(check_id, False, f"{call} was not called: an earlier call failed (see the checks above)",
                        world_size=world_size)
    error = first_error(records)
    if error:
        rank, text = error
        return g.record(check_id, False, f"{call}, rank {rank} raised {text}", rank=rank, world_size=world_size)
    for rank, (got, want) in enumerate(zip(records, expected)):
        if part == "output":
            found = tensor_difference(got["output"], want["output"], rtol=RTOL, atol=ATOL)
            if found is not None:
                return g.record(check_id, False, f"{call}, rank {rank}: the output {_describe(found, want['output'])}"
                                f"{_rows_hint(got['output'], want['output'], function)}",
                                rank=rank, world_size=world_size)
            continue
        for name, want_grad in want["grads"].items():
            label = {"x": "x_shard" if function == "allgather_matmul" else "x",
                     "weight": "weight" if function == "allgather_matmul" else "weight_shard"}[name]
            got_grad = got["grads"].get(name)
            if got_grad is None:
                return g.record(check_id, False, f"{call}, rank {rank}: after backward, {label}.grad is None: the "
                                "output is not connected to it by autograd (an autograd.Function whose backward "
                                "returns its gradient)", rank=rank, world_size=world_size)
            found = tensor_difference(got_grad, want_grad, rtol=RTOL, atol=ATOL)
            if found is not None:
                return g.record(check_id, False, f"{call}, rank {rank}: the gradient of {label} "
                                f"{_describe(found, want_grad)}{_grad_hint(function, name)}",
                                rank=rank, world_size=world_size)
    return g.record(check_id, True)


def _describe(found, want: torch.Tensor) -> str:
    if found.reason != "values":
        return f"has {found.reason} {found.got}, expected {found.expected}"
    return f"differs by up to {found.max_abs:.3g} (relative {found.relative:.2g}) from the one computed in one process"


def _rows_hint(got, want: torch.Tensor, function: str) -> str:
    """Name rows put in another rank's place: the right blocks of rows, in the wrong order."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or function != "allgather_matmul":
        return ""
    blocks = list(want.split(ROWS))
    found = []
    for i, block in enumerate(got.split(ROWS)):
        match = next((j for j, b in enumerate(blocks) if torch.allclose(block, b, rtol=RTOL, atol=ATOL)), None)
        found.append(match)
    wrong = [(i, j) for i, j in enumerate(found) if j is not None and j != i]
    if wrong:
        i, j = wrong[0]
        return (f"; rows {i * ROWS} to {(i + 1) * ROWS - 1} hold group rank {j}'s rows times the weight: the chunk "
                "in hand at step s came from the group's rank (g - s) % W")
    return ""


def _grad_hint(function: str, name: str) -> str:
    return {("allgather_matmul", "x"): ": every rank's grad_out @ its weight.T, summed over the group, this rank's "
                                       "rows (a reduce-scatter)",
            ("allgather_matmul", "weight"): ": the whole input.T @ grad_out, every rank's chunk of rows",
            ("matmul_reduce_scatter", "x"): ": every rank's grad_out gathered, @ weight_shard.T",
            ("matmul_reduce_scatter", "weight"): ": x.T @ every rank's grad_out gathered"}[(function, name)]


# --- what a rank held --------------------------------------------------------------------------------------------


def _windows_close(content: bytes, pattern: np.ndarray) -> bool:
    usable = len(content) // 8 * 8
    if usable < pattern.nbytes:
        return False
    values = np.frombuffer(content[:usable], dtype=np.float64)
    windows = np.lib.stride_tricks.sliding_window_view(values, pattern.size)
    tolerance = CLOSE * max(float(np.abs(pattern).max()), 1e-300)
    with np.errstate(invalid="ignore"):
        return bool((np.abs(windows - pattern.ravel()) <= tolerance).all(axis=1).any())


def held_at(contents: list[bytes], ids: list[int], prints: dict) -> dict:
    """What one matrix product found in memory: ``whole`` (bool), ``chunks`` (the indices found)."""
    held = [contents[i] for i in ids if 0 <= i < len(contents)]
    if "exact" in prints:
        chunks = [c.numpy().tobytes() for c in prints["exact"]]
        whole = b"".join(chunks)
        return {"whole": any(whole in raw for raw in held),
                "chunks": [i for i, c in enumerate(chunks) if any(c in raw for raw in held)]}
    chunks = [c.numpy() for c in prints["close"]]
    whole = np.concatenate(chunks)
    return {"whole": any(_windows_close(raw, whole) for raw in held),
            "chunks": [i for i, c in enumerate(chunks) if any(_windows_close(raw, c) for raw in held)]}


def memory_message(record: dict, contents: list[bytes], prints: dict, function: str, group_size: int) -> str:
    returned = record.get("returned")
    for index, event in enumerate(record["events"]):
        if event.get("op") != "matmul":
            continue
        phase = "forward" if returned is None or index < returned else "backward"
        found = held_at(contents, event.get("held") or [], prints[phase])
        what = {("allgather_matmul", "forward"): "the whole gathered input (every rank's x_shard, in order)",
                ("allgather_matmul", "backward"): "the whole gathered input (every rank's x_shard, in order)",
                ("matmul_reduce_scatter", "forward"): "its whole product x @ weight_shard (every block of rows)",
                ("matmul_reduce_scatter", "backward"): "every rank's grad_out gathered"}[(function, phase)]
        if found["whole"] and group_size >= 3:  # two ranks' ring holds both chunks anyway, maybe side by side
            return (f"in {phase}, at a matrix product, the rank held {what} in one tensor: multiply each chunk as "
                    "it arrives, never the whole")
        own = prints[phase].get("own")
        others = [i for i in found["chunks"] if i != own]
        if group_size >= 4 and len(others) > 2:
            kinds = "chunks of the product" if own is None else "other ranks' chunks"
            return (f"in {phase}, at a matrix product, the rank held {len(others)} {kinds} at once (of "
                    f"{group_size}): a ring needs the chunk in hand and the one arriving; drop each once it is "
                    "multiplied and passed on (an autograd.Function that saves only its arguments)")
    return ""


# --- traffic and order ---------------------------------------------------------------------------------------------


def _phases(record: dict) -> tuple[list[dict], list[dict]]:
    returned = record.get("returned")
    events = record["events"]
    cut = len(events) if returned is None else returned
    return events[:cut], events[cut:]


def traffic_message(record: dict, rank: int, members: list[int], function: str) -> str:
    size = len(members)
    if size == 1:
        return ""
    me = members.index(rank)
    neighbours = {members[(me + 1) % size], members[(me - 1) % size]}
    chunk_bytes = ROWS * (GATHER["k"] if function == "allgather_matmul" else REDUCE["m"]) * 8
    what = "the input's chunks" if function == "allgather_matmul" else "partial sums"
    for phase, events in zip(("forward", "backward"), _phases(record)):
        collectives = [e for e in events if e.get("op") in probes.COLLECTIVES]
        if collectives:
            shown = ", ".join(f"{e['op']} of {e.get('bytes')} bytes" for e in collectives[:3])
            return (f"in {phase} it called {shown}: a collective moves the whole input at once; pass the chunks "
                    "around the ring with isend and irecv")
        sends = [e for e in events if e.get("op") in SENDS]
        strangers = sorted({e.get("peer") for e in sends} - neighbours, key=str)
        if strangers:
            return (f"in {phase} it sent to rank(s) {', '.join(map(str, strangers))}, which are not its ring "
                    f"neighbours in the group {members} (ranks {sorted(neighbours)}): each chunk goes to the next "
                    "rank only, who passes it on")
        if phase == "forward":
            peers = {e.get("peer") for e in sends}
            total = sum(int(e.get("bytes") or 0) for e in sends)
            if len(peers) > 1:
                return (f"in forward it sent to both its ring neighbours ({sorted(peers)}): around a ring every "
                        "chunk travels one way")
            if total != (size - 1) * chunk_bytes:
                return (f"in forward it sent {total} bytes; around a ring of {size} each rank sends {size - 1} of "
                        f"the {size} chunks of {what} ({chunk_bytes} bytes each): {(size - 1) * chunk_bytes} bytes")
    return ""


def order_message(record: dict) -> str:
    """Every transfer must be in flight (issued, not yet waited for) while a matrix product runs."""
    for phase, events in zip(("forward", "backward"), _phases(record)):
        waits = {}
        for index, e in enumerate(events):
            if e.get("op") == "wait":
                waits.setdefault(e.get("id"), index)
        products = [i for i, e in enumerate(events) if e.get("op") == "matmul"]
        for index, e in enumerate(events):
            if e.get("op") not in SENDS + RECEIVES:
                continue
            kind = "send" if e["op"] in SENDS else "receive"
            if not e.get("async_op"):
                return (f"in {phase}, a blocking {e['op']} (to or from rank {e.get('peer')}): nothing computes while "
                        f"it travels; issue dist.i{kind} and multiply the chunk in hand before waiting for it")
            waited = waits.get(e.get("id"))
            if waited is None:
                return (f"in {phase}, a {e['op']} (to or from rank {e.get('peer')}) was never waited for: its "
                        "buffer may be read, or reused, before the transfer is done")
            if not any(index < p < waited for p in products):
                return (f"in {phase}, a {e['op']} (to or from rank {e.get('peer')}) was waited for before any "
                        "matrix product ran: issue the next step's transfer, multiply the chunk in hand, then wait")
    return ""


def check_rank_records(g, check_id: str, message_of, calls: dict, world_size: int) -> None:
    """Record ``check_id`` from ``message_of(scenario, function, rank, record)`` on every call that ran without
    error (the values checks name the failures)."""
    for (scenario, function), records in calls.items():
        if records is None or first_error(records):
            continue
        for rank, record in enumerate(records):
            message = message_of(scenario, function, rank, record)
            if message:
                members = next(m for m in groups_of(scenario, world_size) if rank in m)
                where = "" if scenario == "world" else f" on the group {members}"
                g.record(check_id, False, f"{WORDS[function]}{where}, rank {rank}: {message}",
                         rank=rank, world_size=world_size)
                return
    g.record(check_id, True)
