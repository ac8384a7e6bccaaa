"""Several graders at once on one machine: no port or file collisions, every one passes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

RUNS = 8
SOLUTIONS = [ROOT / "solutions" / "01_setup.py", ROOT / "solutions" / "02_shard.py"]  # the quickest to grade


@pytest.mark.slow
def test_eight_graders_at_once_on_the_solutions_all_pass(tmp_path):
    env = {**os.environ, "DDP_GRADE_STATE_DIR": str(tmp_path / "state")}
    procs = []
    for i in range(RUNS):
        path = SOLUTIONS[i % len(SOLUTIONS)]
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from grader.cli import main; main()", "grade", str(path), "-q", "--format", "json", "--timeout", "240"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path))
    results = [(p, *p.communicate(timeout=290)) for p in procs]
    for p, out, err in results:
        assert p.returncode == 0, (out[-2000:], err[-2000:])
        assert '"status": "passed"' in out
