"""Shared fixtures: one warm grading session for the whole test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grader import grading, harness
from grader.grading import GradeOptions, grade_file

ROOT = Path(__file__).resolve().parent.parent

# No test starts the background grading server unless it sets this itself (tests/test_server.py).
os.environ["DDP_GRADE_SERVER"] = "0"
VARIANTS = ROOT / "tests" / "variants"


@pytest.fixture(scope="session")
def session():
    """A grading session (warm forkserver with torch imported) shared by all tests."""
    grading.warm_up()
    with harness.Session() as s:
        yield s


@pytest.fixture
def grade(session):
    """grade(path, exercise=None, **GradeOptions fields) -> Report."""

    def _grade(path, exercise=None, **options):
        options.setdefault("timeout_s", 60)
        return grade_file(str(path), session, GradeOptions(**options), exercise)

    return _grade


def statuses(report) -> dict:
    """{check id: status} of a report."""
    return {c.id: c.status for c in report.checks}
