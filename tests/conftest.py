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
# default options are graded one after another in a background process (one warm session, the
# same call as the ``grade`` fixture's) from the start of the run, while the rest of the suite
# goes on; ``grade`` hands each test its report. Every test still asserts on a real grading.
BACKGROUND_EXERCISES = ("15",)
_background = None


class BackgroundGradings:
    """Grade ``paths`` one at a time in one background process; reports by path."""

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
        command = [sys.executable, "-c", _GRADE_EACH, *map(str, self.paths)]
        errors = os.path.join(self.state, "stderr.txt")  # a file: a full pipe would stall the grader
        try:
            with open(errors, "w") as stderr:
                self.process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                                stderr=stderr, text=True)
                for line in self.process.stdout:
                    if line.startswith(_MARK):
                        found = json.loads(line[len(_MARK):])
                        path = Path(found["path"])
                        self.results[path] = report_from_dict(found["report"])
                        self.done[path].set()
                self.process.wait()
            with open(errors) as f:
                error = f"exit {self.process.returncode}:\n{f.read()[-3000:]}"
        except Exception as exc:  # the tests that ask for these reports fail with it
            error = repr(exc)
        for path in self.paths:
            if not self.done[path].is_set():
                self.results[path] = "stopped" if self.stopped else \
                    f"the background gradings ended before {path.name} ({error})"
                self.done[path].set()


# One process, one warm session, the same call as the ``grade`` fixture's: one JSON line per file.
_MARK = "@@report "
_GRADE_EACH = f"""
import json, sys
from grader import grading, harness
from grader.grading import GradeOptions, grade_file
grading.warm_up()
with harness.Session() as session:
    for path in sys.argv[1:]:
        report = grade_file(path, session, GradeOptions(timeout_s=60), None)
        print({_MARK!r} + json.dumps({{"path": path, "report": report.to_dict()}}), flush=True)
"""


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
