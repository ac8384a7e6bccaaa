"""``ddp-grade list``: every exercise with its status, the next one marked."""

from __future__ import annotations

import click

from grader import progress as prog
from grader.cli.common import color, kit_call, load_progress


@click.command("list")
def list_command():
    """Every exercise with its status (not started, in progress, passed); the next one is marked."""
    from grader.commands import listing

    progress = load_progress()
    rows = kit_call(lambda: prog.rows(progress))
    click.echo(listing.render(rows, color=color()))
