"""``ddp-grade reset NN``: the stub of an exercise back, as shipped, the learner's file copied aside."""

from __future__ import annotations

import click

from grader import kit
from grader.cli.common import kit_call, load_progress, say_unsaved


@click.command()
@click.argument("exercise_id", metavar="NN")
def reset(exercise_id):
    """Put the stub of exercise NN back, as shipped. Your file is first copied aside (see `restore`)."""
    from grader.commands import files

    progress = load_progress()
    ex = kit_call(lambda: kit.require_exercise(exercise_id))
    written = kit_call(lambda: files.reset(ex, progress))
    say_unsaved(progress, "that the exercise starts over")
    if written.saved_as:
        click.echo(f"Your file was saved as {written.saved_as}")
    click.echo(f"Exercise {ex.id} reset in the kit at {kit.root()}: {written.path} is the stub again. "
               f"`ddp-grade restore {ex.id}` undoes this.")
