"""Exercise 13: pipeline_step, a GPipe and a 1F1B schedule over point-to-point messages.

Rank side: build the same seeded model on every rank, cut into one stage per rank, and hand
rank r its stage wrapped in :class:`ObservedStage`, which records every forward and backward
the stage runs (and on which micro-batch) and how many micro-batches' saved activations are
alive at once. The count comes from ``torch.autograd.graph.saved_tensors_hooks`` installed
around the stage's own layers: each tensor autograd saves for a micro-batch is wrapped, and a
micro-batch counts as alive while any of its wrappers is still held by the graph. Backward
frees them, so the count is what the schedule really keeps in memory, however the code
names or stores things. Each step runs under ``probes.watch_collectives``, which records
every send and receive with its peer and size.

Grader side: build the same model in one process, run the whole batch through it, and
compare every stage's gradients and the loss; count the messages on each link; read the
schedule each rank ran from its stage's records and decide the schedule checks. The
schedules are also placed in unit time slots (each forward and backward takes one slot and
waits for its neighbour's) and shown in the report as a timeline, with the idle share.

The report's sections hold, per schedule, ``data = {"schedule", "runs": [{"world_size",
"num_microbatches", "order": [[label, ...] per rank], "slots": [[slot, ...] per rank],
"span", "idle", "peak_live": [per rank]}]}``: labels are "F3" (forward of micro-batch 3) and
"B3" (its backward), in the order the rank ran them.
"""

from __future__ import annotations

from collections import Counter

from grader import timeline
from grader.rank import probes
from grader.checks.interface import Grader
from grader.catalog import CLAIM
from grader.compare import first_difference
from grader.results import NOT_IMPLEMENTED
from grader.checks.shared import timelines
from grader.rank.drivers.ex13_pipeline import (WIDTHS, activation_bytes, build_stages, cases_for, loss_fn, make_batch,
                                               pipeline_main)


SCHEDULES = ("gpipe", "1f1b")
HEADER_LIMIT = 256  # bytes: a message this small is a shape header, not an activation (both sizes below differ a lot)
RTOL, ATOL = 1e-4, 1e-6  # float32; micro-batches add the gradient up in another order than the whole batch
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
# What the kernel counts between two ranks that exchange no message: opening and closing their connection (at
# most 9 bytes measured); a single message of gloo's carries 96 bytes of header (docs/guarantees.md).
FAR_LINK_BYTES = 64
GLOO_HEADER_BYTES = 96
SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")


def grade(g: Grader) -> None:
    sizes = list(g.world_sizes)
    counted_any = False
    for schedule in SCHEDULES:
        runs = []
        for world_size in sizes:
            cases = cases_for(schedule, world_size)
            try:
                # From 3 ranks on some pairs of ranks are not neighbours: the kernel counts what they sent.
                outcome = g.run(pipeline_main, world_size, kwargs={"cases": cases}, traffic=world_size >= 3)
                timelines.keep(g, outcome, f"{schedule}, world size {world_size}", shown=world_size == sizes[-1])
            except g.Stopped as stop:
                if schedule == "gpipe" and stop.problem.kind == NOT_IMPLEMENTED:
                    raise  # the stub: "not implemented yet" says it all
                raise g.with_context(stop, f"schedule={schedule!r}, world size {world_size}") from None
            steps = [obs["steps"] for obs in outcome.results()]
            check_run(g, cases, steps, world_size)
            if outcome.traffic is not None:
                check_far_traffic(g, outcome.traffic, world_size, schedule)
                counted_any = True
            runs.append(timeline_data(cases[0], [s[0] for s in steps], world_size))
        g.section(f"the {schedule} schedule as each rank ran it", timeline_text(runs[-1]),
                  {"schedule": schedule, "runs": runs, timeline.SLOT_KEY: slot_view(runs[-1])})
    if max(sizes) < 2:
        for check_id in ("neighbours-only", "messages-per-link"):
            g.skip(check_id, "a pipeline of one stage sends nothing (use --world-size 2 or more)")
    elif not counted_any:  # two ranks are each other's only neighbours, or NCCL: the calls the ranks recorded
        g.record("neighbours-only", True, evidence=CLAIM)


