"""NCCL on real GPUs: the reference solutions pass there too. Skipped without CUDA.

NCCL needs one GPU per rank, so the world size is the number of GPUs (at most 2).
"""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from grader import catalog
from grader.report import details_of, problem_of

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(GPUS == 0 or not torch.distributed.is_nccl_available(), reason="needs CUDA GPUs and NCCL"),
]


# The debugging track's jobs are CPU scripts (gloo whatever the machine has): no NCCL run.
WRITING = [e for e in catalog.exercises() if not e.is_debug]


@pytest.mark.parametrize("exercise", WRITING, ids=[e.id for e in WRITING])
def test_solution_passes_on_nccl(grade, exercise):
    report = grade(ROOT / "solutions" / exercise.filename, backend="nccl", world_size=min(GPUS, 2))
    failing = {c.id: c.message for c in report.checks if c.status not in ("pass", "skip")}
    assert report.status == "passed", (problem_of(report), failing, details_of(report)[-3000:])
    assert report.backend == "nccl"


def test_setup_pins_each_rank_to_its_own_gpu(grade):
    report = grade(ROOT / "solutions" / "01_setup.py", backend="nccl", world_size=min(GPUS, 2))
    assert {c.id: c.status for c in report.checks}["nccl-device"] == "pass"


def test_nccl_with_more_ranks_than_gpus_is_refused(grade):
    report = grade(ROOT / "solutions" / "01_setup.py", backend="nccl", world_size=GPUS + 1)
    assert report.exit_code == 2 and "one GPU per rank" in problem_of(report)
