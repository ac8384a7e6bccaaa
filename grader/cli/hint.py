"""``ddp-grade hint [NN]``: the next hint for an exercise, level by level."""

from __future__ import annotations

import click

from grader.cli.common import exercise_arg, fail, load_progress, say_unsaved


@click.command()
@click.argument("exercise_id", metavar="NN", required=False)
@click.option("--again", is_flag=True, help="Show the last hint again instead of the next level.")
@click.option("--check", "check_id", metavar="CHECK", help="The hint for one check (its id from the report).")
def hint(exercise_id, again, check_id):
    """The next hint for exercise NN: a nudge, then the API to use, then the shape of the code.

    How many hints were shown is remembered; each call shows the next level.
    Without NN: the next unfinished exercise.
    """
    from grader.commands import hints

    progress = load_progress()
    ex, _ = exercise_arg(exercise_id, progress)
    try:
        click.echo(hints.hint_text(ex, progress, again=again, check_id=check_id))
    except ValueError as exc:
        fail(str(exc))
    say_unsaved(progress, "which hints were shown")
