"""What is generated from the catalog and the exercise files, never edited by hand.

    python -m grader.docs            print the generated tables
    python -m grader.docs --write    rewrite the README's exercise tables between their markers,
                                     write docs/checks.md whole, and add to grader/stubs/ the
                                     stubs it lacks (the packaged copies of exercises/, for `reset`)
    python -m grader.docs --write --stub NN[,NN...]
                                     also replace those exercises' packaged stubs with exercises/
                                     (a maintainer shipping a changed stub)

``tests/test_docs.py`` fails when any of them drifts from what this would write.

``grader/stubs/`` holds each exercise's file as shipped. The package carries it because the
learner edits ``exercises/`` in place (the kit is installed editable), so ``reset`` and "not
started" need the file as shipped from somewhere else, and must work without git. That also
means ``exercises/`` may hold a learner's work: ``--write`` never replaces a packaged stub
unless ``--stub`` names it, and refuses even then a file of the writing track whose functions
no longer only raise NotImplementedError. It exits 1, saying which stubs it kept and why, when
``exercises/`` differs from them.
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
        out.append("| check | passes when | stands on |")
        out.append("|---|---|---|")
        for c in ex.checks:
            out.append(f"| `{c.id}` | {c.title} | {c.evidence} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def checks_page() -> str:
    """docs/checks.md, whole: generated, never edited by hand."""
    head = ("# What each check means\n\n"
            "<!-- Generated from grader/catalog.toml by `python -m grader.docs --write`; do not edit. -->\n\n"
            "For each exercise: the file, what to write or fix, and each check the grader records, by the id "
            "the\nreport shows, what it establishes when it passes, and what its verdict stands on. "
            "`ddp-grade hint NN\n--check ID` gives a check's hint.\n\n"
            "What a verdict stands on:\n\n"
            "- **value**: what the learner's functions returned, compared in the grader's own process with "
            "answers\n  computed there;\n"
            "- **kernel**: what the kernel saw, measured by the grader from outside the ranks: the bytes on "
            "each pair of\n  ranks' connections, the files left, memory, processes;\n"
            "- **claim**: what the submission's own processes recorded about themselves (probes inside a rank, "
            "a\n  driver's list of calls): a submission controls every byte of its processes, and can rewrite "
            "them\n  ([guarantees.md](guarantees.md), \"What a check stands on\").\n\n")
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


def not_a_stub(ex: catalog.Exercise, text: str) -> str:
    """Why ``text`` cannot be ``ex``'s shipped stub ("" when it can): a file of the writing track
    whose functions have code is a learner's work. (A broken script of the debugging track has code
    from the start, so nothing in it tells a learner's fix from a maintainer's change.)"""
    from grader.progress import only_todos

    if ex.is_debug or only_todos(text, ex):
        return ""
    return (f"exercises/{ex.filename} has code where the stub raises NotImplementedError: a learner's work, "
            f"not a stub")


def write_stubs(root: Path = ROOT, stubs: Path = STUBS, replace: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Write ``grader/stubs/`` (``grader/stubs/debug/``) from ``exercises/``; drop stale copies.

    A stub the package lacks is copied from ``exercises/``; one it has is replaced only for the
    exercise ids in ``replace``, and never with a file :func:`not_a_stub` refuses. Returns the
    names written and, for each packaged stub kept although ``exercises/`` differs, why.
    """
    written, kept = [], []
    wanted = {ex.filename for ex in catalog.exercises()}
    for ex in catalog.exercises():
        source = root / "exercises" / ex.filename
        if not source.exists():
            continue
        target = stubs / ex.filename
        text = source.read_bytes()
        if target.exists() and target.read_bytes() == text:
            continue
        refusal = not_a_stub(ex, text.decode("utf-8", errors="replace"))
        if not refusal and target.exists() and ex.id not in replace:
            refusal = (f"exercises/{ex.filename} differs from it (work on the exercise stays there, nothing to do; "
                       f"a maintainer ships a changed {'script' if ex.is_debug else 'stub'} with --stub {ex.id})")
        if refusal:
            kept.append(f"kept grader/stubs/{ex.filename}: {refusal}")
            continue
        if not target.parent.exists():
            target.parent.mkdir(parents=True)
            (target.parent / "__init__.py").write_text("")  # a package, so it is installed with the grader
        target.write_bytes(text)
        written.append(ex.filename)
    for stale in stubs.rglob("*.py"):
        name = stale.relative_to(stubs).as_posix()
        if stale.name != "__init__.py" and name not in wanted:
            stale.unlink()
    return written, kept


def _stub_ids(argv: list[str]) -> tuple[str, ...]:
    """The ids after each ``--stub`` (``--stub 05 --stub 06`` or ``--stub 05,06``), as the catalog spells them."""
    ids = []
    for flag, value in zip(argv, argv[1:]):
        if flag == "--stub":
            for part in value.split(","):
                ex = catalog.by_id(part.strip())
                if ex is None:
                    sys.exit(f"grader.docs: unknown exercise {part.strip()!r} after --stub")
                ids.append(ex.id)
    return tuple(ids)


def main(argv: list[str]) -> None:
    if "--write" in argv:
        path = ROOT / "README.md"
        path.write_text(replace_section(path.read_text(encoding="utf-8")), encoding="utf-8")
        CHECKS_PAGE.write_text(checks_page(), encoding="utf-8")
        _, kept = write_stubs(replace=_stub_ids(argv))
        if kept:
            print("\n".join(kept) + "\n`ddp-grade reset NN` puts an exercise's packaged stub back in exercises/.",
                  file=sys.stderr)
            sys.exit(1)
    else:
        sys.stdout.write(exercises_markdown() + "\n" + debug_exercises_markdown() + "\n" + checks_markdown())


if __name__ == "__main__":
    main(sys.argv[1:])
