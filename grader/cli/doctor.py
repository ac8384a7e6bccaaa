"""``ddp-grade doctor``: whether grading can work on this machine."""

from __future__ import annotations

import click

from grader.exits import EXIT_FAILED, EXIT_OK


@click.command()
@click.option("--no-group", is_flag=True, help="Skip starting a test process group (faster).")
def doctor(no_group):
    """Check this machine: Python, torch, gloo/NCCL, GPUs, state folder, and a real 2-rank process group.

    Exit 0 when grading can work here, 1 when something needs fixing.
    """
    from grader.commands import doctor as doc

    found = doc.findings(run_group=not no_group)
    click.echo(doc.render(found))
    raise SystemExit(EXIT_OK if doc.healthy(found) else EXIT_FAILED)
