"""CONTRIBUTING.md's list of the files an exercise takes is true and complete."""

from __future__ import annotations

import fnmatch
import re
import subprocess

from conftest import ROOT
from grader import catalog

TABLE = re.compile(r"<!-- files-per-exercise:start -->(.*?)<!-- files-per-exercise:end -->", re.S)


def listed_files() -> list[tuple[str, bool]]:
    """(pattern, required) from the table in CONTRIBUTING.md."""
    text = TABLE.search((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")).group(1)
    return [(m.group(1), m.group(2) == "yes") for m in re.finditer(r"^\| `([^`]+)` \| (yes|no) \|", text, re.M)]


def for_exercise(pattern: str, ex: catalog.Exercise) -> str:
    track = f"{ex.track}/" if ex.is_debug else ""
    return pattern.replace("[debug/]", track).replace("NN", ex.id).replace("slug", ex.slug)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout: every file below the kit
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return out.stdout.split()


def test_the_list_names_the_files_every_exercise_needs():
    files = listed_files()
    assert files and any(required for _, required in files)
    tracked = tracked_files()
    for ex in catalog.exercises():
        for pattern, required in files:
            if required:
                wanted = for_exercise(pattern, ex)
                assert fnmatch.filter(tracked, wanted), f"exercise {ex.id}: no {wanted} (CONTRIBUTING.md lists it)"


def test_nothing_outside_the_list_names_the_newest_exercise():
    """Adding the newest exercise touched only the listed files: no other file names it or its module."""
    newest = catalog.exercises()[-1]
    allowed = [for_exercise(pattern, newest) for pattern, _ in listed_files()]
    names = (f"{newest.id}_{newest.slug}", f"ex{newest.id}_{newest.slug}")
    for path in tracked_files():
        full = ROOT / path
        by_name = any(n in path for n in names) or re.match(rf"tests/\w+/{newest.id}_", path)
        try:
            by_text = any(n in full.read_text(encoding="utf-8", errors="replace") for n in names)
        except OSError:
            by_text = False
        if by_name or by_text:
            assert any(fnmatch.fnmatch(path, a) for a in allowed), \
                f"{path} names exercise {newest.id}, but CONTRIBUTING.md does not list it among an exercise's files"
