"""``ddp-grade watch``: re-grade an exercise file on every save.

Saves are found by polling (every 0.05 s) the file's modification time, size and content hash:
file-system events do not reach containers, WSL or network mounts, polling does, and it needs
no extra dependency. A change is graded once the file has stayed the same for 0.03 s (editors
may write in several steps). Reading and hashing an exercise file 20 times a second costs
next to nothing. The grading reuses one warm harness session for the whole watch, so
each verdict comes from processes that already have torch imported.
"""

from __future__ import annotations

import hashlib
import os
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
    ignored) and the file then stays unchanged for SETTLE_S.
    """
    stop = stop or threading.Event()
    graded = 0
    last = fingerprint(path)
    on_change(graded := graded + 1)
    while not stop.is_set() and (max_grades is None or graded < max_grades):
        sleep(poll_s)
        if stop.is_set():
            break
        now = fingerprint(path)
        if now == last:
            continue
        if now.digest == last.digest:
            last = now  # touched, not changed
            continue
        sleep(SETTLE_S)  # let a multi-step save finish
        settled = fingerprint(path)
        if settled != now:
            continue  # still being written: look again at the next poll
        last = settled
        on_change(graded := graded + 1)
    return graded
