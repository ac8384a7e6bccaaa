"""The README's exercise and check tables, generated from the catalog.

    python -m grader.docs            print the tables
    python -m grader.docs --write    rewrite them in README.md between their markers
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grader import catalog

START, END = "<!-- checks:start -->", "<!-- checks:end -->"


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
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    return pattern.sub(lambda _m: f"{START}\n{checks_markdown()}{END}", readme)


def main(argv: list[str]) -> None:
    if "--write" in argv:
        path = Path(__file__).resolve().parent.parent / "README.md"
        path.write_text(replace_section(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(checks_markdown())


if __name__ == "__main__":
    main(sys.argv[1:])
