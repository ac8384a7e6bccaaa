"""ddp-grade batch: what counts as a submission, the table, the rows, the exit code."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from background import processes_with
from conftest import ROOT, ctrl_c_reaches_it
from grader import batch, batch_output
from grader.results import EXIT_CODES
from grader.cli import main

SOLUTIONS = ROOT / "solutions"
HOSTILE = ROOT / "tests" / "hostile"


def _report(status, checks=(), problem=None):
    return {"exercise": "01", "status": status, "problem": problem, "seconds": 1.0,
            "counts": {"pass": sum(1 for c in checks if c[1] == "pass"), "fail": sum(1 for c in checks if c[1] == "fail"),
                       "error": 0, "skip": 0},
            "checks": [{"id": i, "status": s, "message": m, "points": 1.0, "seconds": 0.5} for i, s, m in checks]}


def _outcome(name, status, checks=(), problem=None):
    return batch_output.Outcome(batch_output.Submission(name, name), _report(status, checks, problem))


def test_a_folder_of_files_gives_one_submission_per_exercise_file(tmp_path):
    for name in ("01_setup.py", "02_shard.py", "notes.txt", "helper.py"):
        (tmp_path / name).write_text("")
    names = [s.name for s in batch.collect([str(tmp_path)])]
    assert names == [str(tmp_path / "01_setup.py"), str(tmp_path / "02_shard.py")]


def test_a_folder_of_folders_gives_one_submission_per_learner_and_names_empty_ones(tmp_path):
    for learner in ("alice", "bob"):
        (tmp_path / learner).mkdir()
        (tmp_path / learner / "01_setup.py").write_text("")
    (tmp_path / "bob" / "02_shard.py").write_text("")
    (tmp_path / "carol").mkdir()
    subs = batch.collect([str(tmp_path)], exercise="01")
    assert [s.name for s in subs] == ["alice/01_setup.py", "bob/01_setup.py", str(tmp_path / "carol")]
    assert subs[2].problem and "no 01_*.py file" in subs[2].problem
    assert all(s.exercise == "01" for s in subs)


def test_a_missing_path_is_a_submission_that_cannot_be_graded_not_the_end_of_the_batch(tmp_path):
    subs = batch.collect([str(tmp_path / "missing.py"), str(tmp_path)])
    assert subs[0].path.endswith("missing.py") and subs[0].problem is None  # grading says "no such file"
    assert subs[1].problem and "no exercise files" in subs[1].problem


def test_the_exit_code_is_the_worst_result():
    passed, failed = _outcome("a", "passed"), _outcome("b", "failed")
    timeout, unusable = _outcome("c", "timeout"), _outcome("d", "unusable")
    assert batch_output.worst_status([passed]) == "passed"
    assert batch_output.worst_status([passed, failed]) == "failed"
    assert batch_output.worst_status([failed, timeout, passed]) == "timeout"
    assert batch_output.worst_status([timeout, unusable, failed]) == "unusable"
    assert EXIT_CODES[batch_output.worst_status([passed, failed, timeout])] == 3


def test_rows_have_one_line_per_submission_and_check():
    outcomes = [_outcome("alice", "failed", [("joins-group", "pass", ""), ("timeout-set", "fail", "no timeout")]),
                _outcome("bob", "unusable", problem="no such file: bob.py")]
    rows = batch_output.rows(outcomes)
    assert [(r["submission"], r["check"], r["check_status"]) for r in rows] == [
        ("alice", "joins-group", "pass"), ("alice", "timeout-set", "fail"), ("bob", "", "")]
    assert rows[2]["message"] == "no such file: bob.py" and rows[2]["exit_code"] == 2
    parsed = list(csv.DictReader(io.StringIO(batch_output.render_csv(outcomes))))
    assert [r["check"] for r in parsed] == ["joins-group", "timeout-set", ""]
    assert list(parsed[0]) == batch_output.ROW_FIELDS
    data = json.loads(batch_output.render_json(outcomes))
    assert data["exit_code"] == 2 and len(data["rows"]) == 3 and len(data["reports"]) == 2


def test_the_table_names_each_submission_its_status_and_the_failed_checks():
    table = batch_output.render_table([_outcome("alice", "failed", [("timeout-set", "fail", "no timeout")]),
                                _outcome("bob", "passed", [("joins-group", "pass", "")])])
    lines = table.splitlines()
    assert lines[0].split() == ["submission", "ex", "status", "checks", "seconds", "problem"]
    assert "alice" in lines[2] and "failed" in lines[2] and "timeout-set" in lines[2]
    assert "bob" in lines[3] and "passed" in lines[3] and "1/1" in lines[3]
    assert lines[-1] == "2 submissions: 1 passed, 1 failed, 0 timed out, 0 could not be graded (exit 1)."


def test_an_unknown_exercise_is_refused_before_anything_starts(tmp_path):
    result = CliRunner().invoke(main, ["batch", str(tmp_path), "--exercise", "77"])
    assert result.exit_code == 2 and "unknown exercise '77'" in result.output


@pytest.mark.slow
def test_a_batch_of_solutions_and_hostile_files_gets_the_right_table(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    scratch = Path(tempfile.mkdtemp(prefix="bt-"))  # short: the workers' pools keep a socket in it
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the workers' folders go
    learners = tmp_path / "class"
    for name, source in [("alice", SOLUTIONS / "01_setup.py"), ("bob", HOSTILE / "01_segfault.py"),
                         ("carol", HOSTILE / "01_endless_loop.py"), ("dave", HOSTILE / "01_not_utf8.py")]:
        (learners / name).mkdir(parents=True)
        shutil.copy(source, learners / name / "01_setup.py")
    shutil.copy(SOLUTIONS / "02_shard.py", learners / "alice" / "02_shard.py")
    result = CliRunner().invoke(main, ["batch", str(learners), "--jobs", "2", "--timeout", "20", "--format", "json",
                                       "-q"])
    data = json.loads(result.output)
    status = {r["submission"]: r["status"] for r in data["reports"]}
    assert status == {"alice/01_setup.py": "passed", "alice/02_shard.py": "passed", "bob/01_setup.py": "failed",
                      "carol/01_setup.py": "timeout", "dave/01_setup.py": "unusable"}
    assert result.exit_code == data["exit_code"] == 2
    evidence = {r["submission"]: r["evidence"] for r in data["reports"] if r["status"] == "passed"}
    assert evidence == {"alice/01_setup.py": {"claims_count": False, "decided": 1, "claimed": 7},  # a claim counts
                        "alice/02_shard.py": {"claims_count": False, "decided": 11, "claimed": 0}}  # for nothing
    bob = [r for r in data["rows"] if r["submission"] == "bob/01_setup.py"]
    assert bob and all(r["check_status"] != "pass" for r in bob)
    assert "SIGSEGV" in next(r["problem"] for r in data["reports"] if r["submission"] == "bob/01_setup.py")
    carol = next(r for r in data["reports"] if r["submission"] == "carol/01_setup.py")
    assert "rank 1" in carol["problem"]
    left = list(scratch.iterdir())
    shutil.rmtree(scratch, ignore_errors=True)
    assert left == [], "a worker's temporary folder was left behind"
    if os.path.isdir("/proc"):
        assert processes_with(f"TMPDIR={scratch}") == [], "a worker or one of its ranks is still alive"


@pytest.mark.slow
def test_ctrl_c_stops_a_batch_with_exit_130_and_leaves_nothing_running(tmp_path):
    tag = uuid.uuid4().hex  # every process the batch starts inherits it
    # The tag is handed into the sandbox on purpose: without it the worker and its ranks, sandboxed by
    # default, carry no tag, this test waits its whole minute for them, and cannot see them left behind.
    env = {**os.environ, "DDP_GRADE_STATE_DIR": str(tmp_path / "state"), "BATCH_TEST_TAG": tag,
           "DDP_GRADE_SANDBOX_PASS": "BATCH_TEST_TAG"}
    proc = subprocess.Popen([sys.executable, "-c", "from grader.cli import main; main()", "batch",
                             str(HOSTILE / "01_endless_loop.py"), "--timeout", "60", "-q"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_reaches_it)
    deadline = time.monotonic() + 60
    while len(processes_with(f"BATCH_TEST_TAG={tag}")) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # the batch, a worker and its pool at least
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in err
    time.sleep(0.5)
    assert processes_with(f"BATCH_TEST_TAG={tag}") == []


def test_folders_give_only_files_named_for_an_exercise_of_the_catalog(tmp_path):
    for name in ("01_setup.py", "01_mine.py", "99_future.py", "01_notes.txt", "1_setup.py"):
        (tmp_path / name).write_text("")
    names = [Path(s.name).name for s in batch.collect([str(tmp_path)])]
    assert names == ["01_mine.py", "01_setup.py"]


def test_a_fifo_or_a_device_is_refused_on_its_row_without_being_opened(tmp_path):
    """Named directly or found in a learner's folder, a FIFO gets its row (unusable), never a read that waits
    for a writer; the other rows are graded."""
    os.mkfifo(tmp_path / "01_setup.py")
    (tmp_path / "class" / "alice").mkdir(parents=True)
    os.mkfifo(tmp_path / "class" / "alice" / "01_setup.py")
    (tmp_path / "class" / "bob").mkdir()
    shutil.copy(SOLUTIONS / "01_setup.py", tmp_path / "class" / "bob" / "01_setup.py")
    subs = batch.collect([str(tmp_path / "01_setup.py"), os.devnull, str(tmp_path / "class")], exercise="01")
    problems = {s.name: s.problem for s in subs}
    assert "is not a regular file (a FIFO)" in problems[str(tmp_path / "01_setup.py")]
    assert "is not a regular file (a character device)" in problems[os.devnull]
    assert "is not a regular file (a FIFO)" in problems["alice/01_setup.py"]
    assert problems["bob/01_setup.py"] is None


def test_a_file_hard_linked_into_another_learners_folder_is_refused_on_both_rows(tmp_path):
    for learner in ("alice", "bob", "carol"):
        (tmp_path / learner).mkdir()
    shutil.copy(SOLUTIONS / "01_setup.py", tmp_path / "bob" / "01_setup.py")
    os.link(tmp_path / "bob" / "01_setup.py", tmp_path / "alice" / "01_setup.py")
    shutil.copy(SOLUTIONS / "01_setup.py", tmp_path / "carol" / "01_setup.py")  # the same bytes, a file of its own
    subs = batch.collect([str(tmp_path)])
    problems = {s.name: s.problem for s in subs}
    assert "the same file as bob/01_setup.py (a hard link)" in problems["alice/01_setup.py"]
    assert "the same file as alice/01_setup.py (a hard link)" in problems["bob/01_setup.py"]
    assert problems["carol/01_setup.py"] is None
    outcomes = batch.run_batch([s for s in subs if s.problem], 1, {"timeout_s": 10})  # no worker needed
    assert [o.status for o in outcomes] == ["unusable", "unusable"]
    again = batch.collect([str(tmp_path / "carol" / "01_setup.py")] * 2)  # one file named twice is not a link
    assert [s.problem for s in again] == [None, None]


def test_a_learner_folder_with_nothing_to_grade_is_a_row_that_says_so(tmp_path):
    (tmp_path / "alice").mkdir()
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "01_setup.py").write_text("")
    subs = [s for s in batch.collect([str(tmp_path)]) if s.problem]
    outcomes = batch.run_batch(subs, 1, {"timeout_s": 10})  # nothing to grade: no worker is started
    assert outcomes[0].status == "unusable" and "no NN_*.py exercise file" in outcomes[0].report["problem"]
    assert "could not be graded" in batch_output.render_table(outcomes)


def test_the_sandbox_is_used_by_default_refused_when_asked_for_and_missing_and_off_on_request(tmp_path, monkeypatch):
    from grader import sandbox

    monkeypatch.setattr(sandbox, "tool", lambda: None)
    (tmp_path / "alice").mkdir()  # one learner who handed in nothing: nothing is started
    asked = CliRunner().invoke(main, ["batch", str(tmp_path), "--sandbox"])
    assert asked.exit_code == 2 and "--sandbox needs bwrap" in asked.output
    default = CliRunner().invoke(main, ["batch", str(tmp_path)])
    assert default.exit_code == 2 and "no sandbox here" in default.output and "alice" in default.output
    off = CliRunner().invoke(main, ["batch", str(tmp_path), "--no-sandbox"])
    assert off.exit_code == 2 and "no sandbox here" not in off.output
    used = []
    monkeypatch.setattr(sandbox, "tool", lambda: "bwrap")
    monkeypatch.setattr(batch, "run_batch", lambda subs, jobs, settings, **kw: used.append(kw["sandbox"]) or [])
    for args, expected in ([[], "bwrap"], [["--no-sandbox"], None], [["--sandbox"], "bwrap"]):
        CliRunner().invoke(main, ["batch", str(tmp_path), *args])
        assert used.pop() == expected


def test_the_live_line_counts_what_is_done_and_estimates_what_is_left():
    from grader import live

    now = [100.0]
    stream = io.StringIO()
    line = live.BatchLine(4, live.TTY, stream, clock=lambda: now[0], width=200)
    line.begin("alice/01_setup.py")
    line.begin("bob/01_setup.py")
    now[0] += 20
    line.finish("alice/01_setup.py", "passed")
    assert line.text() == ("batch 1/4 done (1 passed, 0 failed), 20 s, about 1 min 00 s left; "
                           "grading bob/01_setup.py")
    now[0] += 20
    line.finish("bob/01_setup.py", "timeout")
    assert line.text() == "batch 2/4 done (1 passed, 0 failed, 1 timed out), 40 s, about 40 s left"
    line.done()
    assert stream.getvalue().endswith("\r\x1b[K") and "\n" not in stream.getvalue()
    plain = io.StringIO()
    piped = live.BatchLine(2, live.PLAIN, plain)
    piped.begin("alice/01_setup.py")
    piped.finish("alice/01_setup.py", "failed")
    piped.done()
    assert plain.getvalue() == "[1/2] failed   alice/01_setup.py\n"


def test_the_live_line_fits_the_terminal():
    from grader import live

    line = live.BatchLine(3, live.TTY, io.StringIO(), width=40)
    line.begin("a-very-long-learner-name/03_train.py")
    drawn = line.stream.getvalue().split("\r\x1b[K")[-1]
    line.done()
    assert len(drawn) <= 39 and drawn.endswith("...")
