"""``ddp-grade server status|stop``: the warm grading server that ``ddp-grade FILE`` starts in the background."""

from __future__ import annotations

import click

from grader.exits import EXIT_OK


@click.group("server")
def server_group():
    """The warm grading server that `ddp-grade FILE` starts in the background.

    It keeps a pool of processes with torch imported so the next gradings start at once; it
    stops by itself after 10 idle minutes (DDP_GRADE_SERVER_IDLE_S), and never runs with
    `--no-server` or DDP_GRADE_SERVER=0.
    """


@server_group.command("status")
def server_status():
    """Whether a server runs for this state folder, its pid and gradings served (exit 0 either way)."""
    from grader import server

    click.echo(_server_line(server.status()))
    raise SystemExit(EXIT_OK)


@server_group.command("stop")
def server_stop():
    """Stop the server now (exit 0, also when none was running)."""
    from grader import server

    if server.stop():
        click.echo(f"stopped the grading server ({server.socket_path()})")
    else:
        click.echo("no grading server is running")
    raise SystemExit(EXIT_OK)


def _server_line(found: dict) -> str:
    if not found["running"]:
        return f"no grading server is running (it would listen on {found['socket']})"
    if found.get("refused"):
        return f"a grading server listens on {found['socket']} but refused this command: {found['refused']}"
    state = "current code" if found["current"] else "older code (it exits at the next grading)"
    return (f"a grading server is running: pid {found['pid']}, {state}, {found['gradings']} grading(s) served, "
            f"socket {found['socket']}; `ddp-grade server stop` stops it")
