"""A run's timeline into the report: each rank's own record of what it did over time (its driver
wrapped in :func:`grader.rank.rank_timeline.traced`), read as untrusted data (:mod:`grader.timeline`)
and added as a section. It only shows what happened; no verdict is taken from it.

    outcome = g.run(rank_main, world_size)
    timelines.keep(g, outcome, f"world size {world_size}")
"""

from __future__ import annotations

import time

from grader import timeline
from grader.checks.interface import Grader, WorldOutcome

TITLE = "what each rank did over time"


def clock() -> float:
    """Now, on the clock the ranks' records use: pass it as ``keep(started=...)`` when runs are read later."""
    return time.monotonic()


def keep(g: Grader, outcome: WorldOutcome, label: str, *, shown: bool = False, draw: tuple[str, ...] = (),
         started: float | None = None) -> dict:
    """Add ``outcome``'s timeline to the report as a section; returns the run (see :mod:`grader.timeline`).

    ``shown``: the text report draws it without -v (where the schedule is the point of the exercise);
    ``draw``: the regions it draws there (none named: every one). The times a rank may claim lie
    between ``started`` (``time.monotonic()`` before the run began; by default, the run's length before
    now, so call it right after ``g.run``) and now.
    """
    if started is None:
        started = time.monotonic() - float(outcome.seconds or 0.0)
    results = [r.result for r in outcome.ranks]
    return keep_results(g, results, label, outcome.world_size, started, shown=shown, draw=draw)


def keep_results(g: Grader, results: list, label: str, world_size: int, started: float, *, shown: bool = False,
                 draw: tuple[str, ...] = ()) -> dict:
    """As :func:`keep`, from what each rank returned some other way (e.g. in a file its job wrote before it was
    killed): each rank's dict, its record under ``"timeline"``; anything else counts as no record."""
    records = [r.get(timeline.KEY) if isinstance(r, dict) else None for r in results]
    run = timeline.from_ranks(records, label=label, world_size=world_size, window=(started, time.monotonic()),
                              shown=shown, draw=draw)
    g.section(f"{TITLE}: {run['label']}", timeline.summary(run), {timeline.KEY: run})
    return run
