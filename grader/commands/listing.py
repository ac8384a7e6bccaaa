"""``ddp-grade list``: every exercise by track, with its minutes and status, each track's progress, the
next one marked; no line wider than the terminal (80 columns where it does not say)."""

from __future__ import annotations

import os
import shutil

import click

from grader import progress as prog

_COLOURS = {prog.PASSED: "green", prog.IN_PROGRESS: "yellow", prog.NOT_STARTED: None, prog.MISSING: "bright_black"}

# The tracks, by the tens of an exercise's number: 01-10, 11-19, 21-29, 31-34, 41-43.
TRACKS = {
    0: ("Data parallel", "one model copy per rank, gradients averaged"),
    1: ("Beyond data parallel", "sharding, tensor, pipeline, context and expert parallelism"),
    2: ("Debugging", "a training job that misbehaves, a colleague's report at its top: fix it"),
    3: ("Production APIs", "FSDP2, DTensor, distributed checkpoints, torch.distributed.pipelining"),
    4: ("Capacity planning", "napkin math: memory, traffic and the plan for a big model"),
    5: ("Hiding communication", "the next transfer issued before this computation, waited for only when needed"),
}
WIDEST = 100  # a wider terminal gets no wider list


def track_of(exercise_id: str) -> int:
    """The track of an exercise by its number: 1-10 -> 0, 11-20 -> 1, 21-30 -> 2, ..."""
    try:
        return (int(exercise_id) - 1) // 10
    except ValueError:
        return len(TRACKS)


def terminal_width() -> int:
    """The terminal's width (COLUMNS where set), 80 where it cannot be told, at most WIDEST."""
    return max(60, min(WIDEST, shutil.get_terminal_size((80, 24)).columns))


def render(rows: list[prog.Row], color: bool = False, width: int | None = None) -> str:
    width = width or terminal_width()
    nxt = prog.next_row(rows)
    # mark, id, title, minutes, status, notes: "-> 01  Title...  15 min  in progress  hints 1/3  solution seen"
    title_width = width - len("-> 01  ") - len("  15 min  ") - len("in progress")
    lines: list[str] = []
    tracks: dict[int, list[prog.Row]] = {}
    for r in rows:
        tracks.setdefault(track_of(r.exercise.id), []).append(r)
    for track, members in tracks.items():
        name, about = TRACKS.get(track, ("More", ""))
        done = sum(r.status == prog.PASSED for r in members)
        numbers = f"{members[0].exercise.id}-{members[-1].exercise.id}" if len(members) > 1 else members[0].exercise.id
        if lines:
            lines.append("")
        heading = f"{name} ({numbers}): {done}/{len(members)} passed"
        lines.append(click.style(heading, bold=True) if color else heading)
        if about:
            lines.append(_fit(f"   {about}", width))
        for r in members:
            mark = "->" if nxt is not None and r is nxt else "  "
            notes = ([f"hints {r.hints_shown}/{len(r.exercise.hints)}"] if r.hints_shown else []) \
                + (["solution seen"] if r.solution_seen else [])
            hints = "".join(f"  {note}" for note in notes)
            title = r.exercise.title.removeprefix("Debug: ")  # the track's heading says so
            title = _fit(title, title_width - len(hints)).ljust(title_width - len(hints))
            status = r.status.ljust(11)
            if color and _COLOURS.get(r.status):
                status = click.style(status, fg=_COLOURS[r.status])
            lines.append(f"{mark} {r.exercise.id}  {title}  {r.exercise.minutes:>2} min  {status}{hints}".rstrip())
    done = sum(r.status == prog.PASSED for r in rows)
    lines.append("")
    lines.append(f"{done}/{len(rows)} passed.")
    if nxt is not None:
        where = _relative(nxt.path)
        lines += _wrap(f"Next: {nxt.exercise.id} ({where}). Run `ddp-grade` to grade it, `ddp-grade watch` to "
                       f"re-grade on every save, `ddp-grade hint {nxt.exercise.id}` when stuck.", width)
    elif done == len(rows):
        lines += _wrap("Every exercise passed. Try `ddp-grade interview` or `ddp-grade quiz`.", width)
    return "\n".join(lines)


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3].rstrip() + "..."


def _relative(path) -> str:
    """``path`` from the current folder when it lies below it (exercises/01_setup.py), else as it is."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return str(path) if relative.startswith("..") else relative


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, break_on_hyphens=False)
