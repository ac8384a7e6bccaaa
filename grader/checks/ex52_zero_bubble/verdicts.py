"""Exercise 52's verdicts, pure functions of the ranks' records: the gradients and the loss against the whole model
in one process, the passes and messages each rank ran, their order against ZB-H1's, the idle slots that order
leaves in unit time, and the saved activations held at once.

The unit-time model (:func:`unit_slots`): each pass (F, B or W) takes one slot; a send happens at the end of the
pass before it; F k on rank r waits for rank r - 1's send of micro-batch k's activation, B k for rank r + 1's send
of its gradient (on the last rank, for its own F k). It is laid over the order each rank recorded, sends included,
so a gradient sent late (after a W, or batched with the next round's messages) costs what it would cost.
"""

from __future__ import annotations

from collections import Counter

import torch

from grader.checks.ex52_zero_bubble.reference import activation_bytes, expected_runs, zb_h1_order
from grader.compare import first_difference
from grader.rank import probes

# Float64: the pipeline adds the micro-batches' gradients up in another order than the whole batch's backward
# does (and W may multiply in another layout), nothing more; a wrong micro-batch, scale or missing W is off by
# far more.
RTOL, ATOL = 1e-10, 1e-12
LOSS_RTOL, LOSS_ATOL = 1e-10, 1e-12
HEADER_LIMIT = 256  # bytes: a message this small is a shape header, not an activation
SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")
PASSES = ("F", "B", "W")


# --- reading a rank's record -----------------------------------------------------------------------------------


class Unreadable(Exception):
    """A rank's record is not what its driver writes: the submission changed it."""


def read_steps(result, cases: int) -> list[dict]:
    """One rank's record, each field checked: ``[{"returned", "grads", "events", "peak_live"}]`` per case."""
    steps = result.get("steps") if isinstance(result, dict) else None
    if not isinstance(steps, list) or len(steps) != cases:
        raise Unreadable(f"its record holds {type(steps).__name__ if not isinstance(steps, list) else len(steps)} "
                         f"steps, not {cases}")
    return [_read_step(step) for step in steps]


def _read_step(step) -> dict:
    if not isinstance(step, dict):
        raise Unreadable("a step's record is not a dict")
    returned = step.get("returned")
    if not isinstance(returned, dict) or not isinstance(returned.get("type"), str):
        raise Unreadable("a step's returned value is not recorded")
    value = returned.get("value")
    grads = step.get("grads")
    if not isinstance(grads, dict) or not all(isinstance(k, str) for k in grads):
        raise Unreadable("a step's gradients are not recorded")
    events = step.get("events")
    peak = step.get("peak_live")
    if not isinstance(events, list) or not isinstance(peak, int):
        raise Unreadable("a step's events are not recorded")
    return {"returned": {"type": returned["type"], "value": value if isinstance(value, float) else None},
            "grads": {k: v if isinstance(v, torch.Tensor) else None for k, v in grads.items()},
            "events": [e for e in (_read_event(e) for e in events) if e is not None], "peak_live": peak}


def _read_event(event) -> dict | None:
    if not isinstance(event, dict) or not isinstance(event.get("op"), str):
        return None
    op = event["op"]
    if op in PASSES:
        mb, rows = event.get("mb"), event.get("rows", 0)
        if not isinstance(mb, int) or not isinstance(rows, int):
            return None
        return {"op": op, "mb": mb, "rows": rows}
    peer, size = event.get("peer"), event.get("bytes")
    return {"op": op, "peer": peer if isinstance(peer, int) else None, "bytes": size if isinstance(size, int) else 0}


# --- what a rank ran -----------------------------------------------------------------------------------------------


def labels(step: dict) -> list[str]:
    """The passes a rank ran, in order: "F3", "B3", "W3"."""
    return [f"{e['op']}{e['mb']}" for e in step["events"] if e["op"] in PASSES]


