"""One protocol for grading out of process (grader.protocol): the worker, the server, the sandbox and batch
all send GradeOptions.to_dict() in and get Report.to_dict() out, and give the same report for one file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from grader import protocol, sandbox, server
from grader.options import GradeOptions
from grader.results import CheckResult, Report

WRONG = ROOT / "tests" / "variants" / "01_long_timeout.py"


def test_an_answer_is_events_then_the_report():
    report = Report("01", "Join", "x.py", "failed", [CheckResult("a", "first", "fail", "rank 1 differs")])
    lines = [protocol.encode({"type": "event", "kind": "run", "driver": "rank_main"}),
             protocol.encode({"type": "report", "report": report.to_dict()})]
    seen = []
    got = protocol.read_answer(lines, on_event=lambda kind, **info: seen.append((kind, info)))
    assert got.to_dict() == report.to_dict() and seen == [("run", {"driver": "rank_main"})]


@pytest.mark.parametrize("lines, why", [
    ([], "ended before the report"),
    ([b'{"type": "error", "why": "the grader failed"}\n'], "the grader failed"),
    ([b"not json\n"], "cannot be read"),
    ([b'{"type": "report"}\n'], "cannot be read"),
])
def test_an_answer_without_a_report_is_a_failure_that_says_why(lines, why):
    with pytest.raises(protocol.Failed, match=why):
        protocol.read_answer(lines)


@pytest.mark.parametrize("line, why", [
    (b"[" * 10**6 + b"]" * 10**6 + b"\n", "nested 1,000,000 deep"),  # the parser would recurse in C
    (b"[" + b"[]," * 2_000_000 + b"[]]\n", "values"),
    (b'{"type": "report", "id": "someone else"}\n', "answers no request"),
])
def test_a_line_no_worker_wrote_is_unreadable_before_it_is_parsed(line, why):
    """What an unsandboxed rank can write into its worker's output: the batch makes it that row's failure."""
    with pytest.raises(protocol.Unreadable, match=why):
        protocol.read_answer([line], request_id="mine")


def test_a_request_carries_the_options_whole_and_the_absolute_path():
    options = GradeOptions(world_size=3, timeout_s=12.0, limits={"memory_bytes": 5, "cpu_seconds": 6,
                                                                  "output_bytes": 7, "tmp_bytes": 8})
    req = protocol.request("solutions/01_setup.py", "01", options)
    assert req["path"] == str(ROOT / "solutions" / "01_setup.py") if Path.cwd() == ROOT else os.path.isabs(req["path"])
    assert GradeOptions.from_dict(json.loads(protocol.encode(req))["options"]) == options
    assert protocol.wait_s("x/01_setup.py", None, options) == 12.0 + protocol.START_MARGIN_S


def _essence(report: Report) -> dict:
    """What must not depend on the way a report travelled: everything but times and the path shown."""
    data = report.to_dict()
    data.pop("seconds")
    data.pop("path")
    for check in data["checks"]:
        check.pop("seconds")
    return data


@pytest.mark.slow
def test_the_same_file_gets_the_same_report_through_every_way_out_of_process(tmp_path, monkeypatch, grade):
    options = GradeOptions(world_size=2, timeout_s=60)
    here = grade(WRONG, world_size=2, timeout_s=60)
    assert here.status == "failed"
    reports = {}
    # The worker itself, as batch starts it.
    worker = subprocess.run([sys.executable, "-m", "grader.worker"], input=protocol.encode(protocol.request(
        str(WRONG), None, options)), capture_output=True, timeout=180)
    reports["worker"] = protocol.read_answer(worker.stdout.splitlines())
    # The grading server.
    state = Path("/tmp") / f"ddp-proto-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(state))
    monkeypatch.setenv("DDP_GRADE_SERVER", "1")
    process = subprocess.Popen([sys.executable, "-m", "grader.server"], start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not server.status()["running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        reports["server"] = server.grade_remote(str(WRONG), None, options)
    finally:
        server.stop()
        process.wait(timeout=30)
        subprocess.run(["rm", "-rf", str(state)], check=False)
    # A fresh sandbox, as --sandbox and batch's sandboxed workers grade.
    if sandbox.tool() is not None:
        reports["sandbox"] = protocol.grade_in_sandbox(str(WRONG), None, options)
    # A batch worker.
    from grader.batch import Submission, WorkerProcess
    from grader.results import report_from_dict

    batch_worker = WorkerProcess(options.to_dict())
    try:
        reports["batch"] = report_from_dict(batch_worker.grade(Submission("w", str(WRONG), None), 180))
    finally:
        batch_worker.stop()
    # A batch counts claims for nothing (count_evidence_only): its report is the plain one, so counted.
    import copy

    from grader.results import count_evidence_only

    counted = count_evidence_only(copy.deepcopy(here))
    assert not counted.claims_count and counted.points < here.points  # WRONG fails a claim: its point is lost
    assert _essence(reports.pop("batch")) == _essence(counted)
    for way, report in reports.items():
        assert _essence(report) == _essence(here), way


def test_a_worker_told_its_exercises_preloads_their_drivers_alone(monkeypatch):
    from grader import catalog, grading

    one, two = catalog.by_id("01"), catalog.by_id("41")
    assert protocol.exercise_env([one, two, one]) == {protocol.EXERCISES_ENV: "01 41"}
    assert protocol.exercise_env([one, None]) == {}  # a file whose exercise is unknown: every driver
    monkeypatch.setenv(protocol.EXERCISES_ENV, "41 01")
    assert grading.driver_modules(protocol.announced_exercises()) == [one.drivers, two.drivers]
    monkeypatch.setenv(protocol.EXERCISES_ENV, "01 77")  # an id the catalog lacks: every driver
    assert protocol.announced_exercises() is None
    assert grading.driver_modules(None) == grading.DRIVER_MODULES == ["grader.rank.drivers.preload"]
    monkeypatch.delenv(protocol.EXERCISES_ENV)
    assert protocol.announced_exercises() is None
