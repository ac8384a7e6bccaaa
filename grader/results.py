"""Check results and grading reports as plain data, separate from how they are shown."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from grader.options import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_UNUSABLE

PASS = "pass"
FAIL = "fail"
ERROR = "error"  # the check could not be evaluated (not run, or the grader could not decide)
SKIP = "skip"  # does not apply here (e.g. an NCCL-only check on gloo)

# Overall statuses and their exit codes.
PASSED = "passed"
FAILED = "failed"
UNUSABLE = "unusable"  # the file could not be graded
TIMEOUT = "timeout"
EXIT_CODES = {PASSED: EXIT_OK, FAILED: EXIT_FAILED, UNUSABLE: EXIT_UNUSABLE, TIMEOUT: EXIT_TIMEOUT}


@dataclass
class CheckResult:
    """The verdict of one check."""

    id: str  # stable check id
    title: str  # what the check establishes
    status: str  # pass, fail, error or skip
    message: str = ""  # what was observed, in terms a learner acts on
    rank: int | None = None  # the rank that shows the problem, when one does
    world_size: int | None = None  # the world size of the run that shows it
    seconds: float = 0.0  # time spent deciding it (including its runs)
    points: float = 1.0  # weight in the score
    hint: str = ""  # what to look at when it fails

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Report:
    """Everything one grading of one file found."""

    exercise: str  # "03"
    title: str
    path: str
    status: str  # passed, failed, unusable or timeout
    checks: list[CheckResult] = field(default_factory=list)
    problem: str | None = None  # a run-level problem: timeout, not implemented, import error
    details: str = ""  # per-rank stacks or output that explain the problem
    backend: str = ""
    world_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks if c.status == PASS)

    @property
    def max_points(self) -> float:
        return sum(c.points for c in self.checks if c.status != SKIP)

    def counts(self) -> dict:
        out = {PASS: 0, FAIL: 0, ERROR: 0, SKIP: 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    def to_dict(self) -> dict:
        """The stable JSON shape (``schema`` 1), documented in the README."""
        return {
            "schema": 1,
            "exercise": self.exercise,
            "title": self.title,
            "path": self.path,
            "status": self.status,
            "exit_code": self.exit_code,
            "problem": self.problem,
            "details": self.details,
            "backend": self.backend,
            "world_sizes": list(self.world_sizes),
            "seconds": round(self.seconds, 3),
            "score": {"points": self.points, "max_points": self.max_points},
            "counts": self.counts(),
            "checks": [c.to_dict() for c in self.checks],
        }


def overall_status(checks: list[CheckResult]) -> str:
    """passed when no check failed or errored."""
    return PASSED if all(c.status in (PASS, SKIP) for c in checks) else FAILED
