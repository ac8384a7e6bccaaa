"""The learner's progress: which exercises passed, how many hints were shown.

Stored in ``progress.json`` in the state folder (see :mod:`grader.state`)::

    {"version": 1,
     "exercises": {"03": {"passed": "2025-01-31T10:02:11", "hints_shown": 2,
                          "last_status": "failed", "last_graded": "2025-01-31T10:01:40",
                          "passed_before": "...", "solution_seen": "2025-01-31T09:50:02"}}}

The status shown by ``ddp-grade list`` comes from this file and from the exercise file itself:

* ``passed``       a grading of the kit's exercise file passed (recorded then; ``reset`` clears it);
* ``in progress``  the file's code differs from the stub as shipped (compared as syntax trees,
  so comments and formatting do not count);
* ``not started``  the file's code is still the stub's (for an exercise without a packaged stub:
  every function to write still only raises NotImplementedError);
* ``missing``      the kit has no file for it (deleted, or an exercise still being written).

``solution_seen`` is when ``ddp-grade solution`` first showed the reference (whole or as a diff) while the
exercise had not passed; ``list`` shows it beside the pass that follows. It stays through ``reset``: a pass
after a reset still came after the reference was seen. Seeing the reference after a pass leaves no mark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from grader import catalog, kit, learner
from grader.state import StateFile, StateUnwritable

STATE_NAME = "progress.json"

PASSED = "passed"
IN_PROGRESS = "in progress"
NOT_STARTED = "not started"
MISSING = "missing"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


@dataclass(frozen=True)
class Row:
    """One exercise as ``ddp-grade list`` shows it."""

    exercise: catalog.Exercise
    status: str
    path: Path | None
    hints_shown: int
    solution_seen: bool = False


class Progress:
    """progress.json, loaded once; every change is read afresh, made and saved under the file's lock
    (so gradings at once never lose each other's records). When the state folder cannot be written,
    changes stay in memory and ``unsaved`` says why."""

    def __init__(self, state: StateFile | None = None):
        self.state = state or StateFile(STATE_NAME)
        self.state.valid, self.state.salvage = shape_ok, _clean
        self.data = _clean(self.state.load())

    def warning(self) -> str | None:
        """A line for the user when progress.json was unreadable (or of the wrong shape) and kept aside."""
        return self.state.warning()

    @property
    def unsaved(self) -> str | None:
        """Why the last change could not be saved (the folder and the reason), or None."""
        return self.state.unsaved

    def _change(self, edit) -> None:
        """Apply ``edit(data)`` to the file as it is now, under its lock; in memory only when it cannot be saved."""

        def change(data: dict) -> dict:
            data = _clean(data)
            edit(data)
            return data

        try:
            self.data = self.state.update(change)
        except StateUnwritable:
            edit(self.data)

    def entry(self, exercise_id: str) -> dict:
        return self.data["exercises"].setdefault(exercise_id, {})

    @staticmethod
    def _entry(data: dict, exercise_id: str) -> dict:
        return data["exercises"].setdefault(exercise_id, {})

    def passed(self, exercise_id: str) -> bool:
        return bool(self.data["exercises"].get(exercise_id, {}).get("passed"))

    def hints_shown(self, exercise_id: str) -> int:
        return int(self.data["exercises"].get(exercise_id, {}).get("hints_shown", 0))

    def solution_seen(self, exercise_id: str) -> bool:
        """Whether the reference solution was shown while the exercise had not passed."""
        return isinstance(self.data["exercises"].get(exercise_id, {}).get("solution_seen"), str)

    def record_solution_shown(self, exercise_id: str) -> None:
        """``ddp-grade solution`` showed the reference: marked when the exercise has not passed (the first
        time is kept); after a pass, nothing to mark."""
        now = _now()

        def edit(data: dict) -> None:
            e = self._entry(data, exercise_id)
            if not e.get("passed") and not isinstance(e.get("solution_seen"), str):
                e["solution_seen"] = now

        self._change(edit)

    def record_grading(self, exercise_id: str, status: str, digest: str | None = None) -> None:
        """Remember a grading of the kit's file; a pass is kept until ``reset``. ``digest``: the graded file's
        :func:`digest`, kept with a pass so that ``restore`` of that very file brings the pass back."""
        now = _now()

        def edit(data: dict) -> None:
            e = self._entry(data, exercise_id)
            e["last_status"] = status
            e["last_graded"] = now
            if status == "passed" and not e.get("passed"):
                e["passed"] = now
            if status == "passed" and digest:
                e["passed_digest"] = digest

        self._change(edit)

    def next_hint(self, ex: catalog.Exercise, again: bool = False) -> tuple[int, str] | None:
        """(level, text) of the next hint, counting it as shown; the last one again when all were shown.

        ``again`` repeats the last shown level without moving on. None when the exercise has no hints.
        """
        if not ex.hints:
            return None
        shown = self.hints_shown(ex.id)
        if again and shown:
            level = shown
        else:
            level = min(shown + 1, len(ex.hints))
        if level > shown:

            def edit(data: dict) -> None:
                e = self._entry(data, ex.id)
                e["hints_shown"] = max(level, e.get("hints_shown", 0))

            self._change(edit)
        return level, ex.hints[level - 1]

    def forget(self, exercise_id: str) -> None:
        """After ``reset``: the exercise starts over; when it passed, that is kept as ``passed_before``."""
        def edit(data: dict) -> None:
            e = self._entry(data, exercise_id)
            if e.get("passed"):
                e["passed_before"] = e.pop("passed")
            e.pop("last_status", None)

        self._change(edit)


    def restored(self, exercise_id: str, text: str) -> bool:
        """After ``restore`` put ``text`` back: when it is the file that passed before ``reset``, the pass is
        back (True). A file that differs in any byte of code starts as it would have."""
        back = []

        def edit(data: dict) -> None:
            e = self._entry(data, exercise_id)
            if not e.get("passed") and e.get("passed_before") and e.get("passed_digest") == digest(text):
                e["passed"] = e.pop("passed_before")
                e["last_status"] = "passed"
                back.append(True)

        self._change(edit)
        return bool(back)


def digest(text: str) -> str:
    """A file's content as progress remembers it: SHA-256 of its text, line ends made plain."""
    import hashlib

    return hashlib.sha256(text.replace("\r\n", "\n").encode("utf-8", "surrogatepass")).hexdigest()


def shape_ok(data: dict) -> bool:
    """progress.json's shape: ``exercises`` a table of tables, ``hints_shown`` a whole number. A file
    of another shape is kept aside, never overwritten."""
    exercises = data.get("exercises", {})
    if not isinstance(exercises, dict):
        return False
    for value in exercises.values():
        if not isinstance(value, dict):
            return False
        shown = value.get("hints_shown", 0)
        if not isinstance(shown, int) or isinstance(shown, bool):
            return False
    return True


def _clean(data: dict) -> dict:
    """``data`` with anything of the wrong shape dropped, so a hand-edited file cannot crash a command."""
    exercises = data.get("exercises")
    if not isinstance(exercises, dict):
        exercises = {}
    clean = {}
    for key, value in exercises.items():
        if not isinstance(value, dict):
            continue
        if not isinstance(value.get("hints_shown", 0), int):
            value = {k: v for k, v in value.items() if k != "hints_shown"}
        if "solution_seen" in value and not isinstance(value["solution_seen"], str):
            value = {k: v for k, v in value.items() if k != "solution_seen"}
        clean[str(key)] = value
    return {**data, "version": 1, "exercises": clean}


def file_status(ex: catalog.Exercise, path: Path) -> str:
    """not started / in progress / missing, from the file alone."""
    try:
        source = learner.decode_source(path.read_bytes())
    except FileNotFoundError:
        return MISSING
    except (OSError, SyntaxError, UnicodeDecodeError):
        return IN_PROGRESS
    stub = kit.stub_text(ex)
    if stub is not None:
        return NOT_STARTED if kit.is_pristine(source, stub) else IN_PROGRESS
    return NOT_STARTED if only_todos(source, ex) else IN_PROGRESS


def only_todos(source: str, ex: catalog.Exercise) -> bool:
    """For an exercise the kit has no stub of: every function to write still only raises
    NotImplementedError (a class counts as untouched while one of its methods does)."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    found = [defs[name] for name in ex.functions if name in defs]
    if not found:
        return False
    for node in found:
        if isinstance(node, ast.ClassDef):
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if not any(_raises_only(m) for m in methods):
                return False
        elif not _raises_only(node):
            return False
    return True


def _raises_only(fn) -> bool:
    import ast

    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def rows(progress: Progress) -> list[Row]:
    """Every exercise of the catalog with its status, in order."""
    out = []
    base = kit.root()
    for ex in catalog.exercises():
        path = base / "exercises" / ex.filename
        status = file_status(ex, path)
        if status != MISSING and progress.passed(ex.id):
            status = PASSED
        out.append(Row(ex, status, path if status != MISSING else None, progress.hints_shown(ex.id),
                       progress.solution_seen(ex.id)))
    return out


def next_row(all_rows: list[Row]) -> Row | None:
    """The first exercise (in catalog order) that exists and has not passed; None when all have."""
    for row in all_rows:
        if row.status in (NOT_STARTED, IN_PROGRESS):
            return row
    return None


def is_kit_file(path: str | Path, ex: catalog.Exercise) -> bool:
    """True when ``path`` is the kit's own exercise file for ``ex`` (the one progress is about)."""
    try:
        return Path(path).resolve() == kit.exercise_path(ex).resolve()
    except (kit.KitError, OSError, RuntimeError):  # RuntimeError: a symlink loop (Python 3.12 and older)
        return False
