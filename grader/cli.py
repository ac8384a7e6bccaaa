"""The ``ddp-grade`` command line. Commands only parse options and render; the work is elsewhere.

Exit codes (every command):
  0  everything passed / the command did what was asked
  1  a check failed
  2  the input could not be used: missing path, syntax error, missing function,
     unknown exercise or topic, bad option value, unreadable answers file
  3  grading timed out (a deadlock or an endless loop in the submission)
  130 interrupted with Ctrl-C (progress so far is saved); `watch` ends with 0 on Ctrl-C,
      its normal way to stop

Per command: `list`, `hint`, `solution`, `reset`, `restore` exit 0 or 2 (unknown exercise,
kit files not found, a copy that cannot be kept); `server status` and `server stop` exit 0; `doctor` exits 0 when grading can work here, 1 when something is wrong;
`interview` exits 0 when the exercise passed at the end, 1 when not, 130 on Ctrl-C;
`batch` and `batch merge` exit with the worst result of the submissions (2 > 3 > 1 > 0; merge: 2 when
it refuses its parts); `gradescope run` exits 0 whenever it wrote results.json, 2 when the bundle
cannot be used; `plan` exits 0 when the cost model answered, 1 while 41 and 42 have not both passed,
2 for a plan or option it cannot use.
"""

from __future__ import annotations

import os
import sys
import re

import click

from grader import __version__, kit
from grader import progress as prog

from grader.options import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNUSABLE, format_option,
                            grading_options, quiet_option)


class DefaultGroup(click.Group):
    """A group where ``ddp-grade PATH`` means ``ddp-grade grade PATH``."""

    default_command = "grade"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        elif not args and self.default_command in self.commands:
            args = [self.default_command]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddp-grade")
def main():
    """Practise PyTorch DDP: write the exercises, get them graded in real process groups.

    \b
    Examples:
      ddp-grade                           grade the next unfinished exercise
      ddp-grade list                      every exercise and its status
      ddp-grade watch                     re-grade the next exercise on every save
      ddp-grade hint 03                   the next hint for exercise 03
      ddp-grade exercises/03_train.py     grade one file (also: ddp-grade 03)
      ddp-grade interview --minutes 45    a timed mock interview
      ddp-grade quiz -n 5                 five quiz questions
      ddp-grade doctor                    check that grading works on this machine
    """


@main.command()
@click.argument("path", required=False, type=click.Path(dir_okay=True, file_okay=True, path_type=str))
@click.option("--exercise", "exercise_id", metavar="NN", help="Grade PATH as exercise NN (default: from the file name).")
@grading_options
@format_option()
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="Also write the report as JUnit XML to FILE (for CI dashboards).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), metavar="PATH",
              help="Also write what each rank did over time: PATH ending in .html is a page with the verdicts "
                   "beside the lanes; any other name, Chrome trace JSON (opens in Perfetto).")
@quiet_option
@click.option("-v", "--verbose", is_flag=True, help="Show every detail, also of passing runs (and every timeline).")
@click.option("--no-server", is_flag=True,
              help="Grade in this process only: neither use nor start the warm grading server "
                   "(also DDP_GRADE_SERVER=0).")
@click.option("--sandbox", is_flag=True,
              help="For untrusted code: grade in Linux namespaces (loopback only, home folder hidden, "
                   "nothing outlives the run); needs bwrap or unshare (see `ddp-grade doctor`).")
