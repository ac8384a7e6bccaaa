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


MOVE_ON_S = 3.0  # after a pass, how long Enter may keep watch on the exercise that passed


@click.command()
@click.argument("target", metavar="[NN|PATH]", required=False)
@click.option("--exercise", "exercise_id", metavar="NN", help="Grade PATH as exercise NN.")
@grading_options
@quiet_option
@click.option("--poll", "poll_s", type=click.FloatRange(min=0.01, max=10), default=0.05, show_default=True,
              help="Seconds between looks at the file.")
@click.option("--no-server", is_flag=True,
              help="Grade in this process only, never through the warm grading server (also DDP_GRADE_SERVER=0).")
@click.option("--stay", is_flag=True, help="Stay on this exercise after it passes (by default watch moves on to "
                                           "the next unfinished one of the kit).")
@click.option("--max-grades", type=click.IntRange(min=1), default=None, hidden=True)
def watch(target, exercise_id, options, quiet, poll_s, no_server, stay, max_grades):
    """Re-grade an exercise file every time it is saved; stop with Ctrl-C (exit 0).

    Without NN: the next unfinished exercise. When the kit's own file of an exercise
    passes, watch moves on to the next unfinished exercise (press Enter within a few
    seconds to stay, or pass --stay). Gradings go through the warm grading server when
    one runs (see `ddp-grade server`), else through processes of watch's own, kept warm
    with torch imported, so a verdict comes within about a second of saving. The file is
    polled too, which works in containers, WSL and network folders.
    """
    import contextlib
    import threading

    from grader import server as grading_server
    from grader.commands.watch import watch_loop

    progress = load_progress()
    if target is not None and os.path.lexists(target):
        require_readable(target)
    elif target is not None and exercise_id is None and not re.fullmatch(r"\d{1,2}(_\w+)?", target):
        fail(f"no such file: {target}")
    ex, path = exercise_arg(target, progress)
    if exercise_id:
        ex = kit_call(lambda: kit.require_exercise(exercise_id))
    tty = color()
    remote = not no_server and grading_server.enabled() and grading_server._answering()
    where = "the warm grading server" if remote else "processes of its own (starting them imports torch: a few seconds)"
    click.echo(f"Watching {flow.kit_relative(path)}: grading it now through {where}.", err=True)
    state = {"path": path, "exercise_id": exercise_id, "session": None, "remote": remote, "move_to": None}

    with contextlib.ExitStack() as stack:
        def local():
            """watch's own warm session, started the first time a grading needs it."""
            if state["session"] is None:
                from grader import grading
                from grader.rank import harness

                try:
                    grading.warm_up(dynamo=ex.preload_dynamo if ex else True, exercises=[ex])
                except KeyboardInterrupt:
                    _stopped_watching()
                state["session"] = stack.enter_context(harness.Session(limits=options.limits, spares=True))
            return flow.here(state["session"], options, state["path"], state["exercise_id"])

        def grade_now(on_event):
            if state["remote"]:
                try:
                    return grading_server.grade_remote(state["path"], state["exercise_id"], options, on_event=on_event)
                except grading_server.Unavailable:
                    state["remote"] = False
                    click.echo("ddp-grade: the grading server stopped answering; grading here from now on.", err=True)
            return local()(on_event)

        stop = threading.Event()
        counted = {"n": 0}

        def once(n: int) -> None:
            from grader.report import render_text

            counted["n"] += 1
            graded = flow.grade_and_record(state["path"], state["exercise_id"], progress, grade_now, quiet=quiet)
            report = echo_notes(graded, progress)
            if tty:
                click.clear()
            click.echo(render_text(report, color=tty))
            stamp = __import__("time").strftime("%H:%M:%S")
            click.echo(f"\n[{stamp}] grading {counted['n']} of {state['path']}; save the file to grade again, "
                       "Ctrl-C to stop.")
            nxt = _next_after_a_pass(report, state["path"], state["exercise_id"], progress)
            if nxt is None:
                return
            if stay or (max_grades is not None and counted["n"] >= max_grades):
                click.echo(f"Passed! Next: `ddp-grade watch {nxt.exercise.id}` ({nxt.exercise.title}).")
                return
            click.echo(f"Passed! Moving on to {nxt.exercise.id} ({nxt.exercise.title}), "
                       f"{flow.kit_relative(nxt.path)}; press Enter within {MOVE_ON_S:.0f} s to stay on "
                       f"{report.exercise}.")
            if _enter_pressed(MOVE_ON_S):
                click.echo(f"Staying on {report.exercise}; save the file to grade again.")
                return
            state["move_to"] = nxt
            stop.set()

        try:
            while True:
                left = None if max_grades is None else max_grades - counted["n"]
                if left is not None and left <= 0:
                    break
                watch_loop(state["path"], once, poll_s=poll_s, max_grades=left, stop=stop)
                nxt = state["move_to"]
                if nxt is None:
                    break
                state.update(path=str(nxt.path), exercise_id=None, move_to=None)
                click.echo(f"Watching {flow.kit_relative(nxt.path)} (exercise {nxt.exercise.id}).", err=True)
                stop.clear()
        except KeyboardInterrupt:  # the ranks of a grading under way are stopped already; the session ends below
            _stopped_watching(exit_now=False)
    raise SystemExit(EXIT_OK)


def _next_after_a_pass(report, path: str, exercise_id, progress: prog.Progress):
    """The next unfinished exercise of the kit after a pass of the kit's own file of an exercise; else None."""
    from grader import catalog

    ex = catalog.by_id(report.exercise or "")
    if report.status != "passed" or ex is None or exercise_id not in (None, ex.id) or not prog.is_kit_file(path, ex):
        return None
    return prog.next_row(kit_call(lambda: prog.rows(progress)))


def _enter_pressed(within_s: float) -> bool:
    """Whether a line came on standard input within ``within_s`` seconds (a terminal's Enter); False at once
    where standard input is no terminal."""
    import select
    import sys

    try:
        if not sys.stdin.isatty():
            return False
        ready, _, _ = select.select([sys.stdin], [], [], within_s)
        if ready:
            sys.stdin.readline()
        return bool(ready)
    except (OSError, ValueError, AttributeError):
        return False


def _stopped_watching(exit_now: bool = True) -> None:
    """Ctrl-C in watch: one line, and exit 0 once what it started has stopped (a second Ctrl-C cannot cut that short)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo("\nStopped watching.")
    if exit_now:
        raise SystemExit(EXIT_OK)
