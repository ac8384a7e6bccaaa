"""The live line on stderr while a grading runs: which run, on how many ranks, checks decided so far.

On a terminal it is one line rewritten in place and erased at the end; elsewhere (a pipe, a CI
log) each run is one plain line with no control characters; with ``--quiet`` nothing at all.
"""

from __future__ import annotations

import sys
import threading
import time

from grader.rank.untrusted import clean_line

TTY, PLAIN, QUIET = "tty", "plain", "quiet"
TICK_S = 0.5  # how often the line is redrawn on a terminal while nothing happens


def mode_for(stream, quiet: bool) -> str:
    if quiet:
        return QUIET
    isatty = getattr(stream, "isatty", None)
    try:
        return TTY if isatty is not None and isatty() else PLAIN
    except ValueError:  # closed stream
        return PLAIN


class LiveLine:
    """Pass :meth:`event` as ``on_event`` to :func:`grader.grading.grade_file`."""

    def __init__(self, label: str, mode: str, stream=None, clock=time.monotonic):
        self.label = clean_line(label)  # "exercise 03"
        self.mode = mode
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = clock()
        self.runs = 0
        self.checks: dict[str, str] = {}
        self._shown = False
        self._what = ""
        self._lock = threading.RLock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def event(self, kind: str, **info) -> None:
        if kind == "run":
            self.runs += 1
            what = info.get("label") or (f"{info['driver']} on {info['world_size']} "
                                         f"rank{'s' if info['world_size'] != 1 else ''}")
            self._show(f"run {self.runs}: {what}")
        elif kind == "worker":
            self.runs += 1
            self._show(f"run {self.runs}: {info['driver']} in one process")
        elif kind == "check":
            if self.checks.get(info["check_id"]) != "fail":
                self.checks[info["check_id"]] = info["status"]
            if self.mode == TTY:
                self._show(f"checked {info['check_id']}")

    def _show(self, what: str) -> None:
        if self.mode == QUIET:
            return
        self._what = what
        if self.mode == TTY and self._ticker is None:
            self._start_ticker()
        self._draw()

    def _start_ticker(self) -> None:
        """On a terminal, redraw every TICK_S so the clock keeps moving while a long run waits."""
        stop = self._stop = threading.Event()

        def tick() -> None:
            while not stop.wait(TICK_S):
                with self._lock:
                    if not stop.is_set():
                        self._draw()

        self._ticker = threading.Thread(target=tick, name="ddp-grade-live-line", daemon=True)
        self._ticker.start()

    def _draw(self) -> None:
        what = self._what
        decided = len(self.checks)
        text = f"grading {self.label}: {what} ({decided} check{'s' if decided != 1 else ''} decided, " \
               f"{self.clock() - self.started:.1f} s)"
        with self._lock:
            if self.mode == TTY:
                self.stream.write("\r\x1b[K" + text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
            self._shown = True

    def done(self) -> None:
        """Stop the clock and erase the line on a terminal, so the report starts on a clean line."""
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join(timeout=1)
            self._ticker = None
        if self.mode == TTY and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class BatchLine:
    """The live line of ``ddp-grade batch``: done / total, how they went, time spent and left, what is graded now.

    On a terminal one line is rewritten in place (and erased at the end); elsewhere each finished
    submission is one plain line, ``[3/20] passed alice/03_train.py``; with ``--quiet`` nothing.
    """

    def __init__(self, total: int, mode: str, stream=None, clock=time.monotonic, width=None):
        self.total = total
        self.mode = mode
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.width = width  # of the terminal; None: ask it when drawing
        self.started = clock()
        self.done_count = 0
        self.statuses: dict[str, int] = {}
        self.current: list[str] = []  # submissions being graded now, in the order they started
        self._shown = False
        self._lock = threading.RLock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def begin(self, name: str) -> None:
        name = clean_line(name)
        with self._lock:
            self.current.append(name)
            self._redraw()

    def finish(self, name: str, status: str) -> None:
        name = clean_line(name)
        with self._lock:
            if name in self.current:
                self.current.remove(name)
            self.done_count += 1
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if self.mode == PLAIN:
                self.stream.write(f"[{self.done_count}/{self.total}] {status:<8} {name}\n")
                self.stream.flush()
            self._redraw()

    def text(self) -> str:
        """The line as drawn now (without control characters)."""
        elapsed = self.clock() - self.started
        counts = [f"{self.statuses.get('passed', 0)} passed", f"{self.statuses.get('failed', 0)} failed"]
        for status, words in (("timeout", "timed out"), ("unusable", "could not be graded")):
            if self.statuses.get(status):
                counts.append(f"{self.statuses[status]} {words}")
        line = f"batch {self.done_count}/{self.total} done ({', '.join(counts)}), {duration(elapsed)}"
        if 0 < self.done_count < self.total:
            line += f", about {duration(elapsed / self.done_count * (self.total - self.done_count))} left"
        if self.current:
            line += "; grading " + ", ".join(self.current)
        return line

    def _redraw(self) -> None:
        if self.mode != TTY:
            return
        if self._ticker is None:
            self._start_ticker()
        self._draw()

    def _start_ticker(self) -> None:
        stop = self._stop = threading.Event()

        def tick() -> None:
            while not stop.wait(TICK_S):
                with self._lock:
                    if not stop.is_set():
                        self._draw()

        self._ticker = threading.Thread(target=tick, name="ddp-grade-batch-line", daemon=True)
        self._ticker.start()

    def _draw(self) -> None:
        import shutil

        width = self.width or shutil.get_terminal_size((100, 24)).columns
        text = self.text()
        if len(text) > width - 1:  # a line longer than the terminal would wrap, and \r would not reach its start
            text = text[: max(width - 4, 1)] + "..."
        with self._lock:
            self.stream.write("\r\x1b[K" + text)
            self.stream.flush()
            self._shown = True

    def done(self) -> None:
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join(timeout=1)
            self._ticker = None
        if self.mode == TTY and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def duration(seconds: float) -> str:
    """42 s, 3 min 05 s, 1 h 02 min."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
