"""What a checks module works with, typed: ``grade(g: Grader)`` in the grader's process.

A check module never imports the grading layer (tests/test_layers.py); it annotates with this
instead. :class:`grader.grading.Grading` is the one implementation, and
``tests/test_layers.py`` checks that it has every member named here, with the same parameters.

An exercise (CONTRIBUTING.md has the template) is:

* **its drivers**, ``grader/rank/drivers/exNN_slug.py`` (the rank side, the one package a sandbox holds):
  ``def something_main(ctx: RankContext) -> dict`` (:class:`grader.rank.child.RankContext`) runs in every
  rank, calls the learner's functions, records what happened (plain data), decides nothing;
* **its checks**, ``grader/checks/exNN_slug[.py]``: ``def grade(g: Grader) -> None`` starts runs of the
  drivers, reads their records, and records one verdict per check of the catalog (``g.record``,
  ``g.skip``, ``g.not_checked``);
* helpers several exercises share live in :mod:`grader.rank.drivers.shared` (what a driver records, the
  models copied from the stubs, the debugging track's job runner) and :mod:`grader.checks.shared` (what the
  checks share).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

from grader.rank.harness import Worker, WorldOutcome

__all__ = ["Grader"]


class Grader(Protocol):
    """What ``grade(g)`` receives (implemented by :class:`grader.grading.Grading`)."""

    Stopped: type[BaseException]  # what ``stop`` raises (let it pass through, e.g. through Hypothesis)
    Run: type  # one run for ``run_at_once``: Run(driver, world_size, kwargs=None, env=None, label=None, expect_ok=True)
    path: str  # the learner's file, absolute

    @property
    def backend(self) -> str:
        """gloo or nccl: the backend the grading runs with."""

    @property
    def backend_requested(self) -> str:
        """What --backend said: auto, gloo or nccl."""

    @property
    def world_sizes(self) -> list[int]:
        """The world sizes to grade, in order."""

    def remaining(self) -> float:
        """Seconds left before the grading's deadline."""

    def run(self, driver: Callable | str, world_size: int, *, kwargs: dict | None = None, env: dict | None = None,
            expect_ok: bool = True, backend: str | None = None, label: str | None = None,
            graded_size: int | None = None, traffic: bool = False) -> WorldOutcome:
        """Run ``driver`` (the rank-side function itself) on ``world_size`` fresh ranks; stops the grading on a timeout
        (and, with ``expect_ok``, on a rank that failed). ``traffic``: the kernel counts the bytes between the ranks
        (``outcome.traffic``, a grader.traffic.RunTraffic, None where it cannot)."""

    def run_at_once(self, runs: list[Any]) -> Iterator[WorldOutcome]:
        """Start every run at the same time; yield their outcomes in order, each checked as ``run`` would."""

    def worker(self, driver: Callable | str, kwargs: dict | None = None) -> Worker:
        """One process that answers calls (for pure functions)."""

    def call(self, worker: Worker, name: str, **kwargs) -> Any:
        """Call handler ``name`` in ``worker``; its result (stops the grading on a timeout or crash)."""

    def try_call(self, worker: Worker, name: str, *, within_s: float, **kwargs) -> Any:
        """Call handler ``name``; its result, or None when it raised, crashed or took too long."""

    def stop_on_failures(self, outcome: WorldOutcome, single: bool = False) -> None:
        """Stop the grading with the run's problem when a rank failed."""

    def stop(self, message: str, *, status: str = "failed", world_size: int | None = None,
             rank: int | None = None) -> None:
        """End the grading: nothing further can be checked (raises ``Stopped``)."""

    def not_implemented(self, name: str) -> None:
        """End the grading: ``name`` is still a stub."""

    @staticmethod
    def with_context(exc: BaseException, context: str) -> BaseException:
        """``exc`` (a Stopped) with what the grader was doing when it happened."""

    def record(self, check_id: str, ok: bool, message: str = "", *, rank: int | None = None,
               world_size: int | None = None, evidence: str | None = None) -> bool:
        """Record one observation for a check (a failure is kept over later passes); returns ``ok``. ``evidence``:
        what it stood on, where not what the catalog says (a claim, where the kernel could not be read)."""

    def not_checked(self, check_id: str, because: str, reason: str, *, world_size: int | None = None) -> None:
        """The check could not be decided because check ``because`` failed."""

    def skip(self, check_id: str, reason: str) -> None:
        """The check does not apply here (e.g. NCCL only)."""

    def section(self, title: str, text: str, data: dict | None = None) -> None:
        """An observation beyond the verdicts, shown under the checks (``data`` goes into the JSON)."""

    def add_timeline(self, entries: list[dict]) -> None:
        """Events of a whole job, in order, as the report's timeline section."""
