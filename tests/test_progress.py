"""Progress state, exercise status and the packaged stubs."""

from __future__ import annotations

from pathlib import Path

import pytest

from grader import catalog, kit
from grader.progress import NOT_STARTED, IN_PROGRESS, Progress, file_status, only_todos

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("ex", catalog.exercises(), ids=lambda e: e.id)
def test_the_packaged_stub_is_the_shipped_exercise_file(ex):
    """`reset` writes grader/stubs/NN_*.py, generated from exercises/ by `python -m grader.docs --write`."""
    shipped = ROOT / "exercises" / ex.filename
    if not shipped.exists():
        pytest.skip(f"no exercises/{ex.filename} in this checkout")
    assert kit.stub_text(ex) == shipped.read_text(encoding="utf-8"), \
        f"grader/stubs/{ex.filename} differs from exercises/{ex.filename}: run python -m grader.docs --write"


def test_the_packaged_stubs_are_only_the_catalogued_ones():
    folder = ROOT / "grader" / "stubs"
    stubs = {p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if p.name != "__init__.py"}
    assert stubs == {ex.filename for ex in catalog.exercises()}


@pytest.mark.parametrize("ex", [e for e in catalog.exercises() if kit.stub_text(e)], ids=lambda e: e.id)
def test_a_stub_is_not_started_and_its_solution_is_in_progress(ex, tmp_path):
    stub = tmp_path / ex.filename
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text(kit.stub_text(ex))
    assert file_status(ex, stub) == NOT_STARTED
    if not ex.is_debug:  # a broken script of the debugging track has code, not TODOs, from the start
        assert only_todos(kit.stub_text(ex), ex)  # the fallback rule agrees on every shipped stub
    solved = ROOT / "solutions" / ex.filename
    if solved.exists():
        stub.write_text(solved.read_text())
        assert file_status(ex, stub) == IN_PROGRESS
        assert not only_todos(solved.read_text(), ex)


def test_passing_is_recorded_once_and_survives_later_failures(tmp_path):
    from grader.state import StateFile

    state = StateFile("progress.json", tmp_path)
    p = Progress(state)
    p.record_grading("03", "failed")
    assert not p.passed("03")
    p.record_grading("03", "passed")
    first = Progress(state).entry("03")["passed"]
    p.record_grading("03", "failed")
    again = Progress(state)
    assert again.passed("03") and again.entry("03")["passed"] == first
    assert again.entry("03")["last_status"] == "failed"


def test_a_hand_edited_progress_file_of_the_wrong_shape_does_not_crash(tmp_path):
    from grader.state import StateFile

    state = StateFile("progress.json", tmp_path)
    state.save({"exercises": {"01": "yes", "02": {"hints_shown": "many"}, "03": {"passed": "2025-01-01"}}})
    p = Progress(state)
    assert not p.passed("01") and p.hints_shown("02") == 0 and p.passed("03")
    # The file itself is kept aside whole, never overwritten, and the user is told where.
    aside = list(tmp_path.glob("progress.json.corrupt-*"))
    assert len(aside) == 1 and '"many"' in aside[0].read_text()
    assert str(aside[0]) in p.warning()
    p.record_grading("04", "failed")
    assert Progress(StateFile("progress.json", tmp_path)).passed("03")  # what could be read is carried over
