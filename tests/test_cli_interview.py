"""`ddp-grade interview`, scripted through its input: grade on demand, a hint, finish, answer, summary."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from grader import catalog
from grader.cli import main
from grader.commands.interview import Interview, summary
from grader.progress import Progress
from grader.results import FAIL, PASS, CheckResult, Report
from grader.state import StateFile

ROOT = Path(__file__).resolve().parent.parent


def fake_report(passed: bool) -> Report:
    check = CheckResult("joins-group", "joins", PASS if passed else FAIL, "" if passed else "rank 1 did not join")
    return Report("01", "Join", "x.py", "passed" if passed else "failed", [check])


def test_clock_runs_out_then_final_grade_questions_and_summary(tmp_path):
    ex = catalog.by_id("01")
    now = [0.0]

    def read_line(prompt):  # the learner takes 90 s per command
        now[0] += 90
        return next(lines)

    lines = iter(["", "h", "", "this command comes after the deadline"])
    grades = iter([fake_report(False), fake_report(False), fake_report(True)])
    shown = []
    run = Interview(ex, "01_setup.py", 5, [], grade=lambda: next(grades), read_line=read_line,
                    echo=shown.append, render_report=lambda r: f"REPORT {r.status}",
                    progress=Progress(StateFile("p.json", tmp_path)), quiz_state=None, clock=lambda: now[0])
    out = run.run()
    assert out.over_time and out.gradings == 3 and out.hints == 1 and out.passed
    assert shown.count("REPORT failed") == 2 and shown[-1] == "REPORT passed"
    assert "Time is up: final grading." in shown
    text = summary(out)
    assert "of 5 min - over time" in text and "Passed, but over time" in text and "6:00" in text


@pytest.mark.slow
def test_a_five_minute_interview_scripted_through_stdin(tmp_path, monkeypatch):
    root = tmp_path / "kit"
    shutil.copytree(ROOT / "exercises", root / "exercises")
    shutil.copytree(ROOT / "solutions", root / "solutions")
    monkeypatch.setenv("DDP_GRADE_ROOT", str(root))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "solutions" / "01_setup.py", root / "exercises" / "01_setup.py")
    # Enter: grade now; h: a hint; q: finish (final grading); then two quiz answers.
    result = CliRunner().invoke(main, ["interview", "--exercise", "01", "--minutes", "5", "--questions", "2",
                                       "--seed", "7"], input="\nh\nq\na\nb\n", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "You have 5 minutes" in out and "hint 1/3" in out
    assert out.count("checks passed;") == 2  # graded on demand, then at the end
    assert "Question 1/2" in out and "Question 2/2" in out
    assert "Interview summary" in out and "of 5 min" in out and "verdict:     Passed." in out
    assert "quiz:        " in out
    assert Progress().passed("01")
    assert (tmp_path / "state" / "quiz.json").exists()  # answers count for `ddp-grade quiz --review`
