"""``ddp-grade grade [PATH]`` (also ``ddp-grade PATH``): grade one exercise file and show the report."""

from __future__ import annotations

import os
import re

import click

from grader import flow, kit
from grader.cli.common import color, echo_notes, fail, kit_call, load_progress, next_exercise_path
from grader.cli.options import format_option, grading_options, quiet_option
from grader.exits import EXIT_INTERRUPTED, EXIT_OK


@click.command()
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
    from grader.report import render_json, render_junit, render_text

    progress = load_progress()
    if path is None:
        path = next_exercise_path(progress)
        if path is None:
            click.echo("Every exercise has passed. Try `ddp-grade interview` or `ddp-grade quiz`.")
            raise SystemExit(EXIT_OK)
    elif not os.path.exists(path) and re.fullmatch(r"\d{1,2}", path):
        path = str(kit_call(lambda: kit.exercise_path(kit.require_exercise(path))))
    try:
        graded = flow.grade(path, options, exercise_id, progress, quiet=quiet, server=not no_server, sandbox=sandbox)
    except flow.Refused as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # the ranks are already stopped and the temp folder removed
        click.echo("ddp-grade: interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    report = echo_notes(graded, progress)
    if graded.started_server and not quiet:  # the next grading finds a warm pool
        click.echo("ddp-grade: started a grading server in the background to keep the next gradings warm; "
                   "it stops after 10 idle minutes, or now with `ddp-grade server stop`.", err=True)
    if fmt == "json":
        click.echo(render_json(report))
    else:
        click.echo(render_text(report, color=color(), verbose=verbose))
    if junit_path:
        try:
            with open(junit_path, "w", encoding="utf-8") as f:
                f.write(render_junit(report))
        except OSError as exc:
            fail(f"cannot write {junit_path}: {exc.strerror or exc}")
    if trace_path:
        _write_trace(trace_path, report)
    raise SystemExit(report.exit_code)


def _write_trace(path: str, report) -> None:
    """--trace: the report's timelines as a page or a Chrome trace (exit 2 when the file cannot be written)."""
    from grader import timeline_view
    from grader.report import problem_of

    data = report.to_dict()
    data["problem"] = problem_of(report) or ""  # the same words as the terminal's, at the top of the page
    try:
        runs = timeline_view.write(path, data)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")
    if not runs:
        click.echo(f"ddp-grade: {path} holds no lanes: no rank recorded a timeline in this grading", err=True)
    else:
        click.echo(timeline_view.where_written(path, runs), err=True)