def tokens(step: dict, rank: int, world_size: int, case: dict) -> list[str]:
    """The passes and the sends that carry micro-batches, in order: ">F3" is the activation of micro-batch 3 sent
    to rank + 1, "<B3" its input's gradient sent to rank - 1 (the j-th gradient sent carries the micro-batch of
    the j-th B, the j-th activation micro-batch j)."""
    down = activation_bytes(case, rank) if rank < world_size - 1 else None
    up = activation_bytes(case, rank - 1) if rank > 0 else None
    backwards = [e["mb"] for e in step["events"] if e["op"] == "B"]
    out, activations, gradients = [], 0, 0
    for e in step["events"]:
        if e["op"] in PASSES:
            out.append(f"{e['op']}{e['mb']}")
        elif e["op"] in SEND_OPS and e["peer"] == rank + 1 and e["bytes"] == down:
            out.append(f">F{activations}")
            activations += 1
        elif e["op"] in SEND_OPS and e["peer"] == rank - 1 and e["bytes"] == up:
            out.append(f"<B{backwards[gradients] if gradients < len(backwards) else gradients}")
            gradients += 1
    return out


def _sequence(items: list[str], limit: int = 30) -> str:
    return " ".join(items[:limit]) + (" ..." if len(items) > limit else "") if items else "nothing"


def describe(case: dict, world_size: int) -> str:
    return f"world size {world_size}, {case['num_microbatches']} micro-batches of {case['rows']} rows"


# --- the unit-time model -------------------------------------------------------------------------------------------


def unit_slots(sequences: list[list[str]]) -> list[list[int]] | None:
    """Each rank's passes placed in unit time (see the module's docstring): the slot each pass starts in, in the
    rank's order. None when some pass waits for a message or pass that never came."""
    world_size = len(sequences)
    sent: list[dict[str, int]] = [{} for _ in sequences]  # ">F3" -> the slot from which its receiver may use it
    ended: list[dict[str, int]] = [{} for _ in sequences]  # "F3" -> the slot after it
    position, free = [0] * world_size, [0] * world_size
    slots: list[list[int]] = [[] for _ in sequences]
    progress = True
    while progress:
        progress = False
        for rank, sequence in enumerate(sequences):
            while position[rank] < len(sequence):
                token = sequence[position[rank]]
                if token[0] in "<>":
                    sent[rank].setdefault(token, free[rank])
                else:
                    op, k = token[0], token[1:]
                    if op == "F" and rank > 0:
                        ready = sent[rank - 1].get(">F" + k)
                    elif op == "B" and rank < world_size - 1:
                        ready = sent[rank + 1].get("<B" + k)
                    elif op == "B":
                        ready = ended[rank].get("F" + k)
                    else:
                        ready = 0
                    if ready is None:
                        break
                    start = max(free[rank], ready)
                    slots[rank].append(start)
                    ended[rank].setdefault(token, start + 1)
                    free[rank] = start + 1
                position[rank] += 1
                progress = True
    if any(p < len(s) for p, s in zip(position, sequences)):
        return None
    return slots


def idle_slots(sequences: list[list[str]]) -> tuple[int, int] | None:
    """(idle slots over every rank, span) of ``sequences`` in unit time; None when they do not fit together."""
    slots = unit_slots(sequences)
    if slots is None:
        return None
    span = 1 + max((s for row in slots for s in row), default=-1)
    busy = sum(len(row) for row in slots)
    return span * len(sequences) - busy, span


# --- verdicts ------------------------------------------------------------------------------------------------------


