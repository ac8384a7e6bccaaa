"""``ddp-grade hint NN``: the next hint level (a nudge, then the API, then the shape of the code)."""

from __future__ import annotations

from grader import catalog
from grader.progress import Progress

LEVEL_NAMES = {1: "a nudge", 2: "the API to use", 3: "the shape of the code"}


def hint_text(ex: catalog.Exercise, progress: Progress, again: bool = False, check_id: str | None = None) -> str:
    """The next hint of ``ex`` (or, with ``check_id``, that check's hint), counting it as shown."""
    lines = []
    if check_id:
        try:
            info = ex.check(check_id)
        except KeyError:
            known = ", ".join(c.id for c in ex.checks)
            raise ValueError(f"exercise {ex.id} has no check {check_id!r}; its checks: {known}") from None
        lines.append(f"Exercise {ex.id}, check {info.id}: {info.title}")
        lines.append(f"  {info.hint or 'no hint for this check'}")
        return "\n".join(lines)
    shown = progress.next_hint(ex, again=again)
    if shown is None:
        return f"Exercise {ex.id} has no hints."
    level, text = shown
    total = len(ex.hints)
    name = LEVEL_NAMES.get(level, f"level {level}")
    lines.append(f"Exercise {ex.id}: {ex.title} - hint {level}/{total} ({name})")
    lines.append("")
    lines.append(_wrap(text))
    lines.append("")
    if level < total:
        lines.append(f"Run `ddp-grade hint {ex.id}` again for the next level.")
    else:
        lines.append(f"That was the last hint. `ddp-grade solution {ex.id}` shows the reference solution.")
    return "\n".join(lines)


def _wrap(text: str) -> str:
    import textwrap

    return "\n".join(textwrap.fill(par, 88, initial_indent="  ", subsequent_indent="  ")
                     for par in text.split("\n") if par.strip())
