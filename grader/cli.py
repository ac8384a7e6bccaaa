"""The ``ddp-grade`` command line. Commands only parse options and render; the work is elsewhere.

Exit codes (every command):
  0  everything passed / the command did what was asked
  1  a check failed (or a quiz answer was wrong, for scripted quizzes)
  2  the input could not be used: missing path, syntax error, missing function,
     unknown exercise or topic, bad option value, unreadable answers file
  3  grading timed out (a deadlock or an endless loop in the submission)
  130 interrupted with Ctrl-C (progress so far is saved)
"""

from __future__ import annotations

import click

from grader import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNUSABLE = 2
EXIT_TIMEOUT = 3
EXIT_INTERRUPTED = 130


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
      ddp-grade exercises/03_train.py     grade one file
      ddp-grade quiz -n 5                 five quiz questions
    """


def grading_options(f):
    """--world-size, --backend, --timeout: shared by every command that grades."""
    f = click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=60, show_default=True,
                     help="Seconds for grading one file; a run past it is stopped (exit 3).")(f)
    f = click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
                     help="auto: nccl when there is one GPU per rank, else gloo.")(f)
    f = click.option("--world-size", "world_size", type=click.IntRange(min=1, max=64), default=None,
                     help="Ranks per run (default: the exercise's, 2; an odd size is tried too where it matters).")(f)
    return f


def format_option(f):
    return click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
                        help="json: the machine-readable report described in the README.")(f)


@main.command()
@click.argument("path", required=False, type=click.Path(dir_okay=True, file_okay=True, path_type=str))
@click.option("--exercise", "exercise_id", metavar="NN", help="Grade PATH as exercise NN (default: from the file name).")
@grading_options
@format_option
@click.option("-v", "--verbose", is_flag=True, help="Show every detail, also of passing runs.")
def grade(path, exercise_id, world_size, backend, timeout_s, fmt, verbose):
    """Grade one exercise file (this is also what `ddp-grade PATH` does).

    \b
    Example:
      ddp-grade grade exercises/03_train.py --world-size 2 --backend gloo
    """
    from grader import harness
    from grader.grading import GradeOptions, grade_file
    from grader.report import render_json, render_text

    if path is None:
        raise click.UsageError("give the exercise file to grade, e.g. ddp-grade exercises/01_setup.py")
    harness.warm_up(ddp=_builds_ddp(path, exercise_id))
    options = GradeOptions(world_size=world_size, backend=backend, timeout_s=timeout_s)
    with harness.Session() as session:
        report = grade_file(path, session, options, exercise_id)
    if fmt == "json":
        click.echo(render_json(report))
    else:
        click.echo(render_text(report, color=_color(), verbose=verbose))
    raise SystemExit(report.exit_code)


def _builds_ddp(path: str, exercise_id: str | None) -> bool:
    from grader import catalog

    exercise = catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)
    return exercise is None or exercise.builds_ddp


def _color() -> bool:
    import sys

    return sys.stdout.isatty()


# Subcommands that live in their own modules, one line each.
from grader.quiz.command import quiz  # noqa: E402

main.add_command(quiz)
