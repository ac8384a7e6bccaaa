"""Grade one file and remember it: the flow under ``ddp-grade FILE``, ``watch`` and ``interview``.

Below the command line and without click. :func:`grade` picks where a grading runs (in a sandbox when asked,
else through the warm grading server when one answers, else here with a pool of its own);
:func:`grade_and_record` runs one with the live line on stderr and records the learner's progress. The command
renders the report and echoes the notes; what keeps a grading from starting is :class:`Refused`, with the
learner's message (exit 2).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

from grader import catalog, kit, live
from grader import progress as prog
from grader.rank import untrusted
from grader.results import PASSED, Report, count_evidence_only


@dataclass
class Graded:
    """A grading and what the learner should be told beside its report."""

    report: Report
    notes: list[str] = field(default_factory=list)  # one line each, for stderr
    started_server: bool = False  # a grading server was started in the background for the next gradings


class Refused(Exception):
    """The grading cannot start here (no sandbox tool, an unreadable file) or gave no report: the message says
    why, in the learner's terms."""


def exercise_of(path: str, exercise_id: str | None) -> catalog.Exercise | None:
    return catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)


def label(path: str, exercise_id: str | None) -> str:
    """What the live line calls this grading."""
    ex = exercise_of(path, exercise_id)
    return f"exercise {ex.id}" if ex else os.path.basename(path)


def here(session, options, path: str, exercise_id: str | None) -> Callable:
    """``grade(on_event) -> Report`` with ``session`` in this process."""
    from grader.grading import grade_file

    return lambda on_event: grade_file(path, session, options, exercise_id, on_event=on_event)


def _digest_of(path: str) -> str | None:
    """The digest progress keeps of the file's text, read as a grading reads a submission (no link, a regular file,
    bounded, never waited on: a FIFO is refused by the grading that follows); None where it cannot be read."""
    try:
        text = untrusted.read_submission(path).decode("utf-8")
    except (untrusted.Unreadable, UnicodeDecodeError):
        return None
    return prog.digest(text.replace("\r\n", "\n").replace("\r", "\n"))


def grade_and_record(path: str, exercise_id: str | None, progress: prog.Progress, grade: Callable,
                     quiet: bool = False, stream=None) -> Graded:
    """Grade with ``grade(on_event)`` under a live line on ``stream`` (stderr); remember the result when
    ``path`` is the kit's own exercise file."""
    stream = stream or sys.stderr
    graded_digest = _digest_of(path)  # what is graded, as progress remembers a pass of it (restore after reset)
    line = live.LiveLine(label(path, exercise_id), live.mode_for(stream, quiet), stream)
    try:
        report = grade(line.event)
    finally:
        line.done()
    ex = exercise_of(path, exercise_id)
    graded = Graded(report)
    if ex is not None and report.exercise == ex.id and prog.is_kit_file(path, ex):
        progress.record_grading(ex.id, report.status, graded_digest)
        if progress.unsaved:
            graded.notes.append(f"ddp-grade: progress was not saved ({progress.unsaved}); this grading is not "
                                "remembered. Set DDP_GRADE_STATE_DIR to a folder you can write.")
    elif ex is not None and report.status == PASSED and not quiet:
        try:
            where = f" ({kit_relative(kit.exercise_path(ex))})"
        except kit.KitError:
            where = ""
        graded.notes.append(f"Not recorded as progress: {path} is not the kit's own file{where}.")
    return graded


def kit_relative(path) -> str:
    """``path`` as a learner finds it: from the current folder when it lies below it (exercises/01_setup.py),
    else from the kit's folder ("exercises/01_setup.py in the kit"), else as it is."""
    for base, suffix in ((os.getcwd, ""), (kit.root, " in the kit")):
        try:
            relative = os.path.relpath(path, str(base()))
        except (ValueError, OSError, kit.KitError):
            continue
        if not relative.startswith(".."):
            return relative + suffix
    return str(path)


def grade(path: str, options, exercise_id: str | None, progress: prog.Progress, *, quiet: bool = False,
          server: bool = True, sandbox: bool = False) -> Graded:
    """``ddp-grade FILE``: in a sandbox when asked; else through the warm grading server when one answers
    (``server``), starting one for the next gradings when none did; else here."""
    from grader import server as grading_server

    if sandbox:
        return _in_sandbox(path, options, exercise_id, progress, quiet)
    use_server = server and grading_server.enabled()
    if use_server:
        def remote(on_event):
            return grading_server.grade_remote(path, exercise_id, options, on_event=on_event)

        try:
            return grade_and_record(path, exercise_id, progress, remote, quiet=quiet)
        except grading_server.Unavailable:
            pass
    graded = in_a_pool_of_its_own(path, options, exercise_id, progress, quiet)
    graded.started_server = use_server and grading_server.start_in_background()
    return graded


def in_a_pool_of_its_own(path: str, options, exercise_id: str | None, progress: prog.Progress,
                         quiet: bool) -> Graded:
    """Grade in this process, with a pool started for this grading alone."""
    from grader import grading
    from grader.rank import harness

    exercise = exercise_of(path, exercise_id)
    grading.warm_up(dynamo=exercise is None or exercise.preload_dynamo, exercises=[exercise])
    with harness.Session(limits=options.limits) as session:
        return grade_and_record(path, exercise_id, progress, here(session, options, path, exercise_id), quiet=quiet)


def _in_sandbox(path: str, options, exercise_id: str | None, progress: prog.Progress, quiet: bool) -> Graded:
    """Grade here, the ranks in a fresh sandbox (grader.protocol.grade_in_sandbox); progress is recorded here."""
    from grader import learner, protocol, sandbox

    if sandbox.tool() is None:
        raise Refused("--sandbox needs bwrap (the bubblewrap package) or unshare with user namespaces; neither "
                      "works here (see `ddp-grade doctor`)")
    try:
        learner.read_source(path)
    except learner.Unusable as exc:
        raise Refused(str(exc)) from None

    def run(on_event):
        try:
            report = protocol.grade_in_sandbox(path, exercise_id, options, on_event)
        except protocol.Failed as exc:
            raise Refused(f"the sandboxed grading gave no report: {exc}") from None
        report.path = path
        return count_evidence_only(report)  # under --sandbox a claim counts for nothing

    return grade_and_record(path, exercise_id, progress, run, quiet=quiet)
