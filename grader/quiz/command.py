"""``ddp-grade quiz`` (placeholder until the quiz lands)."""

import click


@click.command()
def quiz():
    """Answer multiple-choice questions on DDP in the terminal."""
    raise click.ClickException("the quiz is not available yet")
