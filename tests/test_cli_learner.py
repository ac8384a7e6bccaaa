"""The learner's day through the CLI: list, hint, reset/restore, solution, grade with no argument.

Every test works on a temporary copy of the kit (DDP_GRADE_ROOT) and a temporary state folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from grader import catalog, kit
from grader.cli import main
from grader.progress import Progress

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def kit_copy(tmp_path, monkeypatch):
    """A fresh checkout-like folder: exercises/ as shipped (the packaged stubs) and solutions/."""
    root = tmp_path / "kit"
    (root / "exercises").mkdir(parents=True)
    for ex in catalog.exercises():
        stub = kit.stub_text(ex)
        if stub is not None:
            (root / "exercises" / ex.filename).parent.mkdir(exist_ok=True)
            (root / "exercises" / ex.filename).write_text(stub, encoding="utf-8")
    shutil.copytree(ROOT / "solutions", root / "solutions")
    monkeypatch.setenv("DDP_GRADE_ROOT", str(root))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)  # outside any kit: DDP_GRADE_ROOT decides
    return root


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def _row(output: str, exercise_id: str) -> str:
    """The line of ``list``'s output for one exercise."""
    return next(ln for ln in output.splitlines() if ln[3:].startswith(f"{exercise_id}  "))


def test_list_shows_every_exercise_not_started_and_marks_the_first(kit_copy):
    result = invoke("list")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert _row(result.output, "01").startswith("-> 01") and _row(result.output, "01").endswith("not started")
    shipped = [ex for ex in catalog.exercises() if (kit_copy / "exercises" / ex.filename).exists()]
    assert sum("not started" in ln for ln in lines) == len(shipped)
    assert "Next: 01" in result.output


