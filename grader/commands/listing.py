"""``ddp-grade list``: every exercise with its status, the next one marked."""

from __future__ import annotations

import click

from grader import progress as prog

_COLOURS = {prog.PASSED: "green", prog.IN_PROGRESS: "yellow", prog.NOT_STARTED: None, prog.MISSING: "bright_black"}


def render(rows: list[prog.Row], color: bool = False) -> str:
    nxt = prog.next_row(rows)
    width = max(len(r.exercise.title) for r in rows)
    lines = []
    for r in rows:
        if r.exercise.is_debug and not any(line.startswith("Debugging track") for line in lines):
            lines += ["", "Debugging track: a training job that misbehaves, a colleague's report at its top; fix it."]
        mark = "->" if nxt is not None and r is nxt else "  "
        status = r.status.ljust(11)
        if color and _COLOURS.get(r.status):
            status = click.style(status, fg=_COLOURS[r.status])
        hints = f"  hints {r.hints_shown}/{len(r.exercise.hints)}" if r.hints_shown else ""
        lines.append(f"{mark} {r.exercise.id}  {r.exercise.title.ljust(width)}  {status}{hints}".rstrip())
    done = sum(r.status == prog.PASSED for r in rows)
    lines.append("")
    lines.append(f"{done}/{len(rows)} passed.")
    if nxt is not None:
        lines.append(f"Next: {nxt.exercise.id} ({nxt.path}). Run `ddp-grade` to grade it, "
                     f"`ddp-grade watch` to re-grade on every save, `ddp-grade hint {nxt.exercise.id}` when stuck.")
    elif done == len(rows):
        lines.append("Every exercise passed. Try `ddp-grade interview` or `ddp-grade quiz`.")
    return "\n".join(lines)
