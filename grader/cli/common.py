"""What the commands share: one line on stderr and an exit code for input the user can fix, the progress file,
the exercise an argument names, colour on a terminal, and the notes a grading leaves."""

from __future__ import annotations

import os
import sys

import click

from grader import kit
from grader import progress as prog
from grader.exits import EXIT_OK, EXIT_UNUSABLE


def fail(message: str, code: int = EXIT_UNUSABLE):
    """One line on stderr and the exit code: never a traceback for input the user can fix."""
    click.echo(f"ddp-grade: error: {message}", err=True)
    raise SystemExit(code)


def kit_call(fn):
    """``fn()``, or exit 2 with the reason when the kit's files cannot be found or used."""
    try:
        return fn()
    except kit.KitError as exc:
        fail(str(exc))


def color() -> bool:
    return sys.stdout.isatty()


def load_progress() -> prog.Progress:
    """The learner's progress; a warning on stderr when its file had to be set aside."""
    p = prog.Progress()
    if p.warning():
        click.echo(p.warning(), err=True)
    return p


def say_unsaved(progress: prog.Progress, what: str) -> None:
    """One line on stderr when a change to progress could not be saved (the command still did its work)."""
    if progress.unsaved and not getattr(progress, "told_unsaved", False):
        progress.told_unsaved = True  # once per command (watch grades again and again)
        click.echo(f"ddp-grade: progress was not saved ({progress.unsaved}); {what} is not remembered. "
                   f"Set DDP_GRADE_STATE_DIR to a folder you can write.", err=True)


def echo_notes(graded, progress: prog.Progress):
    """The notes of a grading (:class:`grader.flow.Graded`) on stderr, the unsaved progress once per command;
    its report."""
    for note in graded.notes:
        if not note.startswith("ddp-grade: progress was not saved") or not getattr(progress, "told_unsaved", False):
            click.echo(note, err=True)
    if progress.unsaved:
        progress.told_unsaved = True  # once per command (watch grades again and again)
    return graded.report


def next_exercise_path(progress: prog.Progress) -> str | None:
    rows = kit_call(lambda: prog.rows(progress))
    nxt = prog.next_row(rows)
    if nxt is None:
        return None
    return str(nxt.path)


def exercise_arg(value: str | None, progress: prog.Progress):
    """(exercise, path) for an argument "03", "3", "03_train" or a path; the next unfinished one when None."""
    from grader import catalog

    if value is None:
        path = next_exercise_path(progress)
        if path is None:
            fail("every exercise has passed; name one, e.g. 01", EXIT_OK)
        return catalog.from_filename(path), path
    if os.path.isfile(value):
        ex = catalog.from_filename(value)
        if ex is None:
            fail(f"cannot tell which exercise {os.path.basename(value)} is: name it like 03_train.py")
        return ex, value
    ex = kit_call(lambda: kit.require_exercise(value))
    return ex, str(kit_call(lambda: kit.exercise_path(ex)))


def require_readable(path: str) -> None:
    """Exit 2 with the reason (the path named) unless ``path`` is a file that can be read."""
    from grader import learner

    try:
        learner.read_source(path)
    except learner.Unusable as exc:
        fail(str(exc))