def grade(path, exercise_id, options, fmt, junit_path, trace_path, quiet, verbose, no_server, sandbox):
    """Grade one exercise file (this is also what `ddp-grade PATH` does).

    Without PATH, grades the next unfinished exercise of the kit (see `ddp-grade list`);
    PATH may also be an exercise number, e.g. `ddp-grade 03`.

    \b
    Example:
      ddp-grade grade exercises/03_train.py --world-size 2 --backend gloo
      ddp-grade 01 --format json --junit report.xml
    """
    from grader import server
    from grader.report import render_json, render_junit, render_text

    progress = _progress()
    if path is None:
        path = _next_exercise_path(progress)
        if path is None:
            click.echo("Every exercise has passed. Try `ddp-grade interview` or `ddp-grade quiz`.")
            raise SystemExit(EXIT_OK)
    elif not os.path.exists(path) and re.fullmatch(r"\d{1,2}", path):
        path = str(_kit_call(lambda: kit.exercise_path(kit.require_exercise(path))))
    use_server = server.enabled() and not no_server and not sandbox
    try:
        if sandbox:
            report = _grade_in_sandbox(path, options, exercise_id, progress, quiet)
        else:
            report = _grade_with_server(path, options, exercise_id, progress, quiet) if use_server else None
        if report is None:
            report = _grade_here(path, options, exercise_id, progress, quiet)
            if use_server and server.start_in_background() and not quiet:  # the next grading finds a warm pool
                click.echo("ddp-grade: started a grading server in the background to keep the next gradings warm; "
                           "it stops after 10 idle minutes, or now with `ddp-grade server stop`.", err=True)
    except KeyboardInterrupt:  # the ranks are already stopped and the temp folder removed
        click.echo("ddp-grade: interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    if fmt == "json":
        click.echo(render_json(report))
    else:
        click.echo(render_text(report, color=_color(), verbose=verbose))
    if junit_path:
        try:
            with open(junit_path, "w", encoding="utf-8") as f:
                f.write(render_junit(report))
        except OSError as exc:
            _fail(f"cannot write {junit_path}: {exc.strerror or exc}")
    if trace_path:
        _write_trace(trace_path, report)
    raise SystemExit(report.exit_code)


def _write_trace(path: str, report) -> None:
    """--trace: the report's timelines as a page or a Chrome trace (exit 2 when the file cannot be written)."""
    from grader import timeline_view

    try:
        runs = timeline_view.write(path, report.to_dict())
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror or exc}")
    if not runs:
        click.echo(f"ddp-grade: {path} holds no lanes: no rank recorded a timeline in this grading", err=True)


def _grade_here(path, options, exercise_id, progress, quiet):
    """Grade in this process, with a pool started for this command alone."""
    from grader import grading, harness

    exercise = _exercise_of(path, exercise_id)
    grading.warm_up(dynamo=exercise is None or exercise.preload_dynamo, exercises=[exercise])
    with harness.Session(limits=options.limits) as session:
        return grade_and_record(path, session, options, exercise_id, progress, quiet)


def _grade_in_sandbox(path, options, exercise_id, progress, quiet):
    """Grade here, the ranks in a fresh sandbox (grader.protocol.grade_in_sandbox); progress is recorded here."""
    from grader import protocol, sandbox

    if sandbox.tool() is None:
        _fail("--sandbox needs bwrap (the bubblewrap package) or unshare with user namespaces; neither works "
              "here (see `ddp-grade doctor`)")
    _require_readable(path)

    def run(on_event):
        try:
            report = protocol.grade_in_sandbox(path, exercise_id, options, on_event)
        except protocol.Failed as exc:
            _fail(f"the sandboxed grading gave no report: {exc}")
        report.path = path
        return report

    return grade_and_record(path, None, options, exercise_id, progress, quiet, grade=run)


def _grade_with_server(path, options, exercise_id, progress, quiet):
    """Grade through the warm grading server; None when none answers (then grade here)."""
    from grader import server

    def remote(on_event):
        return server.grade_remote(path, exercise_id, options, on_event=on_event)

    try:
        return grade_and_record(path, None, options, exercise_id, progress, quiet, grade=remote)
    except server.Unavailable:
        return None


def grade_and_record(path, session, options, exercise_id, progress, quiet, grade=None):
    """Grade with a live line on stderr (grader.flow does the grading and the recording); echo its notes.

    ``grade(on_event) -> Report`` replaces grading with ``session`` (the server and the sandbox do that).
    """
    from grader import flow, live

    stream = sys.stderr
    line = live.LiveLine(flow.label(path, exercise_id), live.mode_for(stream, quiet), stream)
    try:
        graded = flow.grade_and_record(path, exercise_id, progress,
                                       grade or flow.here(session, options, path, exercise_id),
                                       on_event=line.event, quiet=quiet)
    finally:
        line.done()
    for note in graded.notes:
        if not note.startswith("ddp-grade: progress was not saved") or not getattr(progress, "told_unsaved", False):
            click.echo(note, err=True)
    if progress.unsaved:
        progress.told_unsaved = True  # once per command (watch grades again and again)
    return graded.report


