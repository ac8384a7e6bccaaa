"""What can be learned about a learner's file without running it."""

from __future__ import annotations

import ast
import io
import os
import tokenize
from pathlib import Path

from grader import catalog


class Unusable(Exception):
    """The file cannot be graded; the message says why, in one or two lines."""


def read_source(path: str | Path) -> str:
    """The file's text, or :class:`Unusable` with a clear reason."""
    p = Path(path)
    if not p.exists():
        if os.path.islink(p):  # a link that leads nowhere: a loop, or a missing target
            try:
                os.stat(p)
            except OSError as exc:
                raise Unusable(f"cannot read {path}: {exc.strerror or exc} (a symbolic link)") from None
        raise Unusable(f"no such file: {path}")
    if p.is_dir():
        raise Unusable(f"{path} is a folder: give one exercise file, such as {p / '03_train.py'}"
                       " (or use `ddp-grade batch` for a folder of submissions)")
    kind = not_a_file(p)
    if kind:  # never opened: reading a FIFO waits for a writer, and opening a device may act
        raise Unusable(f"{path} is not a regular file ({kind}): give the exercise file itself")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise Unusable(f"cannot read {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        kind = not_a_file(f.fileno())  # replaced by a FIFO since it was looked at: still never read
        if kind:
            raise Unusable(f"{path} is not a regular file ({kind}): give the exercise file itself")
        try:
            data = f.read()
        except OSError as exc:
            raise Unusable(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return decode_source(data)
    except (SyntaxError, UnicodeDecodeError) as exc:
        try:
            data.decode("utf-8-sig")
        except UnicodeDecodeError as bad:
            exc = bad
        if isinstance(exc, SyntaxError):  # an encoding declaration Python rejects
            raise Unusable(f"{path}: {exc.msg}") from None
        raise Unusable(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                       "save it as UTF-8") from None


def not_a_file(path) -> str:
    """"" for a regular file (``path`` followed where it is a link, or an open descriptor), else what it
    is: "a FIFO", "a character device", ... (from its metadata: nothing is opened)."""
    import stat

    from grader.rank.untrusted import file_kind

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""  # the read that follows says why
    return "" if stat.S_ISREG(mode) else file_kind(mode)


def decode_source(data: bytes) -> str:
    """A source file's bytes as text, read the way Python reads it when importing.

    A UTF-8 byte-order mark is dropped and a ``# -*- coding: ... -*-`` line is
    honoured; line endings are left alone (ast and the importer accept \\r\\n).
    Raises UnicodeDecodeError, or SyntaxError for an encoding Python does not know.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def which_exercise(path: str | Path, override: str | None = None) -> catalog.Exercise:
    """The exercise a file is for: ``--exercise`` when given, else its file name."""
    if override:
        ex = catalog.by_id(override)
        if ex is None:
            known = ", ".join(e.id for e in catalog.exercises())
            raise Unusable(f"unknown exercise {override!r}: choose one of {known}")
        return ex
    ex = catalog.from_filename(path)
    if ex is None:
        raise Unusable(f"cannot tell which exercise {Path(path).name} is: name the file like "
                       "03_train.py or pass --exercise 03")
    return ex


def defined_names(source: str, path: str | Path) -> set[str]:
    """Names a module defines at its top level; :class:`Unusable` on a syntax error."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        line = (exc.text or "").rstrip()
        where = f" line {exc.lineno}" if exc.lineno else ""
        shown = f"\n    {line.strip()}" if line.strip() else ""
        raise Unusable(f"syntax error in {path}{where}: {exc.msg}{shown}") from None
    except ValueError as exc:  # e.g. null bytes
        raise Unusable(f"{path} cannot be parsed as Python: {exc}") from None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.If, ast.Try)):
            # names defined under `if`/`try` at top level count too
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(sub.name)
    return names


def check_file(path: str | Path, override: str | None = None) -> catalog.Exercise:
    """Everything the grader can check before starting a process; returns the exercise."""
    source = read_source(path)
    exercise = which_exercise(path, override)
    names = defined_names(source, path)
    missing = [f for f in exercise.functions if f not in names]
    if missing:
        message = (f"{Path(path).name} does not define {', '.join(missing)} "
                   f"(exercise {exercise.id} needs {', '.join(exercise.functions)})")
        other = _looks_like(names, exercise)
        if other is not None:
            message += (f"; it looks like exercise {other.id} ({other.filename}): "
                        f"pass --exercise {other.id} or rename the file")
        raise Unusable(message)
    return exercise


def _looks_like(names: set[str], not_this: catalog.Exercise) -> catalog.Exercise | None:
    best, best_count = None, 0
    for ex in catalog.exercises():
        if ex.id == not_this.id:
            continue
        count = sum(1 for f in ex.functions if f in names and f not in not_this.functions)
        if count > best_count:
            best, best_count = ex, count
    return best
