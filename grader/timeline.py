"""What each rank of a run did over time, as plain data: read from the ranks' records, checked here.

A rank records its own events (:mod:`grader.rank.rank_timeline`, on the machine's monotonic clock) and
returns them in its driver's result. Everything in them is the submission's to change, so this
module reads them as untrusted data: each event must be a dict of known fields, each of the right
type and size, its times finite, in order and inside the time the grader saw the run take; what
is not is left out and counted, never raised. The result is one *run*:

``{"version", "label", "world_size", "origin", "span", "shown", "draw", "ranks": [{"rank", "events",
"dropped", "problem"}]}``: ``origin`` the run's earliest time on the machine's monotonic clock (to lay
runs on one axis), ``span`` seconds from it to the last event's end, each event
``{"kind", "op", "t0", "t1", "label", "bytes", "peer", "async", "thread", "by", "open"}`` with ``t0``/``t1`` in
seconds from ``origin`` (fields that are empty are left out; ``by`` is "grader" for the grader's own calls,
``open`` marks a call still under way when the run stopped), ``shown`` whether the text report
draws the run without -v, ``draw`` the regions it draws (empty: all).

A check module adds a run to the report as a section (:mod:`grader.checks.shared.timelines`); the
renderers (:mod:`grader.timeline_view`) read it back with :func:`read_run`, which checks it again,
so that a report from anywhere (a file, another process) cannot make them fail. Verdicts never
come from here.
"""

from __future__ import annotations

import math

VERSION = 1
KINDS = ("forward", "backward", "step", "save", "collective", "send", "recv", "wait", "region")
PHASES = ("forward", "backward", "step", "save")
COMMUNICATION = ("collective", "send", "recv", "wait")
TRACKS = {"forward": "compute", "backward": "compute", "step": "compute", "save": "saves",
          "collective": "collectives", "send": "point-to-point", "recv": "point-to-point", "wait": "waits",
          "region": "regions"}
MAX_EVENTS = 3000  # per rank: the rest is counted as dropped
MAX_RANKS = 64
MAX_THREADS = 16
MAX_TEXT = 48  # characters of a label or an op
MAX_BYTES = 2**50
SLACK_S = 1.0  # a rank's clock reading may lie this far outside the grader's view of the run
KEY = "timeline"  # the key of a run in a section's data, and of the snapshot in a driver's result
GRADER = "grader"  # an event's "by": the grader's own call (grader.rank.rank_timeline.by_grader), not the learner's