def _require_readable(path: str) -> None:
    """Exit 2 with the reason (the path named) unless ``path`` is a file that can be read."""
    from grader import learner

    try:
        learner.read_source(path)
    except learner.Unusable as exc:
        _fail(str(exc))


def _exercise_of(path: str, exercise_id: str | None):
    """The exercise a file is graded as, or None when its name does not say (the grading will)."""
    from grader import catalog

    return catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)


def _color() -> bool:
    return sys.stdout.isatty()


def _fail(message: str, code: int = EXIT_UNUSABLE):
    """One line on stderr and the exit code: never a traceback for input the user can fix."""
    click.echo(f"ddp-grade: error: {message}", err=True)
    raise SystemExit(code)


def _kit_call(fn):
    try:
        return fn()
    except kit.KitError as exc:
        _fail(str(exc))


def _say_unsaved(progress: prog.Progress, what: str) -> None:
    """One line on stderr when a change to progress could not be saved (the command still did its work)."""
    if progress.unsaved and not getattr(progress, "told_unsaved", False):
        progress.told_unsaved = True  # once per command (watch grades again and again)
        click.echo(f"ddp-grade: progress was not saved ({progress.unsaved}); {what} is not remembered. "
                   f"Set DDP_GRADE_STATE_DIR to a folder you can write.", err=True)


def _progress() -> prog.Progress:
    p = prog.Progress()
    if p.warning():
        click.echo(p.warning(), err=True)
    return p


def _next_exercise_path(progress: prog.Progress) -> str | None:
    rows = _kit_call(lambda: prog.rows(progress))
    nxt = prog.next_row(rows)
    if nxt is None:
        return None
    return str(nxt.path)


def _exercise_arg(value: str | None, progress: prog.Progress):
    """(exercise, path) for an argument "03", "3", "03_train" or a path; the next unfinished one when None."""
    from grader import catalog

    if value is None:
        path = _next_exercise_path(progress)
        if path is None:
            _fail("every exercise has passed; name one, e.g. 01", EXIT_OK)
        return catalog.from_filename(path), path
    if os.path.isfile(value):
        ex = catalog.from_filename(value)
        if ex is None:
            _fail(f"cannot tell which exercise {os.path.basename(value)} is: name it like 03_train.py")
        return ex, value
    ex = _kit_call(lambda: kit.require_exercise(value))
    return ex, str(_kit_call(lambda: kit.exercise_path(ex)))


@main.command("list")
def list_command():
    """Every exercise with its status (not started, in progress, passed); the next one is marked."""
    from grader.commands import listing

    progress = _progress()
    rows = _kit_call(lambda: prog.rows(progress))
    click.echo(listing.render(rows, color=_color()))


@main.command()
@click.argument("exercise_id", metavar="NN", required=False)
@click.option("--again", is_flag=True, help="Show the last hint again instead of the next level.")
@click.option("--check", "check_id", metavar="CHECK", help="The hint for one check (its id from the report).")
def hint(exercise_id, again, check_id):
    """The next hint for exercise NN: a nudge, then the API to use, then the shape of the code.

    How many hints were shown is remembered; each call shows the next level.
    Without NN: the next unfinished exercise.
    """
    from grader.commands import hints

    progress = _progress()
    ex, _ = _exercise_arg(exercise_id, progress)
    try:
        click.echo(hints.hint_text(ex, progress, again=again, check_id=check_id))
    except ValueError as exc:
        _fail(str(exc))
    _say_unsaved(progress, "which hints were shown")


@main.command()
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
    from grader import catalog, grading, harness
    from grader.commands.watch import watch_loop
    from grader.report import render_text

    progress = _progress()
    if target is not None and os.path.lexists(target):
        _require_readable(target)
    elif target is not None and exercise_id is None and not re.fullmatch(r"\d{1,2}(_\w+)?", target):
        _fail(f"no such file: {target}")
    ex, path = _exercise_arg(target, progress)
    if exercise_id:
        ex = _kit_call(lambda: kit.require_exercise(exercise_id))
    tty = _color()
    try:
        grading.warm_up(dynamo=ex.preload_dynamo if ex else True, exercises=[ex])
    except KeyboardInterrupt:
        _stopped_watching()

    with harness.Session(limits=options.limits, spares=True) as session:
        def once(n: int) -> None:
            report = grade_and_record(path, session, options, exercise_id, progress, quiet)
            if tty:
                click.clear()
            click.echo(render_text(report, color=tty))
            stamp = __import__("time").strftime("%H:%M:%S")
            click.echo(f"\n[{stamp}] grading {n} of {path}; save the file to grade again, Ctrl-C to stop.")
            if report.status == "passed" and catalog.by_id(report.exercise or "") is not None:
                nxt = prog.next_row(_kit_call(lambda: prog.rows(progress)))
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


