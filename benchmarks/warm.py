"""Warm gradings of one file, as `ddp-grade watch` and the grading server make them: the benchmarks' shared
measurement (the first grading, then the median of the later ones)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path


def gradings(path: Path, count: int) -> tuple[float, float]:
    """(seconds of the first grading, median seconds of the ``count`` after it) of ``path`` in one warm
    session; exits when a grading does not pass."""
    from grader import grading
    from grader.rank import harness
    from grader.grading import GradeOptions, grade_file

    grading.warm_up()
    walls = []
    with harness.Session(spares=True) as session:
        for _ in range(count + 1):
            start = time.perf_counter()
            report = grade_file(str(path), session, GradeOptions())
            walls.append(time.perf_counter() - start)
            if report.status != "passed":
                sys.exit(f"{path.name} did not pass: {report.status}")
    return walls[0], statistics.median(walls[1:]) if count else float("nan")
