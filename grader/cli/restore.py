"""``ddp-grade restore NN``: the newest copy ``reset`` saved, back in place."""

from __future__ import annotations

import click

from grader import kit
from grader.cli.common import kit_call, load_progress, say_unsaved


@click.command()
@click.argument("exercise_id", metavar="NN")
@click.option("--from", "source", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="This saved copy instead of the newest one.")
@click.option("--list", "list_copies", is_flag=True, help="List the saved copies of NN and exit.")
def restore(exercise_id, source, list_copies):
    """Put back the newest saved copy of exercise NN (made by `reset`); the current file is saved first."""
    from pathlib import Path

    from grader.commands import files

    ex = kit_call(lambda: kit.require_exercise(exercise_id))
    if list_copies:
        copies = kit.backups_of(ex)
        click.echo("\n".join(str(p) for p in copies) if copies else f"No saved copies of exercise {ex.id}.")
        return
    progress = load_progress()
    was_passed = progress.passed(ex.id)
    written, used = kit_call(lambda: files.restore(ex, Path(source) if source else None, progress))
    if written.saved_as:
        click.echo(f"Your current file was saved as {written.saved_as}")
    click.echo(f"Restored {written.path} from {used} (the kit at {kit.root()})")
    if progress.passed(ex.id) and not was_passed:
        say_unsaved(progress, "that the exercise passed")
        click.echo(f"Exercise {ex.id} is passed again: this is the file that passed before `ddp-grade reset {ex.id}`.")
