"""What a run did, as data: each rank's outcome and the whole world's, and which rank is the cause
when several failed. :mod:`grader.rank.harness` fills them in; the checks and the diagnosis read them."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass
class RankOutcome:
    """What one rank did."""

    rank: int
    status: str  # "ok", "error" (raised), "exited" (ended without a result), "killed" (stopped by us)
    result: object = None  # the driver's return value when status == "ok"
    error: dict | None = None  # type, message, traceback, where, phase when status == "error"
    exitcode: int | None = None
    stack: str = ""  # faulthandler's dump when the rank was stopped or crashed
    output: str = ""  # the end of what the rank printed
    seconds: float = 0.0
    limit: str = ""  # "memory", "cpu" or "output" when the rank hit that limit
    limit_detail: str = ""  # e.g. "the memory limit (2048 MiB resident; --memory-limit changes it)"
    pid: int | None = None  # the process the harness started for the rank, as the harness saw it

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class WorldOutcome:
    """What a whole run (all ranks) did."""

    world_size: int
    ranks: list[RankOutcome]
    timed_out: bool = False
    seconds: float = 0.0
    run_dir: str = ""
    stray_processes: int = 0  # processes the submission left behind that had to be killed
    # Seconds spent starting the ranks (a cold warm pool importing torch and the checks included):
    # the grader's time, not the submission's, so the deadline counts from after it.
    start_s: float = 0.0
    # What the kernel counted between the ranks (grader.traffic.RunTraffic), set by the grader for a run it
    # counted: never what the ranks or the sandbox's host say.
    traffic: object = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.ok for r in self.ranks)

    def results(self) -> list:
        return [r.result for r in self.ranks]

    def failures(self) -> list[RankOutcome]:
        """Ranks that raised or ended early (not those merely stopped after them)."""
        return [r for r in self.ranks if r.status in ("error", "exited")]

    def still_running(self) -> list[RankOutcome]:
        return [r for r in self.ranks if r.status == "killed"]


class SessionBroken(BaseException):
    """A session that cannot start or answer runs any more because of what the submission did (its
    sandbox was ended: a limit of the whole sandbox, or an answer the grader cannot read). The
    message says what happened; ``limit`` names the limit ("" when none). A BaseException, as the
    grading's own stop is: no check's ``except Exception`` may swallow it."""

    limit: str = ""


# What a rank raises when a peer it talks to has died: a consequence, not a cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _blame(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """A rank that only lost a failed peer is marked stopped (``killed``), so the cause is named.

    When rank 1 crashes, rank 0's next collective raises "Connection closed by
    peer"; that error stays in ``error`` (and its details), but the rank that
    crashed, exited or raised something else is the failure to report.
    """
    def peer_lost(o: RankOutcome) -> bool:
        message = str((o.error or {}).get("message", ""))
        return o.status == "error" and any(p in message for p in PEER_LOST)

    causes = [o for o in outcomes if o.status in ("error", "exited") and not peer_lost(o)]
    if causes:
        for o in outcomes:
            if peer_lost(o):
                o.status = "killed"
    return outcomes


def describe_exit(code: int | None, limit_detail: str = "") -> str:
    """"was killed by SIGSEGV", "exited with code 3", "was stopped at the memory limit (...)", "ended"."""
    if limit_detail:
        return f"was stopped at {limit_detail}"
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