def check_run(g, cases: list[dict], steps: list[list[dict]], world_size: int) -> None:
    """Every check on one run: ``steps[rank][i]`` is what rank saw in case i."""
    for i, case in enumerate(cases):
        per_rank = [s[i] for s in steps]
        check_gradients(g, case, per_rank, world_size)
        check_loss(g, case, per_rank, world_size)
        check_micro_batches(g, case, per_rank, world_size)
        if world_size >= 2:
            check_neighbours(g, case, per_rank, world_size)
            check_messages(g, case, per_rank, world_size)
        if case["measure"] and case["schedule"] == "gpipe":
            check_gpipe(g, case, per_rank, world_size)
        if case["measure"] and case["schedule"] == "1f1b":
            check_1f1b_memory(g, case, per_rank, world_size)
            check_1f1b_bubble(g, case, per_rank, world_size)


def describe(case: dict, world_size: int) -> str:
    return (f"world size {world_size}, schedule {case['schedule']!r}, {case['num_microbatches']} micro-batches "
            f"of {case['rows']} rows")


def reference(case: dict, world_size: int) -> tuple[list[dict], float]:
    """Each stage's gradients and the loss, for the whole batch through the whole model in one process."""
    stages = build_stages(world_size)
    batch, target = make_batch(case)
    out = batch
    for stage in stages:
        out = stage(out)
    loss = loss_fn(out, target)
    loss.backward()
    grads = [{name: p.grad.detach().clone() for name, p in stage.named_parameters()} for stage in stages]
    return grads, loss.item()


