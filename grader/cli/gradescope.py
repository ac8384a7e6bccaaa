"""``ddp-grade gradescope build|run``: write a Gradescope autograder bundle, and what the bundle runs
(:mod:`grader.gradescope`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from grader import catalog
from grader.cli.options import grading_options
from grader.exits import EXIT_UNUSABLE
from grader.gradescope import SANDBOX, TORCH_VERSION, VISIBILITY, build, run


@click.group()
def gradescope():
    """Grade on Gradescope: build an autograder bundle (`build`); `run` is what the bundle runs."""


def _exercise_list(value: str | None) -> list[catalog.Exercise]:
    if not value:
        return list(catalog.exercises())
    chosen = []
    for item in value.split(","):
        ex = catalog.by_id(item.strip()) if item.strip() else None
        if ex is None:
            known = ", ".join(e.id for e in catalog.exercises())
            raise click.BadParameter(f"unknown exercise {item.strip()!r}: choose from {known}",
                                     param_hint="--exercises")
        if ex not in chosen:
            chosen.append(ex)
    return chosen


@gradescope.command("build")
@click.option("--exercises", "exercise_ids", metavar="NN,NN,...",
              help="The exercises the assignment grades (default: all), e.g. 01,03.")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path), default="autograder.zip",
              show_default=True, help="Where to write the bundle.")
@grading_options
@click.option("--sandbox", type=click.Choice(SANDBOX), default="auto", show_default=True,
              help="auto: grade in a sandbox when bwrap or unshare works in Gradescope's image; on: only so "
                   "(no results otherwise); off: never.")
@click.option("--visibility", type=click.Choice(VISIBILITY), default="visible", show_default=True,
              help="When students see the tests (Gradescope's setting, per test).")
def build_command(exercise_ids, out, options, sandbox, visibility):
    """Write a Gradescope autograder bundle (upload it as the assignment's autograder).

    setup.sh installs Python, torch {torch} for CPU and the kit; run_autograder grades the
    submission's NN_*.py files and writes results.json: one test per check, scored with the
    catalog's points. Choose an Ubuntu 22.04 or newer base image.

    \b
    Example:
      ddp-grade gradescope build --exercises 01,03 -o autograder.zip
    """
    exercises = _exercise_list(exercise_ids)
    try:
        names = build(out, exercises, options, sandbox, visibility)
    except OSError as exc:
        click.echo(f"ddp-grade: error: cannot write {out}: {exc.strerror or exc}", err=True)
        raise SystemExit(EXIT_UNUSABLE)
    points = sum(c.points for ex in exercises for c in ex.checks)
    click.echo(f"Wrote {out} ({len(names)} files): exercises {', '.join(ex.id for ex in exercises)}, "
               f"{points:g} points in all (set the assignment's total to this).")


build_command.help = build_command.help.replace("{torch}", TORCH_VERSION)


@gradescope.command("run")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default="/autograder", show_default=True,
              help="The autograder folder: source/, submission/, results/.")
def run_command(root):
    """Grade ROOT/submission as the bundle says and write ROOT/results/results.json (what run_autograder does).

    Exit 0 whenever results.json was written, whatever the submission's grade; 2 when the
    bundle itself cannot be used (then no results are written).
    """
    code = run(root, echo=lambda text: click.echo(text))
    sys.stdout.flush()
    raise SystemExit(code)
