"""Shared fixtures: one warm grading session for the whole test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from grader import grading, harness
from grader.grading import GradeOptions, grade_file
from grader.results import report_from_dict

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
        if _background is not None and exercise is None and not options and _background.has(path):
            return _background.report(path)
        options.setdefault("timeout_s", 60)
        return grade_file(str(path), session, GradeOptions(**options), exercise)

    return _grade


# --- gradings that run in the background ------------------------------------------------------
#
# A grading of these exercises starts real torchrun jobs of its own: about 30 s each, most of it
# starting worker processes, one core busy. The files the selected tests will grade with the
# default options are graded one after another by the command line (``--format json``) in a
# background thread from the start of the run, while the rest of the suite goes on; ``grade``
# hands each test its report. Every test still asserts on a real grading of its file.
BACKGROUND_EXERCISES = ("15",)
_background = None


class BackgroundGradings:
    """Grade ``paths`` one at a time with ``python -m grader``, in a thread; reports by path."""

    def __init__(self, paths: list[Path]):
        self.paths = [Path(p).resolve() for p in paths]
        self.results: dict[Path, object] = {}
        self.done = {p: threading.Event() for p in self.paths}
        self.process: subprocess.Popen | None = None
        self.stopped = False
        self.state = tempfile.mkdtemp(prefix="ddp-grade-background-")
        # The environment as the run began: tests that set a variable of their own (a tag they look
        # for in /proc, a server switch) must not find it in these processes.
        self.env = {**os.environ, "DDP_GRADE_STATE_DIR": self.state, "DDP_GRADE_SERVER": "0"}
        self.thread = threading.Thread(target=self._run, name="background gradings", daemon=True)
        self.thread.start()

    def has(self, path) -> bool:
        return Path(path).resolve() in self.done

    def report(self, path):
        key = Path(path).resolve()
        if not self.done[key].wait(timeout=1800):
            pytest.fail(f"the background grading of {key.name} did not end")
        result = self.results[key]
        if isinstance(result, str):
            pytest.fail(result)
        return result

    def stop(self) -> None:
        self.stopped = True
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        self.thread.join(timeout=30)
        subprocess.run(["rm", "-rf", self.state], check=False)

    def _run(self) -> None:
        for path in self.paths:
            try:
                self.results[path] = "stopped" if self.stopped else self._grade(path)
            except Exception as exc:  # the test that asks for this report fails with it
                self.results[path] = f"grading {path.name} in the background failed: {exc!r}"
            self.done[path].set()

    def _grade(self, path: Path):
        command = [sys.executable, "-m", "grader", "grade", str(path), "--format", "json", "--no-server",
                   "--timeout", "60"]
        self.process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        try:
            out, err = self.process.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        try:
            return report_from_dict(json.loads(out))
        except (ValueError, KeyError) as exc:
            return f"no JSON report from {' '.join(command[1:])} (exit {self.process.returncode}, {exc!r}):\n" \
                   f"{out[-2000:]}\n{err[-3000:]}"


def _graded_path(item) -> Path | None:
    """The file a selected test grades with default options, when it is a background exercise's."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname in ("test_variant_fails_with_the_right_check", "test_right_answer_passes"):
        path = params.get("path")
        if path is not None and path.name.startswith(tuple(f"{n}_" for n in BACKGROUND_EXERCISES)):
            options = path.read_text(encoding="utf-8", errors="replace")
            return None if "# grade-options:" in options else path
    if item.originalname == "test_solution_passes_every_check":
        exercise = params.get("exercise")
        if exercise is not None and exercise.id in BACKGROUND_EXERCISES:
            return ROOT / "solutions" / exercise.filename
    return None


def pytest_collection_finish(session):
    global _background
    paths = [p for p in (_graded_path(item) for item in session.items) if p is not None]
    if paths:
        _background = BackgroundGradings(list(dict.fromkeys(paths)))  # in the order the tests ask


def pytest_sessionfinish(session, exitstatus):
    if _background is not None:
        _background.stop()


def statuses(report) -> dict:
    """{check id: status} of a report."""
    return {c.id: c.status for c in report.checks}
