"""What is generated from the catalog and the exercise files, never edited by hand.

    python -m grader.docs            print the generated tables
    python -m grader.docs --write    rewrite the README's exercise tables between their markers,
                                     write docs/checks.md whole, and write grader/stubs/ (the
                                     packaged copies of exercises/, for `reset`)

``tests/test_docs.py`` fails when any of them drifts from what this would write.

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

EXERCISES_START, EXERCISES_END = "<!-- exercises:start -->", "<!-- exercises:end -->"
DEBUG_START, DEBUG_END = "<!-- debug-exercises:start -->", "<!-- debug-exercises:end -->"


def exercises_markdown() -> str:
    """The table of writing exercises: id, file, the names to write, what it practises."""
    out = ["| # | file | you write | topic |", "|---|---|---|---|"]
    for ex in catalog.of_track(catalog.WRITE):
        functions = ", ".join(f"`{f}`" for f in ex.functions)
        out.append(f"| {ex.id} | `exercises/{ex.filename}` | {functions} | {ex.summary} |")
    return "\n".join(out) + "\n"


def debug_exercises_markdown() -> str:
    """The table of the debugging track: id, the broken script, the symptom reported."""
    out = ["| # | file | the report says |", "|---|---|---|"]
    for ex in catalog.of_track(catalog.DEBUG):
        out.append(f"| {ex.id} | `exercises/{ex.filename}` | {ex.summary} |")
    return "\n".join(out) + "\n"


def checks_markdown() -> str:
    """One section per exercise: what to write or fix, then each check id and what it establishes."""
    out = []
    for ex in catalog.exercises():
        functions = ", ".join(f"`{f}`" for f in ex.functions)
        out.append(f"#### {ex.id} · {ex.title}\n")
        if ex.is_debug:
            out.append(f"`exercises/{ex.filename}` — fix the script; the grader runs its {functions}.\n")
        else:
            out.append(f"`exercises/{ex.filename}` — write {functions}.\n")
        out.append("| check | passes when |")
        out.append("|---|---|")
        for c in ex.checks:
            out.append(f"| `{c.id}` | {c.title} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def checks_page() -> str:
    """docs/checks.md, whole: generated, never edited by hand."""
    head = ("# What each check means\n\n"
            "<!-- Generated from grader/catalog.toml by `python -m grader.docs --write`; do not edit. -->\n\n"
            "For each exercise: the file, what to write or fix, and each check the grader records, by the id "
            "the\nreport shows and what it establishes when it passes. `ddp-grade hint NN --check ID` gives a "
            "check's\nhint.\n\n")
    return head + checks_markdown().replace("#### ", "## ")


def replace_section(readme: str) -> str:
    """The README with its generated exercise tables rewritten from the catalog."""
    for start, end, make in ((EXERCISES_START, EXERCISES_END, exercises_markdown),
                             (DEBUG_START, DEBUG_END, debug_exercises_markdown)):
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        readme = pattern.sub(lambda _m, s=start, e=end, f=make: f"{s}\n{f()}{e}", readme)
    return readme


ROOT = Path(__file__).resolve().parent.parent
STUBS = Path(__file__).resolve().parent / "stubs"
CHECKS_PAGE = ROOT / "docs" / "checks.md"


def write_stubs(root: Path = ROOT, stubs: Path = STUBS) -> list[str]:
    """Copy each catalogued ``exercises/NN_slug.py`` (``exercises/debug/NN_slug.py``) into
    ``grader/stubs/`` (``grader/stubs/debug/``); drop stale copies."""
    written = []
    wanted = {ex.filename for ex in catalog.exercises()}
    for name in sorted(wanted):
        source = root / "exercises" / name
        if source.exists():
            target = stubs / name
            if not target.parent.exists():
                target.parent.mkdir(parents=True)
                (target.parent / "__init__.py").write_text("")  # a package, so it is installed with the grader
            target.write_bytes(source.read_bytes())
            written.append(name)
    for stale in stubs.rglob("*.py"):
        name = stale.relative_to(stubs).as_posix()
        if stale.name != "__init__.py" and name not in wanted:
            stale.unlink()
    return written


def main(argv: list[str]) -> None:
    if "--write" in argv:
        path = ROOT / "README.md"
        path.write_text(replace_section(path.read_text(encoding="utf-8")), encoding="utf-8")
        CHECKS_PAGE.write_text(checks_page(), encoding="utf-8")
        write_stubs()
    else:
        sys.stdout.write(exercises_markdown() + "\n" + debug_exercises_markdown() + "\n" + checks_markdown())


if __name__ == "__main__":
    main(sys.argv[1:])
