"""Hostile submissions: every one gets its true verdict, quickly, and leaves nothing behind.

Each file in tests/hostile/ is an exercise file (named NN_what.py) that says at
its top what the grader must answer:

    # expect-status: passed|failed|timeout|unusable   the overall status (and so the exit code)
    # expect-problem: text      the shown report contains this (one line per text)
    # expect-fail: check-id     this check fails
    # expect-absent: text       the shown report does not contain this
    # grade-args: --timeout 8   extra command-line options

Each is graded through the command line (``ddp-grade grade FILE -v``), and every
test asserts the same guarantees: the exit code; the run ended within its timeout
plus 10 s; no process carrying the run's marker is alive afterwards; the run's
temporary folder is gone; the learner's file is unchanged; the shown output is
bounded.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from grader import grading
from grader.rank import harness
from grader.cli import main

HOSTILE = Path(__file__).resolve().parent / "hostile"
FILES = sorted(HOSTILE.glob("[0-9][0-9]_*.py"))
EXIT = {"passed": 0, "failed": 1, "unusable": 2, "timeout": 3}
MARGIN_S = 10.0  # every run ends within its timeout plus this
MAX_SHOWN_CHARS = 40_000  # the whole report, details included, stays below this
DEFAULT_TIMEOUT_S = 60.0


def expectations(path: Path) -> dict:
    text = path.read_bytes().decode("utf-8", errors="replace")
    found = {"status": None, "problem": [], "fail": [], "absent": [], "args": []}
    for key, value in re.findall(r"^# (expect-status|expect-problem|expect-fail|expect-absent|grade-args): *(.+)$",
                                 text, re.M):
        value = value.strip()
        if key == "expect-status":
            found["status"] = value
        elif key == "grade-args":
            found["args"] += shlex.split(value)
        else:
            found[key.split("-")[1]].append(value)
    return found


def _timeout(args: list[str]) -> float:
    return float(args[args.index("--timeout") + 1]) if "--timeout" in args else DEFAULT_TIMEOUT_S


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@pytest.fixture
def graded(monkeypatch, tmp_path):
    """graded(path, *args) -> (result, seconds, sessions): a CLI grading, with its sessions recorded."""
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    grading.warm_up()
    sessions: list[harness.Session] = []

    class RecordingSession(harness.Session):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sessions.append(self)

    monkeypatch.setattr(harness, "Session", RecordingSession)

    def _graded(path, *args):
        started = time.monotonic()
        result = CliRunner().invoke(main, ["grade", str(path), "-q", "-v", *args])
        return result, time.monotonic() - started, sessions

    return _graded


def assert_guarantees(result, seconds: float, sessions, path: Path, digest_before, timeout_s: float) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback (most recent call last)" not in result.output.split("details:")[0]
    assert seconds < timeout_s + MARGIN_S, f"took {seconds:.1f} s with a timeout of {timeout_s:g} s"
    for s in sessions:
        assert harness.marked_processes(s.marker, marker_file=s.marker_file) == [], "a process of the run is still alive"
        assert not os.path.exists(s.tmp), "the run's temporary folder was left behind"
    assert _digest(path) == digest_before, "the learner's file changed"
    assert len(result.output) < MAX_SHOWN_CHARS, f"{len(result.output)} characters shown"
    raw = re.findall(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", result.output)
    assert raw == [], f"control characters reached the terminal: {sorted(set(raw))}"


def _param(path: Path):
    marks = [] if expectations(path)["status"] == "unusable" else [pytest.mark.slow]
    return pytest.param(path, id=path.stem, marks=marks)


def test_every_hostile_file_says_what_it_expects():
    assert len(FILES) >= 20
    for path in FILES:
        e = expectations(path)
        assert e["status"] in EXIT, f"{path.name}: no valid expect-status line"
        if e["status"] != "passed":
            assert e["problem"] or e["fail"], f"{path.name}: says nothing about what must be reported"


@pytest.mark.parametrize("path", [_param(p) for p in FILES])
def test_hostile_submission_gets_its_verdict(graded, path):
    e = expectations(path)
    before = _digest(path)
    result, seconds, sessions = graded(path, *e["args"])
    assert result.exit_code == EXIT[e["status"]], result.output[-3000:]
    for text in e["problem"]:
        assert text in result.output, (text, result.output[-3000:])
    for check_id in e["fail"]:
        assert re.search(rf"FAIL\s+{re.escape(check_id)}\b", result.output), (check_id, result.output[-3000:])
    for text in e["absent"]:
        assert text not in result.output, text
    assert_guarantees(result, seconds, sessions, path, before, _timeout(e["args"]))


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "01_setup.py", "no such file"),
    (lambda d: (d / "01_setup.py").mkdir() or d / "01_setup.py", "is a folder"),
    (lambda d: (d / "01_setup.py").write_bytes(b"") or d / "01_setup.py", "does not define setup_ddp"),
    (lambda d: (d / "setup.py").write_text("x = 1\n") and d / "setup.py", "cannot tell which exercise"),
    (lambda d: os.mkfifo(d / "01_setup.py") or d / "01_setup.py", "is not a regular file (a FIFO)"),
    (lambda d: Path(os.devnull), "is not a regular file (a character device)"),
], ids=["missing-path", "directory", "zero-bytes", "unnamed", "fifo", "device"])
def test_unusable_paths_get_one_clear_line_and_exit_2(graded, tmp_path, make, message):
    """A FIFO (what a shell glob can name) is refused without being opened: reading one waits for a writer."""
    path = make(tmp_path)
    before = _digest(path)
    result, seconds, sessions = graded(path)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert_guarantees(result, seconds, sessions, path, before, DEFAULT_TIMEOUT_S)
