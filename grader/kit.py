"""Where the kit's files are: the exercises the learner edits, the solutions, the pristine stubs.

The kit is used from a checkout: ``exercises/`` and ``solutions/`` sit at its root. Commands act
on the kit in the current folder or one of its parents when there is one (as rustlings and
exercism do), else on ``$DDP_GRADE_ROOT``, else on the checkout the package is installed from.
The pristine stubs ship inside the package (``grader/stubs/``), so ``reset`` works without git.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import time
from importlib import resources
from pathlib import Path

from grader import catalog
from grader.state import state_dir

ROOT_ENV = "DDP_GRADE_ROOT"


class KitError(Exception):
    """The kit's files cannot be found or used; the message says what to do, in one line."""


def looks_like_kit(folder: Path) -> bool:
    """True when ``folder`` holds an ``exercises/`` folder with at least one of the catalog's files."""
    exercises = folder / "exercises"
    return exercises.is_dir() and any((exercises / ex.filename).is_file() for ex in catalog.exercises())


def root() -> Path:
    """The kit's folder: the current folder or a parent that holds one, else ``$DDP_GRADE_ROOT``,
    else the checkout the grader package is installed from."""
    try:
        here = Path.cwd()
    except OSError:  # the current folder was deleted
        here = None
    for folder in ([here, *here.parents] if here else []):
        if looks_like_kit(folder):
            return folder
    explicit = os.environ.get(ROOT_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not (path / "exercises").is_dir():
            raise KitError(f"{ROOT_ENV}={explicit} has no exercises/ folder; point it at the kit's checkout")
        return path
    path = Path(__file__).resolve().parent.parent
    if not (path / "exercises").is_dir():
        raise KitError(f"cannot find the kit's exercises/ folder (looked in {path}); install the kit from its "
                       f"checkout with `pip install -e .` or set {ROOT_ENV} to the checkout")
    return path


def exercise_path(ex: catalog.Exercise) -> Path:
    """The learner's file for ``ex``: ``<root>/exercises/NN_slug.py``."""
    return root() / "exercises" / ex.filename


def solution_path(ex: catalog.Exercise) -> Path:
    return root() / "solutions" / ex.filename


def require_exercise(exercise_id: str) -> catalog.Exercise:
    """The catalog entry for ``exercise_id`` ("3", "03", "03_train"), or KitError naming the valid ids."""
    ex = catalog.by_id(exercise_id)
    if ex is None:
        known = ", ".join(e.id for e in catalog.exercises())
        raise KitError(f"unknown exercise {exercise_id!r}: choose one of {known}")
    return ex


def stub_text(ex: catalog.Exercise) -> str | None:
    """The exercise file as shipped (from ``grader/stubs/``), or None when the kit has no stub for it."""
    ref = resources.files("grader").joinpath("stubs", ex.filename)
    try:
        return ref.read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        return None


def is_pristine(source: str, stub: str) -> bool:
    """True when ``source`` is the stub, ignoring comments, blank lines and formatting.

    Both are compared as syntax trees, so a learner who only reformats or adds comments
    has not started; any change to code has. Source that does not parse has been edited.
    """
    if source == stub:
        return True
    try:
        return ast.dump(ast.parse(source)) == ast.dump(ast.parse(stub))
    except (SyntaxError, ValueError):
        return False


def backups_dir() -> Path:
    """Where ``reset`` keeps copies of the learner's files: ``<state folder>/backups``."""
    return state_dir() / "backups"


def backup(path: Path) -> Path:
    """Copy ``path`` to a new timestamped file in :func:`backups_dir`; return the copy's path."""
    folder = backups_dir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder / f"{path.stem}.{stamp}{path.suffix}"
    n = 1
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        while target.exists():
            target = folder / f"{path.stem}.{stamp}-{n}{path.suffix}"
            n += 1
        shutil.copyfile(path, target)
    except OSError as exc:  # nothing is overwritten without its copy: the caller stops here
        raise KitError(f"cannot keep a copy of {path} in {folder} ({exc.strerror or exc}); nothing was changed") \
            from None
    return target


def backups_of(ex: catalog.Exercise) -> list[Path]:
    """Saved copies of exercise ``ex``, the newest last."""
    folder = backups_dir()
    if not folder.is_dir():
        return []
    stem = Path(ex.filename).stem
    found = []
    for p in folder.glob(f"{stem}.*.py"):
        m = re.fullmatch(re.escape(stem) + r"\.(\d{8}-\d{6})(?:-(\d+))?\.py", p.name)
        if m:
            found.append(((m.group(1), int(m.group(2) or 0)), p))
    return [p for _, p in sorted(found)]


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path``'s content so that a reader sees the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.ddp-grade-tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise KitError(f"cannot write {path} ({exc.strerror or exc}); it is unchanged") from None
