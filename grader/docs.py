"""What is generated from the catalog and the exercise files, never edited by hand.

    python -m grader.docs            print the README's tables
    python -m grader.docs --write    rewrite them in README.md between their markers, and write
                                     grader/stubs/ (the packaged copies of exercises/, for `reset`)

``exercises/NN_slug.py`` is the one source of each stub. The package carries a generated copy
in ``grader/stubs/`` because the learner edits ``exercises/`` in place (the kit is installed
editable), so ``reset`` and "not started" need the file as shipped from somewhere else, and
must work without git.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grader import catalog

START, END = "<!-- checks:start -->", "<!-- checks:end -->"
EXERCISES_START, EXERCISES_END = "<!-- exercises:start -->", "<!-- exercises:end -->"


def exercises_markdown() -> str:
    """The table of exercises: id, file, the names to write, what it practises."""
    out = ["| # | file | you write | topic |", "|---|---|---|---|"]
    for ex in catalog.exercises():
        functions = ", ".join(f"`{f}`" for f in ex.functions)
        out.append(f"| {ex.id} | `exercises/{ex.filename}` | {functions} | {ex.summary} |")
    return "\n".join(out) + "\n"


def checks_markdown() -> str:
    """One section per exercise: what to write, then each check id and what it establishes."""
    out = []
    for ex in catalog.exercises():
        functions = ", ".join(f"`{f}`" for f in ex.functions)
        out.append(f"#### {ex.id} · {ex.title}\n")
        out.append(f"`exercises/{ex.filename}` — write {functions}.\n")
        out.append("| check | passes when |")
        out.append("|---|---|")
        for c in ex.checks:
            out.append(f"| `{c.id}` | {c.title} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def replace_section(readme: str) -> str:
    """The README with both generated tables rewritten from the catalog."""
    for start, end, make in ((START, END, checks_markdown), (EXERCISES_START, EXERCISES_END, exercises_markdown)):
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        readme = pattern.sub(lambda _m, s=start, e=end, f=make: f"{s}\n{f()}{e}", readme)
    return readme


ROOT = Path(__file__).resolve().parent.parent
STUBS = Path(__file__).resolve().parent / "stubs"


def write_stubs(root: Path = ROOT, stubs: Path = STUBS) -> list[str]:
    """Copy each catalogued ``exercises/NN_slug.py`` into ``grader/stubs/``; drop stale copies."""
    written = []
    wanted = {ex.filename for ex in catalog.exercises()}
    for name in sorted(wanted):
        source = root / "exercises" / name
        if source.exists():
            (stubs / name).write_bytes(source.read_bytes())
            written.append(name)
    for stale in stubs.glob("*.py"):
        if stale.name != "__init__.py" and stale.name not in wanted:
            stale.unlink()
    return written


def main(argv: list[str]) -> None:
    if "--write" in argv:
        path = ROOT / "README.md"
        path.write_text(replace_section(path.read_text(encoding="utf-8")), encoding="utf-8")
        write_stubs()
    else:
        sys.stdout.write(exercises_markdown() + "\n" + checks_markdown())


if __name__ == "__main__":
    main(sys.argv[1:])
