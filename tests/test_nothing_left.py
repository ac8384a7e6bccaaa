"""`ddp-grade` returns only after every process it started has exited, its warm pool included."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def processes_carrying(tag: str) -> list[int]:
    """Processes whose environment holds DDP_GRADE_TEST_TAG=tag (every descendant of the command inherits it)."""
    found = []
    needle = f"DDP_GRADE_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.parametrize("path, code", [
    (ROOT / "solutions" / "01_setup.py", 0),
    (ROOT / "tests" / "hostile" / "01_daemon.py", None),
], ids=["correct", "hostile-daemon"])
def test_no_process_started_by_a_grading_outlives_it(tmp_path, path, code):
    tag = uuid.uuid4().hex
    env = {**os.environ, "DDP_GRADE_TEST_TAG": tag, "DDP_GRADE_STATE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "grader", str(path), "-q", "--timeout", "20", "--no-server"], env=env,
                          capture_output=True, text=True, timeout=120)
    left = processes_carrying(tag)  # looked at the moment the command has exited
    assert left == [], f"still alive after exit {done.returncode}: {left}"
    if code is not None:
        assert done.returncode == code, done.stdout[-2000:]
