"""``ddp-grade watch``: re-grade an exercise file on every save.

On Linux, a change in the file's folder wakes the loop at once (inotify, read through ctypes: no
extra dependency). Everywhere, and as a backstop on Linux, the file is also polled every 0.05 s
(modification time, size and content hash): file events do not reach every container, WSL or
network mount, polling does. Either way, what counts as a save is decided by comparing
fingerprints. A change is graded at once when a file event says the write of the file was
closed (or a file was renamed onto it); otherwise once the file has stayed the same for 0.03 s
(editors may write in several steps). Reading and hashing an exercise file 20 times a second costs next to
nothing. The grading reuses one warm harness session for the whole watch, so each verdict
comes from processes that already have torch imported.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import select
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

POLL_S = 0.05
SETTLE_S = 0.03  # a change must hold this long: a save written in several steps is graded once


@dataclass(frozen=True)
class Fingerprint:
    mtime_ns: int
    size: int
    digest: str  # "" for a missing file


def fingerprint(path: str | os.PathLike) -> Fingerprint:
    """What is compared between polls; a missing or unreadable file has its own fingerprint."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return Fingerprint(-1, -1, "")
    return Fingerprint(st.st_mtime_ns, st.st_size, digest)


def watch_loop(path, on_change: Callable[[int], None], *, poll_s: float = POLL_S,
               max_grades: int | None = None, stop: threading.Event | None = None,
               sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``on_change(n)`` now and after every change of ``path``; return how many calls were made.

    Stops after ``max_grades`` calls, when ``stop`` is set, or on KeyboardInterrupt (raised to the
    caller). A change counts when the content differs (same-content saves, e.g. "touch", are
    ignored) and the file then stays unchanged for SETTLE_S. With the default ``sleep``, a file
    event in the folder (where :class:`FolderEvents` has them) ends the wait of ``poll_s`` early,
    and one saying the file's write was closed makes the change count at once.
    """
    stop = stop or threading.Event()
    events = FolderEvents.open(path) if sleep is time.sleep else None
    try:
        return _loop(path, on_change, poll_s, max_grades, stop, sleep, events.wait if events else sleep)
    finally:
        if events:
            events.close()


def _loop(path, on_change, poll_s, max_grades, stop, sleep, wait) -> int:
    graded = 0
    last = fingerprint(path)
    on_change(graded := graded + 1)
    while not stop.is_set() and (max_grades is None or graded < max_grades):
        saved = wait(poll_s)  # True only where a file event said a write of this file has finished
        if stop.is_set():
            break
        now = fingerprint(path)
        if now == last:
            continue
        if now.digest == last.digest:
            last = now  # touched, not changed
            continue
        if not saved:
            sleep(SETTLE_S)  # let a multi-step save finish
            if fingerprint(path) != now:
                continue  # still being written: look again at the next poll
        last = now
        on_change(graded := graded + 1)
    return graded


# From <sys/inotify.h>.
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x2, 0x4, 0x8, 0x80, 0x100, 0x200
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows


class FolderEvents:
    """Linux inotify on a file's folder: :meth:`wait` returns as soon as something in it is written,
    created, moved or deleted (editors often save by writing a new file and renaming it)."""

    _MASK = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE

    def __init__(self, fd: int, name: bytes):
        self.fd = fd
        self.name = name  # the watched file's name in its folder

    @classmethod
    def open(cls, path) -> "FolderEvents | None":
        """Events for ``path``'s folder, or None where there are none (not Linux, no inotify, no watches left)."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols, libc's among them
            fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                return None
            folder = os.fsencode(os.path.dirname(os.path.abspath(path)))
            if libc.inotify_add_watch(fd, folder, cls._MASK) < 0:
                os.close(fd)
                return None
        except (OSError, AttributeError):
            return None
        return cls(fd, os.fsencode(os.path.basename(os.path.abspath(path))))

    def wait(self, timeout_s: float) -> bool:
        """Until an event arrives or ``timeout_s`` has passed. True when a write of the watched file
        was closed, or a file was renamed onto it: the save is complete, no need to let it settle."""
        readable, _, _ = select.select([self.fd], [], [], timeout_s)
        saved = False
        while readable:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            saved = saved or self._finished_a_save(data)
        return saved

    def _finished_a_save(self, data: bytes) -> bool:
        offset = 0
        while offset + EVENT_HEADER.size <= len(data):
            _wd, mask, _cookie, size = EVENT_HEADER.unpack_from(data, offset)
            offset += EVENT_HEADER.size
            name = data[offset:offset + size].rstrip(b"\0")
            offset += size
            if mask & (IN_CLOSE_WRITE | IN_MOVED_TO) and name == self.name:
                return True
        return False

    def close(self) -> None:
        os.close(self.fd)
