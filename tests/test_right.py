"""Right answers: correct submissions written the way real code is written, each of which must pass.

Each file in tests/right/ is named NN_style.py (NN: the exercise) and differs from the
reference solution in style: the PyTorch DDP tutorial's Trainer, nanoGPT's loop, ranks
from the environment, DataLoader workers, gradient clipping, progress bars, evaluation
passes, checkpoints saved every epoch or atomically, flat buffers, a UTF-8 byte-order
mark, Windows line endings. A check that fails one of them fails a right answer.
"""

from __future__ import annotations

import codecs

import pytest

import background
from conftest import ROOT
from grader import catalog, learner
from grader.report import problem_of

RIGHT = ROOT / "tests" / "right"
FILES = sorted(RIGHT.glob("[0-9][0-9]_*.py"))


def test_every_exercise_has_at_least_two_right_answers():
    per_exercise = {ex.id: [p.name for p in FILES if p.name.startswith(ex.id + "_")] for ex in catalog.exercises()}
    assert all(len(names) >= 2 for names in per_exercise.values()), per_exercise
    assert len(FILES) >= 25


def test_the_corpus_keeps_a_byte_order_mark_and_windows_line_endings():
    raw = {p.name: p.read_bytes() for p in FILES}
    assert any(data.startswith(codecs.BOM_UTF8) for data in raw.values())
    assert any(b"\r\n" in data and b"\n" not in data.replace(b"\r\n", b"") for data in raw.values())


def test_a_byte_order_mark_is_read_as_python_reads_it(tmp_path):
    path = tmp_path / "01_setup.py"
    path.write_bytes(codecs.BOM_UTF8 + b"def setup_ddp(rank, world_size, backend=None):\n    pass\n\n"
                     b"def cleanup_ddp():\n    pass\n")
    assert learner.read_source(path).startswith("def setup_ddp")
    assert learner.check_file(path).id == "01"


def test_windows_line_endings_and_a_coding_line_are_read_as_python_reads_them(tmp_path):
    path = tmp_path / "01_setup.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\r\nNAME = '\xe9'\r\ndef setup_ddp(rank, world_size, backend=None):\r\n"
                     b"    pass\r\ndef cleanup_ddp():\r\n    pass\r\n")
    assert "NAME = '\u00e9'" in learner.read_source(path)
    assert learner.check_file(path).id == "01"


def test_a_file_that_is_not_utf8_still_gets_one_clear_line(tmp_path):
    path = tmp_path / "01_setup.py"
    path.write_bytes(b"x = '\xff'\n")
    with pytest.raises(learner.Unusable, match="is not UTF-8 text"):
        learner.read_source(path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[background.grading(p)] if background.waits(p) else [])
                                  for p in FILES])
def test_right_answer_passes(grade, path):
    report = grade(path)
    failing = {c.id: c.message for c in report.checks if c.status not in ("pass", "skip")}
    assert report.status == "passed", (
        f"{path.name} is a right answer, but the grader said {report.status}"
        + (f": {problem_of(report)}" if problem_of(report) else "")
        + "".join(f"\n  {check_id}: {message}" for check_id, message in failing.items())
    )