def check_gradients(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    expected, _ = reference(case, world_size)
    m = case["num_microbatches"]
    # From the last stage back, as the gradients flow: the first stage that differs shows where it goes wrong.
    for rank in reversed(range(world_size)):
        step = per_rank[rank]
        missing = [name for name, grad in step["grads"].items() if grad is None]
        if missing:
            g.record("grads-match", False,
                     f"{describe(case, world_size)}: rank {rank}'s stage has no gradient for {missing[0]!r} "
                     f"(.grad is None) after pipeline_step", rank=rank, world_size=world_size)
            return
        found = first_difference(step["grads"], expected[rank], rtol=RTOL, atol=ATOL)
        if found is None:
            continue
        message = (f"{describe(case, world_size)}: on rank {rank}, stage {rank}'s gradient {found} from the "
                   f"single-process model's on the whole batch")
        if rank < world_size - 1:
            message += (f"; the stages after it match, so the gradient rank {rank} received from rank {rank + 1} "
                        "went into the wrong place (another micro-batch's output?)")
        if found.reason == "values":
            got, want = step["grads"][found.name].double(), expected[rank][found.name].double()
            scale = float((got * want).sum() / (want * want).sum()) if float((want * want).sum()) > 0 else 0.0
            if abs(scale - m) < 0.01 * m and m > 1:
                message += (f"; it is {m} times too large: each micro-batch's loss must be divided by "
                            "num_microbatches before its backward")
            elif abs(scale - 1 / m) < 0.01 / m and m > 1:
                message += f"; it is {m} times too small: the loss was divided by num_microbatches twice"
        g.record("grads-match", False, message, rank=rank, world_size=world_size)
        return
    g.record("grads-match", True)


def check_loss(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    _, expected = reference(case, world_size)
    last = world_size - 1
    for rank, step in enumerate(per_rank):
        returned = step["returned"]
        if rank != last:
            if returned["type"] != "NoneType":
                value = "" if returned["value"] is None else f" ({returned['value']:.6g})"
                g.record("loss-returned", False,
                         f"{describe(case, world_size)}: rank {rank} returned a {returned['type']}{value}; only the "
                         f"last rank ({last}) has the loss: the others return None", rank=rank, world_size=world_size)
                return
            continue
        if returned["type"] not in ("float", "float64"):
            g.record("loss-returned", False,
                     f"{describe(case, world_size)}: the last rank ({rank}) returned a {returned['type']}, not a "
                     "float: return the mean of the micro-batch losses as a Python float (loss.item())",
                     rank=rank, world_size=world_size)
            return
        got = returned["value"]
        if abs(got - expected) > LOSS_ATOL + LOSS_RTOL * abs(expected):
            m = case["num_microbatches"]
            message = (f"{describe(case, world_size)}: the last rank ({rank}) returned {got:.6g}; the mean loss over "
                       f"the whole batch is {expected:.6g}")
            if abs(got - m * expected) <= 1e-4 * abs(m * expected):
                message += f" ({m} times less: the sum of the micro-batch losses was returned, not their mean)"
            g.record("loss-returned", False, message, rank=rank, world_size=world_size)
            return
    g.record("loss-returned", True)


def _labels(step: dict) -> list[str]:
    return [f"{e['op']}{e['mb']}" for e in step["observed"]]


def _sequence(step: dict, limit: int = 24) -> str:
    labels = _labels(step)
    return " ".join(labels[:limit]) + (" ..." if len(labels) > limit else "") if labels else "nothing"


def check_micro_batches(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m, rows = case["num_microbatches"], case["rows"]
    for rank, step in enumerate(per_rank):
        forwards = [e for e in step["observed"] if e["op"] == "F"]
        backwards = [e for e in step["observed"] if e["op"] == "B"]
        sizes = sorted({e["rows"] for e in forwards})
        problem = None
        if len(forwards) != m or sizes != [rows]:
            shown = ", ".join(str(s) for s in sizes) or "-"
            problem = (f"rank {rank} ran its stage forward {len(forwards)} time(s), on {shown} row(s); a step of {m} "
                       f"micro-batches runs it once per micro-batch, on {rows} rows each")
        elif sorted(e["mb"] for e in backwards) != list(range(m)):
            problem = (f"rank {rank} ran the backward of {len(backwards)} micro-batch(es) through its stage, of the "
                       f"{m} it ran forward; each forward needs its own backward")
        if problem:
            g.record("micro-batches", False, f"{describe(case, world_size)}: {problem} (rank {rank} ran: "
                     f"{_sequence(step)})", rank=rank, world_size=world_size)
            return
    g.record("micro-batches", True)


def check_neighbours(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    """neighbours-only from the calls each rank recorded: a collective, or a peer two stages away or more, fails
    it by name (a claim, believed when it fails). What passes it is what the kernel counted (check_far_traffic)."""
    for rank, step in enumerate(per_rank):
        neighbours = {r for r in (rank - 1, rank + 1) if 0 <= r < world_size}
        for e in step["events"]:
            if e["op"] in probes.COLLECTIVES:
                g.record("neighbours-only", False,
                         f"{describe(case, world_size)}: rank {rank} called dist.{e['op']}, a collective that every "
                         "rank joins; in a pipeline a rank talks only to the ranks before and after it, by send "
                         "and recv", rank=rank, world_size=world_size, evidence=CLAIM)
                return
            if e["op"] not in SEND_OPS + RECV_OPS or (e["op"] in RECV_OPS and e["peer"] is None):
                continue  # a receive from any source: its sender is checked
            if e["peer"] not in neighbours:
                direction = "sent to" if e["op"] in SEND_OPS else "received from"
                g.record("neighbours-only", False,
                         f"{describe(case, world_size)}: rank {rank} {direction} rank {e['peer']} (dist.{e['op']}, "
                         f"{e['bytes']} bytes); rank {rank} talks only to ranks {sorted(neighbours)}",
                         rank=rank, world_size=world_size, evidence=CLAIM)
                return


def check_far_traffic(g, counted, world_size: int, schedule: str) -> None:
    """neighbours-only on what the kernel counted (``counted``, a grader.traffic.RunTraffic) over a whole run:
    between two ranks that are not neighbours (two stages apart or more) no message at all. Every message gloo
    sends carries 96 bytes of header; opening and closing a connection leaves a few bytes (at most 9 here)."""
    if counted.uncounted():
        rank = counted.uncounted()[0]
        g.record("neighbours-only", False, f"schedule {schedule!r}, world size {world_size}: rank {rank}'s "
                 "connections were never counted: its process did not let the grader read its sockets (it asks as "
                 "its process group is made and destroyed, and as the run ends)", rank=rank, world_size=world_size)
        return
    for i in range(world_size):
        for j in range(world_size):
            if abs(i - j) >= 2 and counted.to(i, j) > FAR_LINK_BYTES:
                g.record("neighbours-only", False,
                         f"schedule {schedule!r}, world size {world_size}: rank {i} sent rank {j} {counted.to(i, j):,} "
                         f"bytes (the kernel's count); in a pipeline rank {i} talks only to ranks "
                         f"{sorted(r for r in (i - 1, i + 1) if 0 <= r < world_size)}, and two ranks that are not "
                         f"neighbours exchange no message (each carries {GLOO_HEADER_BYTES} bytes of header at least)",
                         rank=i, world_size=world_size)
                return
    g.record("neighbours-only", True)


def _sizes(counts: Counter) -> str:
    return ", ".join(f"{n} x {b} bytes" for b, n in sorted(counts.items(), key=lambda item: -item[0])) or "nothing"


def check_messages(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    for rank, step in enumerate(per_rank):
        sent: dict[int, Counter] = {}
        for e in step["events"]:
            if e["op"] in SEND_OPS:
                sent.setdefault(e["peer"], Counter())[e["bytes"]] += 1
        for peer, link, what in ((rank + 1, rank, "activations"), (rank - 1, rank - 1, "gradients of activations")):
            if not 0 <= peer < world_size:
                continue
            size = activation_bytes(case, link)
            counts = sent.get(peer, Counter())
            other = {b: n for b, n in counts.items() if b != size}
            if counts[size] == m and all(b <= HEADER_LIMIT for b in other):
                continue
            g.record("messages-per-link", False,
                     f"{describe(case, world_size)}: rank {rank} sent rank {peer} {_sizes(counts)}; one step sends "
                     f"{m} {what} of {case['rows']} x {WIDTHS[link + 1]} float32 = {size} bytes each (one "
                     f"message per micro-batch), besides shape headers of at most {HEADER_LIMIT} bytes",
                     rank=rank, world_size=world_size)
            return
    g.record("messages-per-link", True)


def check_gpipe(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    for rank, step in enumerate(per_rank):
        if step["peak_live"] != m:
            g.record("gpipe-fill-drain", False,
                     f"{describe(case, world_size)}: rank {rank} held the saved activations of at most "
                     f"{step['peak_live']} micro-batch(es) at once, not all {m}; GPipe runs every forward before "
                     f"the first backward (rank {rank} ran: {_sequence(step)})", rank=rank, world_size=world_size)
            return
    g.record("gpipe-fill-drain", True)


def check_1f1b_memory(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    for rank, step in enumerate(per_rank):
        if step["peak_live"] > world_size:
            g.record("1f1b-memory", False,
                     f"{describe(case, world_size)}: rank {rank} held the saved activations of "
                     f"{step['peak_live']} micro-batches at once; 1F1B starts a backward after at most "
                     f"{world_size - rank} forwards on rank {rank}, so that no rank holds more than W = {world_size} "
                     f"(rank {rank} ran: {_sequence(step)})", rank=rank, world_size=world_size)
            return
    g.record("1f1b-memory", True)


def check_1f1b_bubble(g, case: dict, per_rank: list[dict], world_size: int) -> None:
    m = case["num_microbatches"]
    orders = [_labels(step) for step in per_rank]
    slots = unit_slots(orders)
    if slots is None:
        g.record("1f1b-bubble", False, f"{describe(case, world_size)}: the forwards and backwards the ranks ran do "
                 "not fit together (a micro-batch's forward or backward is missing on some rank): "
                 + "; ".join(f"rank {r}: {_sequence(s)}" for r, s in enumerate(per_rank)), world_size=world_size)
        return
    span = 1 + max((s for row in slots for s in row), default=-1)
    textbook = 2 * (m + world_size - 1)
    if span > textbook:
        g.record("1f1b-bubble", False,
                 f"{describe(case, world_size)}: in unit time (a forward or backward takes one slot and waits for "
                 f"its neighbour's) the order the ranks ran takes {span} slots; 1F1B keeps the pipeline as full as "
                 f"GPipe, 2 * (M + W - 1) = {textbook} slots: a rank waited for a backward where it could have run "
                 f"a forward. " + "; ".join(f"rank {r}: {_sequence(s)}" for r, s in enumerate(per_rank)),
                 world_size=world_size)
        return
    g.record("1f1b-bubble", True)


def unit_slots(orders: list[list[str]]) -> list[list[int]] | None:
    """Each rank's events placed in unit time: an event starts one slot after the rank's previous one
    and after what it waits for (F k after F k on the rank before, B k after B k on the rank after;
    on the last rank B k after its own F k). None when some event waits for one that never ran."""
    world_size = len(orders)
    where: list[dict[str, int]] = [{} for _ in orders]
    slots: list[list[int]] = [[] for _ in orders]
    progress = True
    while progress:
        progress = False
        for rank, order in enumerate(orders):
            while len(slots[rank]) < len(order):
                label = order[len(slots[rank])]
                op, k = label[0], label[1:]
                if op == "F":
                    dep = (rank - 1, f"F{k}") if rank > 0 else None
                elif rank < world_size - 1:
                    dep = (rank + 1, f"B{k}")
                else:
                    dep = (rank, f"F{k}")
                earliest = slots[rank][-1] + 1 if slots[rank] else 0
                if dep is not None:
                    if dep[1] not in where[dep[0]]:
                        break
                    earliest = max(earliest, where[dep[0]][dep[1]] + 1)
                slots[rank].append(earliest)
                where[rank].setdefault(label, earliest)
                progress = True
    if any(len(s) != len(o) for s, o in zip(slots, orders)):
        return None
    return slots


def timeline_data(case: dict, per_rank: list[dict], world_size: int) -> dict:
    orders = [_labels(step) for step in per_rank]
    slots = unit_slots(orders)
    span = 1 + max((s for row in slots or [] for s in row), default=-1)
    busy = sum(len(o) for o in orders)
    return {"world_size": world_size, "num_microbatches": case["num_microbatches"], "order": orders,
            "slots": slots, "span": span, "idle": round(1 - busy / (span * world_size), 4) if span > 0 else 0.0,
            "peak_live": [step["peak_live"] for step in per_rank]}


def slot_view(run: dict) -> dict:
    """The slot rows of :func:`timeline_text` for the page (grader.timeline.slot_view)."""
    return timeline.slot_view(run["order"], run["slots"], notes=[_peak(p) for p in run["peak_live"]],
                              caption=f"world size {run['world_size']}, {run['num_microbatches']} micro-batches, "
                                      "in unit time slots")


def _peak(peak: int) -> str:
    return "peak: 1 micro-batch's activations" if peak == 1 else f"peak: {peak} micro-batches' activations"


def timeline_text(run: dict) -> str:
    w, m = run["world_size"], run["num_microbatches"]
    lines = [f"world size {w}, {m} micro-batches; Fi is micro-batch i's forward, Bi its backward; each takes one "
             "time slot and waits for its neighbour's:"]
    orders, slots = run["order"], run["slots"]
    if slots is None:
        lines += [f"  rank {r}  {' '.join(order)}" for r, order in enumerate(orders)]
        lines.append("(the ranks' forwards and backwards do not fit together; shown as run)")
        return "\n".join(lines)
    width = max((len(label) for order in orders for label in order), default=2) + 1
    for rank, (order, places) in enumerate(zip(orders, slots)):
        row = ["." for _ in range(run["span"])]
        for label, slot in zip(order, places):
            row[slot] = label
        cells = "".join(cell.ljust(width) for cell in row).rstrip()
        lines.append(f"  rank {rank}  {cells}   ({_peak(run['peak_live'][rank])})")
    textbook = (w - 1) / (m + w - 1)
    lines.append(f"idle: {run['idle']:.0%} of the {run['span']} slots x {w} ranks; the textbook bubble of GPipe and "
                 f"1F1B is (W - 1) / (M + W - 1) = {w - 1}/{m + w - 1} = {textbook:.0%}")
    return "\n".join(lines)