@main.command()
@click.argument("exercise_id", metavar="NN")
@click.option("--diff", "as_diff", is_flag=True, help="Show the differences from your file instead of the whole file.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation when the exercise has not passed.")
def solution(exercise_id, as_diff, yes):
    """Show the reference solution of exercise NN (or, with --diff, how it differs from yours).

    Asks first when NN has not passed yet.
    """
    from grader.commands import files

    progress = _progress()
    ex = _kit_call(lambda: kit.require_exercise(exercise_id))
    if not yes and not progress.passed(ex.id):
        try:
            ok = click.confirm(f"Exercise {ex.id} has not passed yet. Show the reference solution anyway?",
                               default=False, err=True)
        except click.Abort:  # end of input or Ctrl-C: the answer is no
            click.echo("", err=True)
            ok = False
        if not ok:
            click.echo("Not shown. `ddp-grade hint " + ex.id + "` gives the next hint instead.")
            raise SystemExit(EXIT_OK)
    if as_diff:
        text = _kit_call(lambda: files.solution_diff(ex))
        click.echo(text if text else "Your file is the same as the reference solution.")
    else:
        click.echo(_kit_call(lambda: files.solution_text(ex)), nl=False)


@main.command()
@click.argument("exercise_id", metavar="NN")
def reset(exercise_id):
    """Put the stub of exercise NN back, as shipped. Your file is first copied aside (see `restore`)."""
    from grader.commands import files

    progress = _progress()
    ex = _kit_call(lambda: kit.require_exercise(exercise_id))
    written = _kit_call(lambda: files.reset(ex, progress))
    _say_unsaved(progress, "that the exercise starts over")
    if written.saved_as:
        click.echo(f"Your file was saved as {written.saved_as}")
    click.echo(f"Exercise {ex.id} reset in the kit at {kit.root()}: {written.path} is the stub again. "
               f"`ddp-grade restore {ex.id}` undoes this.")


@main.command()
@click.argument("exercise_id", metavar="NN")
@click.option("--from", "source", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="This saved copy instead of the newest one.")
@click.option("--list", "list_copies", is_flag=True, help="List the saved copies of NN and exit.")
def restore(exercise_id, source, list_copies):
    """Put back the newest saved copy of exercise NN (made by `reset`); the current file is saved first."""
    from pathlib import Path

    from grader.commands import files

    ex = _kit_call(lambda: kit.require_exercise(exercise_id))
    if list_copies:
        copies = kit.backups_of(ex)
        click.echo("\n".join(str(p) for p in copies) if copies else f"No saved copies of exercise {ex.id}.")
        return
    written, used = _kit_call(lambda: files.restore(ex, Path(source) if source else None))
    if written.saved_as:
        click.echo(f"Your current file was saved as {written.saved_as}")
    click.echo(f"Restored {written.path} from {used} (the kit at {kit.root()})")


@main.command()
@click.option("--exercise", "exercise_id", metavar="NN", help="This exercise (default: the first not passed).")
@click.option("--minutes", type=click.FloatRange(min=0.1, max=600), default=None,
              help="Time for the code (default: the exercise's budget from the catalog).")
@click.option("--questions", "n_questions", type=click.IntRange(min=0, max=20), default=3, show_default=True,
              help="Quiz questions after the code.")
@click.option("--seed", type=int, default=None, help="Seed for choosing the questions.")
@click.option("--track", type=click.Choice(["any", "write", "debug"]), default="any", show_default=True,
              help="Draw from the writing exercises, the debugging track (a broken job to fix), or either "
                   "(catalog order: the debugging track once every writing exercise has passed).")