def check_gradients(g, case: dict, per_rank: list[dict], expected: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    # From the last stage back, as the gradients flow: the first stage that differs shows where it goes wrong.
    for rank in reversed(range(world_size)):
        grads = per_rank[rank]["grads"]
        missing = [name for name in expected[rank] if grads.get(name) is None]
        if missing:
            g.record("grads-match", False,
                     f"{describe(case, world_size)}: rank {rank}'s stage has no gradient for {missing[0]!r} (.grad is "
                     "None) after zero_bubble_step: its W passes did not run, or wrote nowhere",
                     rank=rank, world_size=world_size)
            return
        found = first_difference(grads, expected[rank], rtol=RTOL, atol=ATOL)
        if found is None:
            continue
        message = (f"{describe(case, world_size)}: on rank {rank}, stage {rank}'s gradient {found} from the "
                   "single-process model's on the whole batch (float64)")
        if rank < world_size - 1:
            message += (f"; the stages after it match, so the gradient rank {rank} received from rank {rank + 1} "
                        "went into the wrong place (another micro-batch's output?)")
        if found.reason == "values":
            got, want = grads[found.name].double(), expected[rank][found.name].double()
            norm = float((want * want).sum())
            scale = float((got * want).sum()) / norm if norm > 0 else 0.0
            if m > 1 and abs(scale - m) < 0.01 * m:
                message += (f"; it is {m} times too large: each micro-batch's loss must be divided by "
                            "num_microbatches before its backward")
            elif m > 1 and abs(scale - 1 / m) < 0.01 / m:
                message += f"; it is {m} times too small: the loss was divided by num_microbatches twice"
            elif abs(scale - 2) < 0.02:
                message += "; it is twice the gradient: each micro-batch's weights' gradient was added twice (B and W)"
            elif 0.05 < scale < 0.99:
                message += ("; it is part of the gradient: some micro-batch's W never ran (the W's still waiting "
                            "when the last backward ends must run before returning)")
        g.record("grads-match", False, message, rank=rank, world_size=world_size)
        return
    g.record("grads-match", True)


def check_loss(g, case: dict, per_rank: list[dict], expected: float, world_size: int) -> None:
    last = world_size - 1
    for rank, step in enumerate(per_rank):
        returned = step["returned"]
        if rank != last:
            if returned["type"] != "NoneType":
                g.record("loss-returned", False,
                         f"{describe(case, world_size)}: rank {rank} returned a {returned['type']}; only the last rank "
                         f"({last}) has the loss: the others return None", rank=rank, world_size=world_size)
                return
            continue
        if returned["type"] != "float" or returned["value"] is None:
            g.record("loss-returned", False,
                     f"{describe(case, world_size)}: the last rank ({rank}) returned a {returned['type']}, not a float: "
                     "return the mean of the micro-batch losses as a Python float (loss.item())",
                     rank=rank, world_size=world_size)
            return
        got = returned["value"]
        if abs(got - expected) > LOSS_ATOL + LOSS_RTOL * abs(expected):
            m = case["num_microbatches"]
            message = (f"{describe(case, world_size)}: the last rank ({rank}) returned {got:.10g}; the mean loss over "
                       f"the whole batch is {expected:.10g}")
            if abs(got - m * expected) <= 1e-6 * abs(m * expected):
                message += f" ({m} times less: the sum of the micro-batch losses was returned, not their mean)"
            g.record("loss-returned", False, message, rank=rank, world_size=world_size)
            return
    g.record("loss-returned", True)


def check_micro_batches(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m, rows = case["num_microbatches"], case["rows"]
    for rank, step in enumerate(per_rank):
        ran = [e for e in step["events"] if e["op"] in PASSES]
        forwards = [e for e in ran if e["op"] == "F"]
        sizes = sorted({e["rows"] for e in forwards})
        backwards = Counter(e["mb"] for e in ran if e["op"] == "B")
        weights = Counter(e["mb"] for e in ran if e["op"] == "W")
        problem = None
        if len(forwards) != m or sizes != [rows]:
            shown = ", ".join(str(s) for s in sizes) or "-"
            problem = (f"rank {rank} ran its stage forward {len(forwards)} time(s), on {shown} row(s); a step of {m} "
                       f"micro-batches runs it once per micro-batch, on {rows} rows each")
        elif sorted(backwards) != list(range(m)):
            problem = (f"the backward of {len(backwards)} of the {m} micro-batches entered rank {rank}'s stage; "
                       "each forward needs its backward")
        elif sorted(weights) != list(range(m)) or max(weights.values()) > 1:
            absent = [k for k in range(m) if k not in weights]
            twice = [k for k, n in sorted(weights.items()) if n > 1]
            problem = (f"rank {rank} produced the weights' gradients of {len(weights)} of the {m} micro-batches"
                       + (f" (none for {absent[:6]}: a W still waiting when the step returned?)" if absent else "")
                       + (f" (more than once for {twice[:6]})" if twice else "")
                       + "; each micro-batch needs exactly one W")
        if problem:
            g.record("micro-batches", False, f"{describe(case, world_size)}: {problem} (rank {rank} ran: "
                     f"{_sequence(labels(step))})", rank=rank, world_size=world_size)
            return
    g.record("micro-batches", True)


def _sizes(counts: Counter) -> str:
    return ", ".join(f"{n} x {b} bytes" for b, n in sorted(counts.items(), key=lambda item: -item[0])) or "nothing"


def check_messages(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    for rank, step in enumerate(per_rank):
        neighbours = {r for r in (rank - 1, rank + 1) if 0 <= r < world_size}
        sent: dict[int, Counter] = {}
        for e in step["events"]:
            if e["op"] in probes.COLLECTIVES:
                g.record("neighbour-messages", False,
                         f"{describe(case, world_size)}: rank {rank} called dist.{e['op']}, a collective that every "
                         "rank joins; in a pipeline a rank talks only to the ranks before and after it, by send and "
                         "recv", rank=rank, world_size=world_size)
                return
            if e["op"] not in SEND_OPS + RECV_OPS or (e["op"] in RECV_OPS and e["peer"] is None):
                continue  # a receive from any source: its sender is checked
            if e["peer"] not in neighbours:
                direction = "sent to" if e["op"] in SEND_OPS else "received from"
                g.record("neighbour-messages", False,
                         f"{describe(case, world_size)}: rank {rank} {direction} rank {e['peer']} (dist.{e['op']}, "
                         f"{e['bytes']} bytes); rank {rank} talks only to ranks {sorted(neighbours)}",
                         rank=rank, world_size=world_size)
                return
            if e["op"] in SEND_OPS:
                sent.setdefault(e["peer"], Counter())[e["bytes"]] += 1
        for peer, link, what in ((rank + 1, rank, "activations"), (rank - 1, rank - 1, "gradients of activations")):
            if not 0 <= peer < world_size:
                continue
            size = activation_bytes(case, link)
            counts = sent.get(peer, Counter())
            if counts[size] == m and all(b <= HEADER_LIMIT for b in counts if b != size):
                continue
            g.record("neighbour-messages", False,
                     f"{describe(case, world_size)}: rank {rank} sent rank {peer} {_sizes(counts)}; one step sends {m} "
                     f"{what} of {case['rows']} rows x {size // (8 * case['rows'])} float64 = {size} bytes each (one "
                     f"message per micro-batch), besides shape headers of at most {HEADER_LIMIT} bytes",
                     rank=rank, world_size=world_size)
            return
    g.record("neighbour-messages", True)


def check_order(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    for rank, step in enumerate(per_rank):
        ran, expected = labels(step), zb_h1_order(rank, world_size, m)
        if ran == expected:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ran, expected)) if a != b), min(len(ran), len(expected)))
        message = (f"{describe(case, world_size)}: rank {rank} ran {_sequence(ran)}; ZB-H1 runs {_sequence(expected)}"
                   f" (pass {at + 1} differs)")
        why = _why_order_differs(ran, rank, world_size, m)
        g.record("zb-h1-order", False, message + (f": {why}" if why else ""), rank=rank, world_size=world_size)
        return
    g.record("zb-h1-order", True)


