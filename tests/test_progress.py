"""Progress state, exercise status and the packaged stubs."""

from __future__ import annotations

from pathlib import Path

import pytest

from grader import catalog, kit
from grader.progress import NOT_STARTED, IN_PROGRESS, Progress, file_status, only_todos

ROOT = Path(__file__).resolve().parent.parent


def _uncommitted(path: Path) -> bool:
    """True when git says ``path`` has changes not committed (False without git or outside a checkout)."""
    import subprocess

    try:
        found = subprocess.run(["git", "status", "--porcelain", "--", str(path)], cwd=ROOT, capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return found.returncode == 0 and bool(found.stdout.strip())


@pytest.mark.parametrize("ex", catalog.exercises(), ids=lambda e: e.id)
def test_the_packaged_stub_is_the_shipped_exercise_file(ex):
    """`reset` writes grader/stubs/NN_*.py, the file as shipped. A maintainer who changes exercises/NN ships it
    with `python -m grader.docs --write --stub NN`; a learner's work in exercises/ is not a changed stub."""
    from grader import docs

    shipped = ROOT / "exercises" / ex.filename
    if not shipped.exists():
        pytest.skip(f"no exercises/{ex.filename} in this checkout")
    text = shipped.read_text(encoding="utf-8")
    if kit.stub_text(ex) == text:
        return
    if docs.not_a_stub(ex, text) or (ex.is_debug and _uncommitted(shipped)):
        pytest.skip(f"exercises/{ex.filename} is being worked on; grader/stubs keeps the shipped file")
    raise AssertionError(
        f"grader/stubs/{ex.filename} differs from exercises/{ex.filename}. Working on the exercise? Nothing is "
        f"wrong, and `ddp-grade reset {ex.id}` puts the shipped file back. Changed it as a maintainer? Ship it with "
        f"`python -m grader.docs --write --stub {ex.id}`.")


def test_docs_write_keeps_the_packaged_stubs_of_solved_exercises_and_reset_restores_them(tmp_path, monkeypatch):
    """In a checkout where 01-05 are solved, `python -m grader.docs --write` (the old advice of the test above)
    writes no learner's solution into grader/stubs, even when told to with --stub; `reset` then puts the
    shipped stub back."""
    import shutil

    from click.testing import CliRunner

    from grader import docs
    from grader.cli import main

    root, stubs = tmp_path / "kit", tmp_path / "stubs"
    shutil.copytree(ROOT / "grader" / "stubs", stubs)
    (root / "exercises").mkdir(parents=True)
    solved = [ex for ex in catalog.exercises() if ex.id in ("01", "02", "03", "04", "05")]
    for ex in catalog.exercises():
        (root / "exercises" / ex.filename).parent.mkdir(exist_ok=True)
        source = ROOT / ("solutions" if ex in solved else "grader/stubs") / ex.filename
        (root / "exercises" / ex.filename).write_bytes(source.read_bytes())
    before = {p: p.read_bytes() for p in stubs.rglob("*.py")}
    written, kept = docs.write_stubs(root, stubs)
    assert written == [] and len(kept) == 5 and all("a learner's work" in line for line in kept)
    written, kept = docs.write_stubs(root, stubs, replace=("03",))
    assert written == [] and any("03_train.py has code" in line for line in kept)
    assert {p: p.read_bytes() for p in stubs.rglob("*.py")} == before
    # A changed stub of the writing track is shipped when named, and only then.
    changed = ROOT / "grader" / "stubs" / "06_grad_accum.py"
    (root / "exercises" / "06_grad_accum.py").write_text(changed.read_text() + "# a clearer statement\n")
    assert docs.write_stubs(root, stubs)[0] == []
    assert docs.write_stubs(root, stubs, replace=("06",))[0] == ["06_grad_accum.py"]
    # reset puts the stub as shipped back over the solved file.
    monkeypatch.setenv("DDP_GRADE_ROOT", str(root))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["reset", "05"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (root / "exercises" / "05_allreduce.py").read_text() == kit.stub_text(catalog.by_id("05"))
    assert (root / "exercises" / "05_allreduce.py").read_bytes() == (ROOT / "grader/stubs/05_allreduce.py").read_bytes()


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
