"""``ddp-grade solution``, ``reset`` and ``restore``: the reference, the stub, the learner's copies.

No learner file is overwritten without a copy first: ``reset`` and ``restore`` save the current file
to ``<state folder>/backups/NN_slug.YYYYmmdd-HHMMSS.py`` before they write.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from grader import catalog, kit
from grader.progress import Progress


def solution_text(ex: catalog.Exercise) -> str:
    path = kit.solution_path(ex)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise kit.KitError(f"the kit has no reference solution for exercise {ex.id} ({path})") from None


def solution_diff(ex: catalog.Exercise) -> str:
    """A unified diff from the learner's file to the reference solution ("" when they are equal)."""
    mine_path = kit.exercise_path(ex)
    try:
        mine = mine_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        mine = ""
    except (OSError, UnicodeDecodeError) as exc:
        raise kit.KitError(f"cannot read {mine_path}: {exc}") from None
    theirs = solution_text(ex)
    return "".join(difflib.unified_diff(
        mine.splitlines(keepends=True), theirs.splitlines(keepends=True),
        fromfile=f"yours: exercises/{ex.filename}", tofile=f"reference: solutions/{ex.filename}"))


@dataclass
class Written:
    path: Path  # the exercise file written
    saved_as: Path | None  # where the previous content was copied, None when there was none to keep


def reset(ex: catalog.Exercise, progress: Progress) -> Written:
    """Write the stub as shipped over the learner's file, after copying that file aside."""
    stub = kit.stub_text(ex)
    if stub is None:
        raise kit.KitError(f"the kit has no stub for exercise {ex.id}")
    path = kit.exercise_path(ex)
    saved = _save_current(path, unless_equal_to=stub)
    kit.write_atomically(path, stub)
    progress.forget(ex.id)
    return Written(path, saved)


def restore(ex: catalog.Exercise, source: Path | None = None, progress: Progress | None = None) -> tuple[Written, Path]:
    """Put back a saved copy (the newest, or ``source``); the current file is copied aside first. With
    ``progress``: when the copy is the file that passed before ``reset``, the pass is back
    (:meth:`Progress.restored`)."""
    if source is None:
        copies = kit.backups_of(ex)
        if not copies:
            raise kit.KitError(f"no saved copy of exercise {ex.id} in {kit.backups_dir()}")
        source = copies[-1]
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise kit.KitError(f"cannot read {source}: {exc}") from None
    path = kit.exercise_path(ex)
    saved = _save_current(path, unless_equal_to=text)
    kit.write_atomically(path, text)
    if progress is not None:
        progress.restored(ex.id, text)
    return Written(path, saved), Path(source)


def _save_current(path: Path, unless_equal_to: str) -> Path | None:
    if not path.exists():
        return None
    try:
        if path.read_text(encoding="utf-8") == unless_equal_to:
            return None  # nothing would be lost
    except (OSError, UnicodeDecodeError):
        pass
    return kit.backup(path)