def _why_order_differs(ran: list[str], rank: int, world_size: int, m: int) -> str:
    weights = [int(x[1:]) for x in ran if x[0] == "W"]
    backwards = [x for x in ran if x[0] == "B"]
    if not weights:
        return ""
    if all(i + 1 < len(ran) and ran[i + 1] == "W" + x[1:] for i, x in enumerate(ran) if x[0] == "B"):
        deferred = f"the W of rank {rank}'s first round" if rank == 1 else f"the W's of rank {rank}'s first {rank} rounds"
        return (f"every W right after its own B, as 1F1B's one backward; ZB-H1 leaves {deferred} for the end, where "
                "the rank would otherwise wait" if rank else "every W right after its own B")
    last_b = max(i for i, x in enumerate(ran) if x[0] == "B") if backwards else -1
    if all(i > last_b for i, x in enumerate(ran) if x[0] == "W"):
        return ("every W after the last B (past the flush): the graphs of all micro-batches stay alive to the end; "
                "ZB-H1 runs one W per round once its first rounds are done")
    if weights != sorted(weights):
        return "the W's ran newest first; ZB-H1 runs the oldest W still waiting"
    return ""


def check_memory(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    for rank, step in enumerate(per_rank):
        if step["peak_live"] > world_size:
            g.record("zb-memory", False,
                     f"{describe(case, world_size)}: rank {rank} held the saved activations of {step['peak_live']} "
                     f"micro-batches at once; 1F1B holds at most W = {world_size} (on its rank 0) and so does ZB-H1, a "
                     "micro-batch's graph freed by its W (not retained: the W's backward without retain_graph, "
                     f"nothing of it kept to the end) (rank {rank} ran: {_sequence(labels(step))})",
                     rank=rank, world_size=world_size)
            return
    g.record("zb-memory", True)


def check_bubble(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    sequences = [tokens(step, rank, world_size, case) for rank, step in enumerate(per_rank)]
    baseline = idle_slots(expected_runs(world_size, m)["1f1b"])[0]
    measured = idle_slots(sequences)
    if measured is None:
        g.record("bubble", False, f"{describe(case, world_size)}: the passes and messages the ranks recorded do not "
                 "fit together (a pass waits for a message that was never sent): " + "; ".join(
                     f"rank {r}: {_sequence(s)}" for r, s in enumerate(sequences)), world_size=world_size)
        return
    idle, span = measured
    if 3 * idle <= baseline:
        g.record("bubble", True)
        return
    late = _late_send(sequences, world_size)
    g.record("bubble", False,
             f"{describe(case, world_size)}: in unit time (F, B and W one slot each, each waiting for its neighbour's "
             f"message, sent where each rank sent it) the ranks' order leaves {idle} idle slots over {span} slots x "
             f"{world_size} ranks; 1F1B leaves {baseline} for the same W and M, ZB-H1 a third of that, "
             f"{baseline // 3}" + (f": {late}" if late else ""), world_size=world_size)


def _late_send(sequences: list[list[str]], world_size: int) -> str:
    """The first message sent later than right after the pass that made it, in words ("" when none is)."""
    for rank, sequence in enumerate(sequences):
        for i, token in enumerate(sequence):
            if token[0] == "F" and rank < world_size - 1:
                wanted, what = ">" + token, f"the activation of micro-batch {token[1:]}"
            elif token[0] == "B" and rank > 0:
                wanted, what = "<" + token, f"the gradient of micro-batch {token[1:]}'s input"
            else:
                continue
            following = sequence[i + 1:]
            if wanted not in following:
                return f"rank {rank} never sent {what}"
            gap = [t for t in following[:following.index(wanted)] if t[0] in PASSES]
            if gap:
                return (f"rank {rank} sent {what} only after {' '.join(gap[:4])}: its neighbour waited for it; send "
                        "each message as soon as the pass that makes it ends")
    return ""


# --- the schedule as a timeline ------------------------------------------------------------------------------------


def timeline_data(case: dict, per_rank: list[dict], world_size: int) -> dict:
    m = case["num_microbatches"]
    orders = [labels(step) for step in per_rank]
    sequences = [tokens(step, rank, world_size, case) for rank, step in enumerate(per_rank)]
    slots = unit_slots(sequences)
    measured = idle_slots(sequences)
    runs = expected_runs(world_size, m)
    return {"world_size": world_size, "num_microbatches": m, "order": orders, "slots": slots,
            "span": measured[1] if measured else 0, "idle": measured[0] if measured else None,
            "idle_1f1b": idle_slots(runs["1f1b"])[0], "idle_zb_h1": idle_slots(runs["zb-h1"])[0],
            "peak_live": [step["peak_live"] for step in per_rank]}


def timeline_text(run: dict) -> str:
    w, m = run["world_size"], run["num_microbatches"]
    lines = [f"world size {w}, {m} micro-batches; Fi is micro-batch i's forward, Bi the gradient of its input, Wi its "
             "weights' gradients; each takes one time slot and waits for its neighbour's message:"]
    orders, slots = run["order"], run["slots"]
    if slots is None:
        lines += [f"  rank {r}  {' '.join(order)}" for r, order in enumerate(orders)]
        lines.append("(the ranks' passes and messages do not fit together; shown as run)")
        return "\n".join(lines)
    width = max((len(label) for order in orders for label in order), default=2) + 1
    for rank, (order, places) in enumerate(zip(orders, slots)):
        row = ["." for _ in range(run["span"])]
        for label, slot in zip(order, places):
            row[slot] = label
        cells = "".join(cell.ljust(width) for cell in row).rstrip()
        peak = run["peak_live"][rank]
        held = "1 micro-batch's" if peak == 1 else f"{peak} micro-batches'"
        lines.append(f"  rank {rank}  {cells}   (peak: {held} activations)")
    lines.append(f"idle: {run['idle']} slots of {run['span']} x {w}; 1F1B leaves {run['idle_1f1b']} (3 (W - 1) per "
                 f"rank), ZB-H1 {run['idle_zb_h1']} (W - 1 per rank)")
    return "\n".join(lines)
