"""Shared fixtures: one warm grading session for the whole test run."""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import background
from grader import grading
from grader.rank import harness
from grader.grading import GradeOptions, grade_file
from grader.results import report_from_dict

ROOT = Path(__file__).resolve().parent.parent


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` of a command a test stops with Ctrl-C: SIGINT as a terminal's foreground job has it. A shell
    starts a background job with SIGINT ignored, a command inherits that, and a Python started so keeps it (it
    installs no KeyboardInterrupt): a suite run as such a job would start its commands deaf to their Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kit_files(root: Path = ROOT) -> list[str]:
    """The kit's files, as paths relative to ``root``: git's list where the kit is a git checkout; in a copy without
    git (a downloaded archive), every file below ``root`` but ``.git`` and what ``.gitignore`` names (caches and
    build outputs: ``.hypothesis``, ``__pycache__``, ``.venv``, ...), which is the one list of what is not the kit's."""
    if (root / ".git").exists():
        try:
            listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, timeout=60)
            if listed.returncode == 0:
                return [path for path in listed.stdout.split("\0") if path]
        except (OSError, subprocess.SubprocessError):
            pass
    ignored = not_the_kits(root)
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git" and not any(fnmatch.fnmatch(d, p) for p in ignored)]
        relative = Path(folder).relative_to(root)
        found += [(relative / n).as_posix() for n in names
                  if not any(fnmatch.fnmatch(n, p) for p, folders_only in ignored.items() if not folders_only)]
    return sorted(found)


def not_the_kits(root: Path = ROOT) -> dict[str, bool]:
    """What ``.gitignore`` names, pattern -> whether it names folders only ("build/"); each pattern is a file or
    folder name anywhere below the kit. A pattern of another form (a path, "!", "**") is refused here rather than
    read as something else."""
    patterns = {}
    try:
        lines = (root / ".gitignore").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return patterns
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name = line[:-1] if line.endswith("/") else line
        if "/" in name or line.startswith("!") or "**" in name:
            raise ValueError(f".gitignore: {line!r} is not a name; kit_files reads only names (tests/conftest.py)")
        patterns[name] = line.endswith("/")
    return patterns

# No test starts the background grading server unless it sets this itself (tests/test_server.py).
os.environ["DDP_GRADE_SERVER"] = "0"
VARIANTS = ROOT / "tests" / "variants"


@pytest.fixture(scope="session", autouse=True)
def _tests_folders_are_the_graders(tmp_path_factory):
    """A test that hands a verdict function files it wrote plays the grader's part: its temporary
    folders are read as the grading's own folder is (grader.rank.untrusted reads nothing outside one)."""
    from grader.rank import untrusted

    untrusted.trust_folder(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def session():
    """A grading session (warm forkserver with torch imported) shared by all tests, with spares
    as watch, the server and batches make it."""
    grading.warm_up()
    with harness.Session(spares=True) as s:
        yield s


@pytest.fixture
def grade(session):
    """grade(path, exercise=None, **GradeOptions fields) -> Report."""

    def _grade(path, exercise=None, **options):
        key = background.grade_key(path, options)
        if _background is not None and exercise is None and _background.has(key):
            return report_from_dict(_background.result(key))
        options.setdefault("timeout_s", background.GRADE_TIMEOUT_S)
        return grade_file(str(path), session, GradeOptions(**options), exercise)

    return _grade


# --- jobs that run in the background -----------------------------------------------------------
#
# tests/background.py says why. The jobs are what the selected tests' "background" marks declare,
# gathered at collection finish; ``grade`` and ``cli_grading`` hand each test its result.
_background = None


class BackgroundJobs:
    """Run ``jobs`` one at a time in one background process; results by key."""

    def __init__(self, jobs: list[dict]):
        self.jobs = jobs
        self.results: dict[str, object] = {}
        self.done = {job["key"]: threading.Event() for job in jobs}
        self.process: subprocess.Popen | None = None
        self.stopped = False
        self.starting = threading.Lock()
        self.state = tempfile.mkdtemp(prefix="ddp-grade-background-")
        self.started = time.monotonic()
        self.finished_at: float | None = None  # seconds after the start, when the last job ended
        self.waited_s = 0.0  # how long the tests waited for results in all
        # The environment as the run began: tests that set a variable of their own (a tag they look
        # for in /proc, a server switch) must not find it in these processes.
        self.env = {**os.environ, "DDP_GRADE_STATE_DIR": self.state, "DDP_GRADE_SERVER": "0"}
        self.thread = threading.Thread(target=self._run, name="background jobs", daemon=True)
        self.thread.start()

    def has(self, key: str) -> bool:
        return key in self.done

    def result(self, key: str):
        asked = time.monotonic()
        finished = self.done[key].wait(timeout=1800)
        self.waited_s += time.monotonic() - asked
        if not finished:
            pytest.fail(f"the background job {key} did not end")
        result = self.results[key]
        if isinstance(result, str):
            pytest.fail(result)
        return result

    def stop(self) -> None:
        with self.starting:  # not started after this, or started and then killed here
            self.stopped = True
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
        # What it started too (its pool holds the pipe the thread reads): they carry its state folder.
        for pid in background.processes_with(f"DDP_GRADE_STATE_DIR={self.state}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.thread.join(timeout=30)
        subprocess.run(["rm", "-rf", self.state], check=False)

    def _run(self) -> None:
        listing = os.path.join(self.state, "jobs.json")
        with open(listing, "w") as f:
            json.dump(self.jobs, f)
        command = [sys.executable, str(ROOT / "tests" / "background.py"), listing, self.state]
        errors = os.path.join(self.state, "stderr.txt")  # a file: a full pipe would stall the jobs
        try:
            with open(errors, "w") as stderr:
                with self.starting:
                    if self.stopped:
                        raise RuntimeError("stopped before it started")
                    self.process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                                    stderr=stderr, text=True)
                for line in self.process.stdout:
                    if line.startswith(background.MARK):
                        found = json.loads(line[len(background.MARK):])
                        self.results[found["key"]] = found["result"]
                        self.done[found["key"]].set()
                self.process.wait()
            self.finished_at = time.monotonic() - self.started
            with open(errors) as f:
                error = f"exit {self.process.returncode}:\n{f.read()[-3000:]}"
        except Exception as exc:  # the tests that ask for these results fail with it
            error = repr(exc)
        for key, done in self.done.items():
            if not done.is_set():
                self.results[key] = ("stopped" if self.stopped
                                     else f"the background jobs ended before {key} ({error})")
                done.set()


@pytest.fixture
def cli_grading(tmp_path):
    """cli_grading(path, *args, timeout_s) -> {returncode, stdout, stderr, left}: see tests/background.py."""

    def _cli_grading(path, *args, timeout_s):
        key = background.cli_key(path, list(args))
        if _background is not None and _background.has(key):
            return _background.result(key)
        return background.cli_grading(path, list(args), tmp_path / "state", timeout_s)

    return _cli_grading


def pytest_collection_finish(session):
    global _background
    jobs = {}
    for item in session.items:
        for mark in item.iter_markers("background"):
            jobs.setdefault(mark.kwargs["job"]["key"], mark.kwargs["job"])  # in the order the tests ask
    if jobs:
        _background = BackgroundJobs(list(jobs.values()))


def pytest_sessionfinish(session, exitstatus):
    if _background is not None:
        _background.stop()


def pytest_terminal_summary(terminalreporter):
    if _background is not None and _background.finished_at is not None:
        terminalreporter.write_line(
            f"background jobs: {len(_background.jobs)} ran in {_background.finished_at:.0f} s from collection; "
            f"tests waited {_background.waited_s:.0f} s for them")


def statuses(report) -> dict:
    """{check id: status} of a report."""
    return {c.id: c.status for c in report.checks}