def clean_name(value, limit: int = MAX_TEXT) -> str:
    """A short name a rank sent, made safe to show anywhere: printable ASCII only, at most ``limit`` characters
    (anything else becomes ``?``); "" for what is not text."""
    if not isinstance(value, str):
        return ""
    text = "".join(c if " " <= c <= "~" else "?" for c in value[:limit])
    return text.strip()


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _count(value, top: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < top:
        return None
    return value


def _event(raw, window: tuple[float, float] | None) -> dict | None:
    """One event as a rank sent it, checked; None when it cannot be shown."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("kind")
    if kind not in KINDS:
        return None
    t0, t1 = _number(raw.get("t0")), _number(raw.get("t1"))
    if t0 is None or t1 is None or t1 < t0:
        return None
    if window is not None and (t0 < window[0] or t1 > window[1]):
        return None
    op = clean_name(raw.get("op")) or kind
    event = {"kind": kind, "op": op, "t0": t0, "t1": t1}
    name = clean_name(raw.get("label"))
    if name:
        event["label"] = name
    size = _count(raw.get("bytes"), MAX_BYTES)
    if size is not None:
        event["bytes"] = size
    peer = _count(raw.get("peer"), 1 << 20)
    if peer is not None:
        event["peer"] = peer
    if raw.get("async") is True:
        event["async"] = True
    thread = _count(raw.get("thread"), MAX_THREADS)
    if thread:
        event["thread"] = thread
    if raw.get("by") == GRADER:
        event["by"] = GRADER
    if raw.get("open") is True:
        event["open"] = True
    return event


def from_ranks(records: list, *, label: str, world_size: int, window: tuple[float, float] | None = None,
               shown: bool = False, draw: tuple[str, ...] = ()) -> dict:
    """A run from each rank's snapshot (``records[rank]``: what its driver returned under ``"timeline"``,
    anything at all). ``window``: the earliest and latest times the grader saw the run take, on the same
    clock; events outside it (give or take SLACK_S) are left out."""
    if window is not None:
        window = (window[0] - SLACK_S, window[1] + SLACK_S)
    ranks = []
    for rank, record in enumerate(list(records)[:MAX_RANKS]):
        events, problem, dropped = [], "", 0
        if not isinstance(record, dict) or not isinstance(record.get("events"), list):
            problem = "no timeline came back from this rank"
        else:
            raw = record["events"]
            for item in raw[:MAX_EVENTS]:
                event = _event(item, window)
                if event is None:
                    dropped += 1
                else:
                    events.append(event)
            dropped += max(0, len(raw) - MAX_EVENTS) + (_count(record.get("dropped"), 1 << 40) or 0)
        ranks.append({"rank": rank, "events": events, "dropped": dropped, "problem": problem})
    times = [e["t0"] for r in ranks for e in r["events"]]
    origin = min(times) if times else 0.0
    for r in ranks:
        for e in r["events"]:
            e["t0"], e["t1"] = round(e["t0"] - origin, 6), round(e["t1"] - origin, 6)
        r["events"].sort(key=lambda e: (e["t0"], -e["t1"]))
    span = max((e["t1"] for r in ranks for e in r["events"]), default=0.0)
    return {"version": VERSION, "label": clean_name(label, 120), "world_size": int(world_size), "origin": origin,
            "span": span, "shown": bool(shown), "draw": [clean_name(d) for d in draw], "ranks": ranks}


def read_run(data) -> dict | None:
    """A run as a report holds it (a section's ``data["timeline"]``), checked again; None when it is not one.
    Never raises."""
    try:
        return _read_run(data)
    except Exception:  # anything at all: a renderer must not fail on a report
        return None


def _read_run(data) -> dict | None:
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("ranks"), list):
        return None
    world_size = _count(data.get("world_size"), MAX_RANKS + 1) or 0
    origin = _number(data.get("origin")) or 0.0
    ranks = []
    for position, r in enumerate(data["ranks"][:MAX_RANKS]):
        if not isinstance(r, dict):
            continue
        raw = r.get("events") if isinstance(r.get("events"), list) else []
        events = [e for e in (_event(item, None) for item in raw[:MAX_EVENTS]) if e is not None]
        events = [e for e in events if e["t0"] >= 0]
        rank = _count(r.get("rank"), MAX_RANKS)
        ranks.append({"rank": position if rank is None else rank, "events": events,
                      "dropped": (_count(r.get("dropped"), 1 << 40) or 0) + len(raw) - len(events),
                      "problem": clean_name(r.get("problem"), 200)})
    span = max((e["t1"] for r in ranks for e in r["events"]), default=0.0)
    draw = data.get("draw") if isinstance(data.get("draw"), list) else []
    run = {"version": VERSION, "label": clean_name(data.get("label"), 120), "world_size": world_size or len(ranks),
           "origin": origin, "span": span, "shown": data.get("shown") is True,
           "draw": [clean_name(d) for d in draw[:32] if clean_name(d)], "ranks": ranks}
    if data.get("stopped") is True:
        run["stopped"] = True
        run["problem"] = clean_name(data.get("problem"), 300)
    return run


def runs_in(sections) -> list[dict]:
    """Every run in a report's sections (its ``sections`` list), checked; never raises."""
    out = []
    for section in sections if isinstance(sections, list) else []:
        data = section.get("data") if isinstance(section, dict) else None
        if isinstance(data, dict) and KEY in data:
            run = read_run(data[KEY])
            if run is not None:
                out.append(run)
    return out


def is_timeline(section) -> bool:
    return isinstance(section, dict) and isinstance(section.get("data"), dict) and KEY in section["data"]


def regions(run: dict) -> list[dict]:
    """The regions a run's ranks marked, by name, each with the earliest start and the latest end any rank
    gave it: ``[{"label", "t0", "t1"}]`` in order of start."""
    found: dict[str, list[float]] = {}
    for r in run["ranks"]:
        for e in r["events"]:
            if e["kind"] == "region":
                name = e.get("label", "")
                if name in found:
                    found[name] = [min(found[name][0], e["t0"]), max(found[name][1], e["t1"])]
                else:
                    found[name] = [e["t0"], e["t1"]]
    return sorted(({"label": n, "t0": a, "t1": b} for n, (a, b) in found.items()), key=lambda x: x["t0"])


def events(run: dict, rank: int, kinds=KINDS, within: str | None = None) -> list[dict]:
    """Rank ``rank``'s events of ``kinds``, in order of start; with ``within``, only those inside the region of
    that name as this rank marked it (as the ranks together marked it, where this one did not)."""
    for r in run["ranks"]:
        if r["rank"] == rank:
            bounds = None if within is None else region_of(run, r, within)
            return [e for e in r["events"] if e["kind"] in kinds and
                    (bounds is None or (e["t0"] >= bounds[0] and e["t1"] <= bounds[1]))]
    return []


def region_of(run: dict, r: dict, name: str) -> tuple[float, float]:
    """(start, end) of the region ``name`` as rank record ``r`` marked it, else as the ranks together did
    (an empty span where none did)."""
    own = next((e for e in r["events"] if e["kind"] == "region" and e.get("label", "") == name), None)
    if own is not None:
        return own["t0"], own["t1"]
    found = next((p for p in regions(run) if p["label"] == name), None)
    return (found["t0"], found["t1"]) if found else (0.0, -1.0)


def summary(run: dict) -> str:
    """One line: what the run's ranks did, counted (the text under a timeline section's title); the grader's own
    calls are not counted."""
    phases, messages, collectives = 0, 0, 0
    for r in run["ranks"]:
        for e in r["events"]:
            if e.get("by") == GRADER:
                continue
            phases += e["kind"] in PHASES
            messages += e["kind"] in ("send", "recv")
            collectives += e["kind"] == "collective"
    return (f"{len(run['ranks'])} ranks over {run['span'] * 1000:.1f} ms: {phases} forwards, backwards, steps and "
            f"saves; {messages} sends and receives; {collectives} collectives")


# --- slot views: a schedule in unit time, as the checks measured it -------------------------------------------

SLOT_KEY = "slot_view"  # the key of a slot view in a section's data
MAX_SLOTS = 256  # cells a row shows
MAX_CELL = 12  # characters of a cell


def slot_view(orders: list[list[str]], slots: list[list[int]] | None = None, *, notes: list[str] | None = None,
              caption: str = "") -> dict:
    """A schedule as a table of time slots, for the page: one row per rank, cell ``slots[rank][i]`` holding
    ``orders[rank][i]`` (e.g. "F3"), "" where the rank waits. Without ``slots`` (an order that does not fit unit
    time) each rank's calls follow one another. ``notes[rank]``: what was measured on that rank (its peak).
    A check puts it in a section's data under :data:`SLOT_KEY`; the page draws every one it finds."""
    rows = []
    for rank, order in enumerate(orders):
        places = slots[rank] if slots is not None and rank < len(slots) else list(range(len(order)))
        span = 1 + max(places, default=-1)
        cells = [""] * min(span, MAX_SLOTS)
        for label, place in zip(order, places):
            if 0 <= place < len(cells):
                cells[place] = str(label)
        rows.append({"name": f"rank {rank}", "cells": cells,
                     "note": str(notes[rank]) if notes is not None and rank < len(notes) else ""})
    width = max((len(r["cells"]) for r in rows), default=0)
    for r in rows:
        r["cells"] += [""] * (width - len(r["cells"]))
    return {"caption": caption, "rows": rows}


def read_slot_view(data) -> dict | None:
    """A slot view as a report holds it, checked (sizes bounded, text made safe); None when it is not one."""
    try:
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            return None
        rows = []
        for r in data["rows"][:MAX_RANKS]:
            if not isinstance(r, dict) or not isinstance(r.get("cells"), list):
                continue
            rows.append({"name": clean_name(r.get("name")), "note": clean_name(r.get("note"), 200),
                         "cells": [clean_name(c, MAX_CELL) for c in r["cells"][:MAX_SLOTS]]})
        return {"caption": clean_name(data.get("caption"), 300), "rows": rows} if rows else None
    except Exception:  # anything at all: a renderer must not fail on a report
        return None


# --- a run the grader had to stop: what the ranks flushed as they went ------------------------------------------

MAX_FLUSHED_BYTES = 4 << 20  # of one rank's file: the rest is not read


def read_flushed(path: str, stopped_at: float) -> dict | None:
    """What a rank wrote to its flush file (grader.rank.rank_timeline.flush_name) before it was stopped, as a
    record for :func:`from_ranks`: each event that ended, and each blocking call that had started and not ended,
    as an event ``open`` until ``stopped_at``. The file is the submission's: read as every JSON-lines file a rank
    leaves is (grader.rank.untrusted.read_json_lines: no link followed, no pipe waited on, at most
    MAX_FLUSHED_BYTES, each line's nesting bounded; a line that is not JSON is left out). None when there is no
    such file or it cannot be read."""
    from grader.rank import untrusted, wire

    try:
        values = untrusted.read_json_lines(path, wire.Budget(bytes=MAX_FLUSHED_BYTES))
    except (untrusted.Unreadable, OSError):
        return None
    # A rank killed while recording leaves the rest of its mapped file as zeros: one line that is not JSON, left out.
    events, opened, dropped = [], {}, 0
    for item in values:
        if not isinstance(item, dict):
            dropped += 1
            continue
        call = _count(item.get("call"), 1 << 40)
        if item.get("open") is True:
            if call is not None and len(opened) < MAX_EVENTS:
                opened[call] = item
            continue
        if call is not None:
            opened.pop(call, None)
        if len(events) < MAX_EVENTS:
            events.append({k: v for k, v in item.items() if k != "open"})
        else:
            dropped += 1
    for item in opened.values():
        t0 = _number(item.get("t0"))
        if t0 is not None and t0 <= stopped_at:
            events.append({**item, "t1": stopped_at, "open": True})
    return {"events": events, "dropped": dropped}


def stopped_run(run_dir: str, world_size: int, *, label: str, window: tuple[float, float],
                problem: str = "") -> dict | None:
    """The run of a world the grader stopped (a timeout, a crash), from the files its ranks flushed in ``run_dir``:
    lanes up to the moment it stopped (``window[1]``), each rank's blocking calls still under way marked
    ``open``; None when no rank flushed anything (a driver not recorded)."""
    import os

    records = [read_flushed(os.path.join(run_dir, f"rank{rank}.timeline"), window[1])
               for rank in range(min(world_size, MAX_RANKS))]
    if not any(isinstance(r, dict) and r["events"] for r in records):
        return None
    run = from_ranks(records, label=label, world_size=world_size, window=window, shown=False)
    run["stopped"] = True
    if problem:
        run["problem"] = clean_name(problem, 300)
    return run
