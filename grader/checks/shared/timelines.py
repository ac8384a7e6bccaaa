"""A run's timeline into the report: each rank's own record of what it did over time (its driver
wrapped in :func:`grader.rank_timeline.traced`), read as untrusted data (:mod:`grader.timeline`)
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
    now = time.monotonic()
    if started is None:
        started = now - float(outcome.seconds or 0.0)
    records = [r.result.get(timeline.KEY) if isinstance(r.result, dict) else None for r in outcome.ranks]
    run = timeline.from_ranks(records, label=label, world_size=outcome.world_size, window=(started, now),
                              shown=shown, draw=draw)
    g.section(f"{TITLE}: {run['label']}", timeline.summary(run), {timeline.KEY: run})
    return run
