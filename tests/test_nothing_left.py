"""`ddp-grade` returns only after every process it started has exited, its warm pool included."""

from __future__ import annotations

from pathlib import Path

import pytest

import background
from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.parametrize("path, code", [
    (ROOT / "solutions" / "01_setup.py", 0),
    (ROOT / "tests" / "hostile" / "01_daemon.py", None),
], ids=["correct", "hostile-daemon"])
def test_no_process_started_by_a_grading_outlives_it(tmp_path, path, code):
    done = background.cli_grading(path, ["-q", "--timeout", "20", "--no-server"], tmp_path, timeout_s=120)
    assert done["left"] == [], f"still alive after exit {done['returncode']}: {done['left']}"
    if code is not None:
        assert done["returncode"] == code, done["stdout"][-2000:]
