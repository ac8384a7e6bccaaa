"""Small JSON state files (progress, quiz answers, hints shown), written atomically.

The files live in one folder: ``$DDP_GRADE_STATE_DIR`` when set, otherwise
``$XDG_STATE_HOME/ddp-grade`` (``~/.local/state/ddp-grade`` by default), made for this user
alone (0700).

* A file that cannot be read, or that holds JSON of the wrong shape, is never deleted: it is
  renamed aside to ``NAME.corrupt-YYYYmmdd-HHMMSS`` and a fresh one is started.
* Every change is a read-modify-write under an exclusive lock (``NAME.lock``, ``flock``): the
  file is read afresh, changed and written back (atomically, by rename) while no other command
  can do the same, so any number of gradings, watch, batch and quiz at once keep every record.
* A folder that cannot be written (read-only, or not creatable) raises :class:`StateUnwritable`
  with the reason; commands say the record was not saved and go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

STATE_DIR_ENV = "DDP_GRADE_STATE_DIR"


class StateUnwritable(OSError):
    """The state folder cannot be written: the change was not saved."""


def state_dir() -> Path:
    """The folder that holds every state file of this user."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "ddp-grade"


class StateFile:
    """One JSON object on disk, loaded whole; changed under a lock, saved atomically.

    ``valid(data) -> bool`` says whether a parsed object has the file's shape; one that has not
    is kept aside like an unreadable file.
    """

    def __init__(self, name: str, directory: Path | None = None, valid: Callable[[dict], bool] | None = None,
                 salvage: Callable[[dict], dict] | None = None):
        self.path = (directory or state_dir()) / name
        self.valid = valid
        self.salvage = salvage  # what to keep of a file of the wrong shape (it is kept aside whole)
        self.set_aside: Path | None = None  # where an unreadable file was moved, if it was
        self.unsaved: str | None = None  # why the last change could not be saved, if it could not

    def load(self) -> dict:
        """Return the stored object, or {} when there is none or it was unreadable (then kept aside)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except IsADirectoryError:
            return {}
        except OSError:
            return self._keep_aside()
        try:
            data = json.loads(text)
        except ValueError:
            return self._keep_aside()
        if not isinstance(data, dict):
            return self._keep_aside()
        if self.valid is not None and not self.valid(data):
            return self._keep_aside(self.salvage(data) if self.salvage else {})
        return data

    def update(self, change: Callable[[dict], dict]) -> dict:
        """Read the file afresh under the lock, write back ``change(data)``, return it.

        Raises :class:`StateUnwritable` when the folder cannot be written; ``unsaved`` says why.
        """
        with self._locked():
            data = change(self.load())
            self.save(data)
        return data

    @contextlib.contextmanager
    def _locked(self):
        try:
            import fcntl
        except ImportError:  # no flock here (Windows): writes stay atomic, not serialized
            yield
            return
        self._ensure_folder()
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _ensure_folder(self) -> None:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from None

    def _unwritable(self, exc: OSError) -> StateUnwritable:
        reason = exc.strerror or str(exc)
        self.unsaved = f"{self.path.parent}: {reason}"
        return StateUnwritable(exc.errno, self.unsaved)

    def save(self, data: dict) -> None:
        """Write ``data`` so that a reader sees either the old file or the new one, never half.

        Raises :class:`StateUnwritable` when the folder cannot be written.
        """
        self._ensure_folder()
        try:
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise self._unwritable(exc) from None
            raise
        self.unsaved = None

    def warning(self) -> str | None:
        """A message for the user when the last load found an unreadable file."""
        if self.set_aside is None:
            return None
        if self.set_aside == self.path:
            return f"warning: {self.path} could not be read, and could not be moved aside; it is left as it is."
        return (
            f"warning: {self.path} could not be read (or was not of its expected shape); it was kept as "
            f"{self.set_aside} and a fresh one was started with what could be read of it."
        )

    def _keep_aside(self, kept: dict | None = None) -> dict:
        """Move the file aside; ``kept`` (what could be read of it) becomes the fresh start."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(self.path, aside)
        except OSError as exc:  # cannot be moved (a read-only folder): left where it is, and never overwritten
            self.unsaved = f"{self.path.parent}: {exc.strerror or exc}"
            self.set_aside = self.path
            return dict(kept or {})
        self.set_aside = aside
        if kept:  # the fresh file starts with what could be read, so the next change keeps it
            with contextlib.suppress(StateUnwritable):
                self.save(kept)
        return dict(kept or {})
