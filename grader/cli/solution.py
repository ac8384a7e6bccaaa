"""``ddp-grade solution NN``: the reference solution of an exercise, or how it differs from the learner's."""

from __future__ import annotations

import click

from grader import kit
from grader.cli.common import kit_call, load_progress, say_unsaved
from grader.exits import EXIT_OK


@click.command()
@click.argument("exercise_id", metavar="NN")
@click.option("--diff", "as_diff", is_flag=True, help="Show the differences from your file instead of the whole file.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation when the exercise has not passed.")
def solution(exercise_id, as_diff, yes):
    """Show the reference solution of exercise NN (or, with --diff, how it differs from yours).

    Asks first when NN has not passed yet; when it has not, `ddp-grade list` shows beside its pass that the
    solution was seen first.
    """
    from grader.commands import files

    progress = load_progress()
    ex = kit_call(lambda: kit.require_exercise(exercise_id))
    if not yes and not progress.passed(ex.id):
        try:
            ok = click.confirm(f"Exercise {ex.id} has not passed yet. Show the reference solution anyway? "
                               "(`ddp-grade list` will show that you saw it)", default=False, err=True)
        except click.Abort:  # end of input or Ctrl-C: the answer is no
            click.echo("", err=True)
            ok = False
        if not ok:
            click.echo("Not shown. `ddp-grade hint " + ex.id + "` gives the next hint instead.")
            raise SystemExit(EXIT_OK)
    text = kit_call(lambda: files.solution_diff(ex) if as_diff else files.solution_text(ex))
    progress.record_solution_shown(ex.id)
    say_unsaved(progress, "that the solution was seen")
    if as_diff:
        click.echo(text if text else "Your file is the same as the reference solution.")
    else:
        click.echo(text, nl=False)