@grading_options
def interview(exercise_id, minutes, n_questions, seed, track, options):
    """A timed mock interview: one exercise not yet passed, then a few quiz questions.

    The clock starts at once. Edit the exercise file in your editor; press Enter to
    grade, h for a hint (counted in the summary), q to finish. It ends with a final
    grading, the questions, the time used and a summary. With --track debug the exercise
    is a broken training job: "our DDP job hangs after the first epoch, what do you check?"
    """
    from grader import grading, harness
    from grader.commands import interview as iv
    from grader.report import render_text
    from grader.state import StateFile

    progress = _progress()
    if exercise_id:
        ex = _kit_call(lambda: kit.require_exercise(exercise_id))
    else:
        ex = _kit_call(lambda: iv.pick_exercise(progress, lambda e: kit.exercise_path(e).exists(), track))
        if ex is None:
            which = "every exercise" if track == "any" else f"every exercise of the {track} track"
            _fail(f"{which} has passed; pick one with --exercise NN", EXIT_UNUSABLE)
    path = str(_kit_call(lambda: kit.exercise_path(ex)))
    if not os.path.exists(path):
        _fail(f"no such file: {path} (`ddp-grade reset {ex.id}` puts the stub back)")
    quiz_state = StateFile("quiz.json")
    from grader.quiz.session import clean_progress

    questions = iv.pick_questions(ex, n_questions, seed if seed is not None else iv.default_seed(),
                                  clean_progress(quiz_state.load()))
    grading.warm_up(dynamo=ex.preload_dynamo, exercises=[ex])

    def read_line(prompt: str) -> str:
        click.echo(prompt, nl=False)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    with harness.Session(limits=options.limits, spares=True) as session:
        run = iv.Interview(
            ex, path, minutes if minutes is not None else ex.minutes, questions,
            grade=lambda: grade_and_record(path, session, options, None, progress, quiet=False),
            read_line=read_line, echo=click.echo, render_report=lambda r: render_text(r, color=_color()),
            progress=progress, quiz_state=quiz_state)
        try:
            out = run.run()
        except KeyboardInterrupt:
            click.echo("\nInterview stopped.")
            raise SystemExit(EXIT_INTERRUPTED)
    click.echo(iv.summary(out))
    raise SystemExit(EXIT_OK if out.passed else EXIT_FAILED)


@main.command()
@click.option("--no-group", is_flag=True, help="Skip starting a test process group (faster).")
def doctor(no_group):
    """Check this machine: Python, torch, gloo/NCCL, GPUs, state folder, and a real 2-rank process group.

    Exit 0 when grading can work here, 1 when something needs fixing.
    """
    from grader.commands import doctor as doc

    found = doc.findings(run_group=not no_group)
    click.echo(doc.render(found))
    raise SystemExit(EXIT_OK if doc.healthy(found) else EXIT_FAILED)


@main.group("server")
def server_group():
    """The warm grading server that `ddp-grade FILE` starts in the background.

    It keeps a pool of processes with torch imported so the next gradings start at once; it
    stops by itself after 10 idle minutes (DDP_GRADE_SERVER_IDLE_S), and never runs with
    `--no-server` or DDP_GRADE_SERVER=0.
    """


@server_group.command("status")
def server_status():
    """Whether a server runs for this state folder, its pid and gradings served (exit 0 either way)."""
    from grader import server

    click.echo(_server_line(server.status()))
    raise SystemExit(EXIT_OK)


@server_group.command("stop")
def server_stop():
    """Stop the server now (exit 0, also when none was running)."""
    from grader import server

    if server.stop():
        click.echo(f"stopped the grading server ({server.socket_path()})")
    else:
        click.echo("no grading server is running")
    raise SystemExit(EXIT_OK)


def _server_line(found: dict) -> str:
    if not found["running"]:
        return f"no grading server is running (it would listen on {found['socket']})"
    if found.get("refused"):
        return f"a grading server listens on {found['socket']} but refused this command: {found['refused']}"
    state = "current code" if found["current"] else "older code (it exits at the next grading)"
    return (f"a grading server is running: pid {found['pid']}, {state}, {found['gradings']} grading(s) served, "
            f"socket {found['socket']}; `ddp-grade server stop` stops it")


# Subcommands that live in their own modules, one line each.
from grader.quiz.command import quiz  # noqa: E402
from grader.batch import batch  # noqa: E402
from grader.gradescope import gradescope  # noqa: E402
from grader.commands.plan import plan_command  # noqa: E402

main.add_command(quiz)
main.add_command(batch)
main.add_command(gradescope)
main.add_command(plan_command)
