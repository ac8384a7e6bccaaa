"""Grade one file and remember it: the flow under ``ddp-grade FILE``, ``watch`` and ``interview``.

Below the command line and without click: the command picks where the grading runs (here with a
session, through the server, in a sandbox), renders the live line and the report, and echoes the
notes this returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from grader import catalog, kit
from grader import progress as prog
from grader.results import PASSED, Report


@dataclass
class Graded:
    """A grading and what the learner should be told beside its report."""

    report: Report
    notes: list[str] = field(default_factory=list)  # one line each, for stderr


def exercise_of(path: str, exercise_id: str | None) -> catalog.Exercise | None:
    return catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)


def here(session, options, path: str, exercise_id: str | None) -> Callable:
    """``grade(on_event) -> Report`` with ``session`` in this process."""
    from grader.grading import grade_file

    return lambda on_event: grade_file(path, session, options, exercise_id, on_event=on_event)


def grade_and_record(path: str, exercise_id: str | None, progress: prog.Progress, grade: Callable,
                     on_event=None, quiet: bool = False) -> Graded:
    """Grade with ``grade(on_event)``; remember the result when ``path`` is the kit's own exercise file."""
    ex = exercise_of(path, exercise_id)
    report = grade(on_event)
    graded = Graded(report)
    if ex is not None and report.exercise == ex.id and prog.is_kit_file(path, ex):
        progress.record_grading(ex.id, report.status)
        if progress.unsaved:
            graded.notes.append(f"ddp-grade: progress was not saved ({progress.unsaved}); this grading is not "
                                "remembered. Set DDP_GRADE_STATE_DIR to a folder you can write.")
    elif ex is not None and report.status == PASSED and not quiet:
        try:
            where = f" ({kit.exercise_path(ex)})"
        except kit.KitError:
            where = ""
        graded.notes.append(f"Not recorded as progress: {path} is not the kit's own file{where}.")
    return graded


def label(path: str, exercise_id: str | None) -> str:
    """What the live line calls this grading."""
    ex = exercise_of(path, exercise_id)
    return f"exercise {ex.id}" if ex else os.path.basename(path)
