"""``ddp-grade watch [NN|PATH]``: re-grade an exercise file every time it is saved."""

from __future__ import annotations

import os
import re

import click

from grader import flow, kit
from grader import progress as prog
from grader.cli.common import (color, echo_notes, exercise_arg, fail, kit_call, load_progress,
                                       require_readable)
from grader.cli.options import grading_options, quiet_option
from grader.exits import EXIT_OK


@click.command()
@click.argument("target", metavar="[NN|PATH]", required=False)
@click.option("--exercise", "exercise_id", metavar="NN", help="Grade PATH as exercise NN.")
@grading_options
@quiet_option
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.01, max=10), default=0.05, show_default=True,
              help="Seconds between looks at the file.")
@click.option("--max-grades", type=click.IntRange(min=1), default=None, hidden=True)
def watch(target, exercise_id, options, quiet, poll_s, max_grades):
    """Re-grade an exercise file every time it is saved; stop with Ctrl-C (exit 0).

    Without NN: the next unfinished exercise. The file is polled, which works in
    containers, WSL and network folders too; the processes that run your code are
    kept warm with torch imported, so a verdict comes within about a second of saving.
    """
    from grader import catalog, grading
    from grader.rank import harness
    from grader.commands.watch import watch_loop
    from grader.report import render_text

    progress = load_progress()
    if target is not None and os.path.lexists(target):
        require_readable(target)
    elif target is not None and exercise_id is None and not re.fullmatch(r"\d{1,2}(_\w+)?", target):
        fail(f"no such file: {target}")
    ex, path = exercise_arg(target, progress)
    if exercise_id:
        ex = kit_call(lambda: kit.require_exercise(exercise_id))
    tty = color()
    try:
        grading.warm_up(dynamo=ex.preload_dynamo if ex else True, exercises=[ex])
    except KeyboardInterrupt:
        _stopped_watching()

    with harness.Session(limits=options.limits, spares=True) as session:
        def once(n: int) -> None:
            graded = flow.grade_and_record(path, exercise_id, progress, flow.here(session, options, path, exercise_id),
                                           quiet=quiet)
            report = echo_notes(graded, progress)
            if tty:
                click.clear()
            click.echo(render_text(report, color=tty))
            stamp = __import__("time").strftime("%H:%M:%S")
            click.echo(f"\n[{stamp}] grading {n} of {path}; save the file to grade again, Ctrl-C to stop.")
            if report.status == "passed" and catalog.by_id(report.exercise or "") is not None:
                nxt = prog.next_row(kit_call(lambda: prog.rows(progress)))
                if nxt is not None:
                    click.echo(f"Passed! Next: `ddp-grade watch {nxt.exercise.id}` ({nxt.exercise.title}).")

        try:
            watch_loop(path, once, poll_s=poll_s, max_grades=max_grades)
        except KeyboardInterrupt:  # the ranks of a grading under way are stopped already; the session ends below
            _stopped_watching(exit_now=False)
    raise SystemExit(EXIT_OK)


def _stopped_watching(exit_now: bool = True) -> None:
    """Ctrl-C in watch: one line, and exit 0 once what it started has stopped (a second Ctrl-C cannot cut that short)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo("\nStopped watching.")
    if exit_now:
        raise SystemExit(EXIT_OK)
