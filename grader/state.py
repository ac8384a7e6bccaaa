"""Small JSON state files (progress, quiz answers, hints shown), written atomically.

The files live in one folder: ``$DDP_GRADE_STATE_DIR`` when set, otherwise
``$XDG_STATE_HOME/ddp-grade`` (``~/.local/state/ddp-grade`` by default).
A file that cannot be read is never deleted: it is renamed aside to
``NAME.corrupt-YYYYmmdd-HHMMSS`` and a fresh one is started.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

STATE_DIR_ENV = "DDP_GRADE_STATE_DIR"


def state_dir() -> Path:
    """The folder that holds every state file of this user."""
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "ddp-grade"


class StateFile:
    """One JSON object on disk, loaded whole and saved atomically."""

    def __init__(self, name: str, directory: Path | None = None):
        self.path = (directory or state_dir()) / name
        self.set_aside: Path | None = None  # where an unreadable file was moved, if it was

    def load(self) -> dict:
        """Return the stored object, or {} when there is none or it was unreadable."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError:
            return self._keep_aside()
        try:
            data = json.loads(text)
        except ValueError:
            return self._keep_aside()
        if not isinstance(data, dict):
            return self._keep_aside()
        return data

    def save(self, data: dict) -> None:
        """Write ``data`` so that a reader sees either the old file or the new one, never half."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def warning(self) -> str | None:
        """A message for the user when the last load found an unreadable file."""
        if self.set_aside is None:
            return None
        return (
            f"warning: {self.path} could not be read; it was kept as {self.set_aside} "
            "and a fresh one was started."
        )

    def _keep_aside(self) -> dict:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.replace(self.path, aside)
        self.set_aside = aside
        return {}