def test_list_fits_80_columns_with_the_tracks_their_progress_and_each_exercise_s_minutes(kit_copy, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    Progress().record_grading("02", "passed")
    Progress().record_grading("22", "passed")
    output = invoke("list").output
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= 80
    headings = [ln for ln in lines if ln and not ln.startswith(" ") and "passed" in ln and "(" in ln]
    assert headings[:5] == ["Data parallel (01-10): 1/10 passed", "Beyond data parallel (11-20): 0/10 passed",
                            "Debugging (21-29): 1/9 passed", "Production APIs (31-37): 0/7 passed",
                            "Capacity planning (41-44): 0/4 passed"]
    assert [h.split(" (")[0] for h in headings[5:]] == ["Hiding communication"]  # its exercises land one by one
    for heading, first, last in zip(headings, ("01", "11", "21", "31", "41"), ("10", "20", "29", "37", "44")):
        below = lines[lines.index(heading):]
        assert [ln[3:5] for ln in below if ln[3:5].isdigit()][:1] == [first]
        assert _row(output, last) in below
    for ex in catalog.exercises():
        assert f"  {ex.minutes:>2} min  " in _row(output, ex.id)
    monkeypatch.setenv("COLUMNS", "200")
    assert max(len(line) for line in invoke("list").output.splitlines()) <= 100


def test_list_shows_an_edited_file_in_progress_and_a_passed_one_passed(kit_copy):
    path = kit_copy / "exercises" / "01_setup.py"
    path.write_text(path.read_text() + "\n# only a comment\n")
    assert "not started" in _row(invoke("list").output, "01")  # comments do not count
    path.write_text(path.read_text() + "\nX = 1\n")
    assert _row(invoke("list").output, "01").endswith("in progress")
    Progress().record_grading("01", "passed")
    output = invoke("list").output
    assert _row(output, "01").startswith("   01") and _row(output, "01").endswith("passed")
    assert _row(output, "02").startswith("-> 02")


def test_hint_shows_the_next_level_each_time_and_remembers(kit_copy):
    ex = catalog.by_id("01")
    first = invoke("hint", "01")
    assert first.exit_code == 0 and "hint 1/3" in first.output and ex.hints[0].split()[0] in first.output
    assert "hint 2/3" in invoke("hint", "1").output
    assert "hint 2/3" in invoke("hint", "01", "--again").output
    last = invoke("hint", "01")
    assert "hint 3/3" in last.output and "ddp-grade solution 01" in last.output
    assert "hint 3/3" in invoke("hint", "01").output  # stays at the last level
    assert "hints 3/3" in invoke("list").output


def test_hint_for_one_check_and_unknown_names(kit_copy):
    result = invoke("hint", "01", "--check", "timeout-set")
    assert result.exit_code == 0 and "timedelta" in result.output
    bad = invoke("hint", "01", "--check", "nope")
    assert bad.exit_code == 2 and "no check 'nope'" in bad.output and "Traceback" not in bad.output
    unknown = invoke("hint", "99")
    assert unknown.exit_code == 2 and "unknown exercise '99'" in unknown.output


def test_reset_saves_the_learners_file_then_restore_puts_it_back(kit_copy, tmp_path):
    path = kit_copy / "exercises" / "01_setup.py"
    stub = path.read_text()
    work = stub.replace("raise NotImplementedError", "return None  # my attempt", 1)
    path.write_text(work)
    Progress().record_grading("01", "passed")

    result = invoke("reset", "01")
    assert result.exit_code == 0
    assert path.read_text() == stub
    saved = [p for p in (tmp_path / "state" / "backups").iterdir()]
    assert len(saved) == 1 and saved[0].read_text() == work
    assert str(saved[0]) in result.output
    assert not Progress().passed("01")  # starts over ...
    assert Progress().entry("01")["passed_before"]  # ... without forgetting it passed once

    back = invoke("restore", "01")
    assert back.exit_code == 0 and path.read_text() == work
    assert len(list((tmp_path / "state" / "backups").iterdir())) == 2  # the stub was kept too


def test_restore_after_reset_brings_back_the_pass_of_the_file_that_passed_and_only_of_it(kit_copy, tmp_path):
    from grader import flow
    from grader.results import Report

    path = kit_copy / "exercises" / "01_setup.py"
    work = path.read_text().replace("raise NotImplementedError", "return None  # my attempt", 1)
    path.write_text(work)
    passed = Report("01", "Join and leave a process group", str(path), "passed")
    flow.grade_and_record(str(path), None, Progress(), lambda on_event: passed, quiet=True)
    assert Progress().passed("01")

    assert invoke("reset", "01").exit_code == 0 and not Progress().passed("01")
    assert "in progress" not in _row(invoke("list").output, "01")
    back = invoke("restore", "01")
    assert back.exit_code == 0 and path.read_text() == work
    assert "Exercise 01 is passed again" in back.output
    assert Progress().passed("01") and _row(invoke("list").output, "01").endswith("passed")

    # A file that differs from the one that passed gets no pass back: it was never graded.
    path.write_text(work + "\nX = 1\n")
    assert invoke("reset", "01").exit_code == 0 and not Progress().passed("01")
    assert invoke("restore", "01").exit_code == 0 and path.read_text() == work + "\nX = 1\n"
    assert not Progress().passed("01") and _row(invoke("list").output, "01").endswith("in progress")
    # ... and the copy that passed, restored by name, brings it back.
    first = kit.backups_of(catalog.by_id("01"))[0]
    assert first.read_text() == work
    assert "passed again" in invoke("restore", "01", "--from", str(first)).output and Progress().passed("01")


def test_list_titles_tell_every_exercise_apart_at_80_columns(kit_copy, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    output = invoke("list").output
    shown = {ex.id: _row(output, ex.id)[7:].split("  ")[0] for ex in catalog.exercises()}

    def whole_words(title: str) -> set:
        words = title.removesuffix("...").split()
        words = words[:-1] if title.endswith("...") else words  # the word the cut went through says nothing
        return {w.strip(",.:;()\"'").lower() for w in words}

    alike = [(a, b) for a in shown for b in shown if a < b and
             (whole_words(shown[a]) <= whole_words(shown[b]) or whole_words(shown[b]) <= whole_words(shown[a]))]
    assert alike == []  # each title shows a word the other lacks
    assert shown["16"].startswith("Ring attention") and shown["20"].startswith("Ulysses attention")


def test_reset_of_an_untouched_file_makes_no_copy_and_restore_without_copies_says_so(kit_copy, tmp_path):
    assert invoke("reset", "02").exit_code == 0
    assert not (tmp_path / "state" / "backups").exists()
    result = invoke("restore", "02")
    assert result.exit_code == 2 and "no saved copy of exercise 02" in result.output


def test_reset_brings_back_a_deleted_file(kit_copy):
    path = kit_copy / "exercises" / "03_train.py"
    path.unlink()
    assert "missing" in invoke("list").output
    assert invoke("reset", "03").exit_code == 0 and path.exists()


def test_solution_asks_first_when_not_passed(kit_copy):
    declined = invoke("solution", "01", input="n\n")
    assert declined.exit_code == 0 and "Not shown" in declined.output and "def setup_ddp" not in declined.output
    no_input = invoke("solution", "01", input="")
    assert no_input.exit_code == 0 and "def setup_ddp" not in no_input.output
    shown = invoke("solution", "01", input="y\n")
    assert shown.exit_code == 0 and (kit_copy / "solutions" / "01_setup.py").read_text() in shown.output


def test_solution_diff_without_asking_once_passed(kit_copy):
    Progress().record_grading("01", "passed")
    result = invoke("solution", "01", "--diff")
    assert result.exit_code == 0
    assert "+++ reference: solutions/01_setup.py" in result.output and "-    raise NotImplementedError" in result.output


def test_a_solution_seen_before_the_pass_is_shown_beside_it_and_one_seen_after_is_not(kit_copy, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert invoke("solution", "01", input="n\n").exit_code == 0  # declined: nothing seen
    assert invoke("solution", "03", "--diff", "-y").exit_code == 0  # a diff shows the reference too
    Progress().record_grading("02", "passed")
    assert invoke("solution", "02").exit_code == 0  # after the pass: no mark
    for ex in ("01", "03"):
        Progress().record_grading(ex, "passed")
    assert invoke("reset", "03").exit_code == 0
    Progress().record_grading("03", "passed")  # a pass after a reset still follows the viewing
    listed = invoke("list").output
    assert _row(listed, "01").split()[-1] == "passed" and _row(listed, "02").split()[-1] == "passed"
    assert _row(listed, "03").endswith("passed       solution seen")
    assert all(len(line) <= 80 for line in listed.splitlines()) and "3/10 passed" in listed
    Progress().state.update(lambda data: {**data, "exercises": {"03": {"passed": "x", "solution_seen": 1}}})
    assert "solution seen" not in invoke("list").output  # a hand-edited mark of the wrong type is dropped


def test_a_corrupt_progress_file_is_kept_aside_with_a_message(kit_copy, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "progress.json").write_text("{ half a file")
    result = invoke("list")
    assert result.exit_code == 0
    assert "could not be read" in result.output
    kept = list(state.glob("progress.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text() == "{ half a file"


def test_a_missing_kit_root_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDP_GRADE_ROOT", str(tmp_path / "nowhere"))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    result = invoke("list")
    assert result.exit_code == 2
    assert "has no exercises/ folder" in result.output and "Traceback" not in result.output


def test_grade_with_no_argument_when_everything_passed(kit_copy):
    p = Progress()
    for ex in catalog.exercises():
        p.record_grading(ex.id, "passed")
    result = invoke()
    assert result.exit_code == 0 and "Every exercise has passed" in result.output


@pytest.mark.slow
def test_grade_with_no_argument_grades_the_next_exercise_and_records_the_pass(kit_copy, tmp_path):
    stub_report = invoke("--format", "json", "--quiet")
    assert stub_report.exit_code == 1
    assert json.loads(stub_report.stdout)["exercise"] == "01"
    shutil.copy(kit_copy / "solutions" / "01_setup.py", kit_copy / "exercises" / "01_setup.py")
    junit = tmp_path / "report.xml"
    result = invoke("01", "--junit", str(junit))
    assert result.exit_code == 0, result.output
    assert "grading exercise 01: run 1" in result.stderr  # the live line, plain: not a terminal
    assert "\x1b" not in result.stderr and "\r" not in result.stderr
    assert Progress().passed("01")
    assert "-> 02" in invoke("list").output
    assert 'failures="0"' in junit.read_text()


def test_commands_act_on_the_kit_in_the_current_folder(kit_copy, tmp_path, monkeypatch):
    """A second copy of the kit: `reset` run inside it resets its file, not the DDP_GRADE_ROOT one."""
    second = tmp_path / "second"
    shutil.copytree(kit_copy, second)
    (second / "exercises" / "01_setup.py").write_text(SOLUTION_01 := (ROOT / "solutions" / "01_setup.py").read_text())
    (kit_copy / "exercises" / "01_setup.py").write_text(SOLUTION_01)
    monkeypatch.chdir(second / "solutions")  # a subfolder of the kit counts too
    result = invoke("reset", "01")
    assert result.exit_code == 0, result.output
    assert str(second) in result.output  # it says which kit it used
    assert (second / "exercises" / "01_setup.py").read_text() == kit.stub_text(catalog.by_id("01"))
    assert (kit_copy / "exercises" / "01_setup.py").read_text() == SOLUTION_01  # the other kit is untouched


@pytest.mark.slow
def test_a_passing_grading_of_a_file_outside_the_kit_says_it_is_not_recorded(kit_copy):
    result = invoke("grade", str(kit_copy / "solutions" / "01_setup.py"), "--world-size", "2")
    assert result.exit_code == 0, result.output
    assert "Not recorded as progress" in result.output and "exercises/01_setup.py" in result.output
    note = next(ln for ln in result.output.splitlines() if ln.startswith("Not recorded as progress"))
    assert note.endswith("is not the kit's own file (kit/exercises/01_setup.py).")  # from where the learner is
    assert not Progress().passed("01")
