"""The JSON report (schema: results.SCHEMA) is what docs/results-schema.md says, and what every page that names
its version says; JUnit XML parses and counts right."""

from __future__ import annotations

import json
import re
from pathlib import Path
from xml.etree import ElementTree as ET

from grader import diagnose, results
from grader.rank.harness import RankOutcome, WorldOutcome
from grader.report import render_json, render_junit, render_text
from grader.results import ERROR, FAIL, PASS, SKIP, UNUSABLE_FILE, CheckResult, Report, RunProblem

DOC = Path(__file__).resolve().parent.parent / "docs" / "results-schema.md"
TYPES = {"int": int, "string": str, "number": (int, float), "object": dict, "null": type(None), "list": list,
         "bool": bool}


def documented_fields(heading: str) -> dict[str, str]:
    """{field: type text} from the table under ``heading`` in the schema document."""
    text = DOC.read_text(encoding="utf-8").split(heading, 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M)}


def sample() -> Report:
    return Report("03", "Train", "exercises/03_train.py", "failed", [
        CheckResult("a", "first", PASS, seconds=0.5, points=2, evidence="value"),
        CheckResult("b", "second", FAIL, "rank 1 differs by 0.3 <&>", rank=1, world_size=3, hint="look",
                    evidence="kernel"),
        CheckResult("c", "third", ERROR, "not run"),
        CheckResult("d", "fourth", SKIP, "nccl only"),
        CheckResult("e", "fifth", results.NOT_CHECKED, "not checked: b failed", likely_cause="b"),
    ], backend="gloo", world_sizes=[2, 3], seconds=4.2)


def conforms(value, type_text: str) -> bool:
    kinds = [k.strip().split()[0] for k in type_text.split(" or ")]
    return any(isinstance(value, TYPES[k]) and not (k in ("int", "number") and isinstance(value, bool)) for k in kinds)


def test_every_field_of_the_report_and_of_a_check_is_documented_with_its_type():
    data = json.loads(render_json(sample()))
    report_fields, check_fields = documented_fields("## The report object"), documented_fields("## A check object")
    assert set(data) == set(report_fields)
    for name, type_text in report_fields.items():
        assert conforms(data[name], type_text), name
    for check in data["checks"]:
        assert set(check) == set(check_fields)
        for name, type_text in check_fields.items():
            assert conforms(check[name], type_text), (check["id"], name)


def timed_out() -> Report:
    """A report whose run timed out: rank 1 stuck in the learner's file, rank 0 finished."""
    stuck = RankOutcome(1, "killed", stack='Current thread 0x1 (most recent call first):\n'
                        '  File "/x/torch/distributed/c10d.py", line 9 in all_reduce\n'
                        '  File "/work/03_train.py", line 14 in train_ddp\n', output="epoch 0\n")
    outcome = WorldOutcome(2, [RankOutcome(0, "ok"), stuck], timed_out=True)
    problem = diagnose.timeout_problem(outcome, 60.0, "/work/03_train.py")
    return Report("03", "Train", "/work/03_train.py", "timeout", run_problem=problem)


def test_a_run_problem_is_carried_as_documented_fields():
    data = json.loads(render_json(timed_out()))
    problem_fields, rank_fields = documented_fields("## A run problem object"), documented_fields("## A rank object")
    problem = data["run_problem"]
    assert set(problem) == set(problem_fields)
    for name, type_text in problem_fields.items():
        assert conforms(problem[name], type_text), name
    for rank in problem["ranks"]:
        assert set(rank) == set(rank_fields)
        for name, type_text in rank_fields.items():
            assert conforms(rank[name], type_text), (rank["rank"], name)
    assert (problem["kind"], problem["status"], problem["rank"], problem["timeout_s"]) == ("stuck-in-collective", "timeout", 1, 60.0)
    assert problem["where"] == {"file": "03_train.py", "line": 14, "function": "train_ddp", "code": ""}
    assert problem["ranks"][1]["inside"].startswith("all_reduce")
    assert data["problem"].startswith("timed out after 60 s: rank 1 was still running")
    assert "03_train.py line 14 in train_ddp" in data["problem"] and "epoch 0" in data["details"]


def test_every_kind_of_run_problem_is_documented():
    text = DOC.read_text(encoding="utf-8").split("## A run problem object", 1)[1]
    kinds = {value for name, value in vars(results).items() if name.isupper() and isinstance(value, str)
             and name not in ("PASS", "FAIL", "ERROR", "SKIP", "NOT_CHECKED", "CLAIMED", "PASSED", "FAILED",
                              "UNUSABLE", "TIMEOUT", "CLAIM", "VALUE", "KERNEL")}
    assert kinds and all(f"`{kind}`" in text for kind in kinds)


def test_schema_4_values():
    data = json.loads(render_json(sample()))
    assert data["schema"] == 4 and data["exit_code"] == 1 and data["run_problem"] is None
    assert data["score"] == {"points": 2.0, "max_points": 5.0}  # the skipped check does not count
    assert data["counts"] == {"pass": 1, "fail": 1, "error": 1, "skip": 1, "not-checked": 1, "claimed": 0}
    assert [c["status"] for c in data["checks"]] == ["pass", "fail", "error", "skip", "not-checked"]
    assert [c["evidence"] for c in data["checks"]] == ["value", "kernel", "claim", "claim", "claim"]
    assert data["evidence"] == {"claims_count": True, "decided": 2, "claimed": 0}  # a, passed, and b, failed


def claims_and_evidence() -> Report:
    """Every check passed: one on a value, one on what the kernel saw, two on claims, one skipped."""
    return Report("07", "Ring", "07_ring.py", "passed", [
        CheckResult("sum", "the sum", PASS, points=2, evidence="value"),
        CheckResult("bytes", "the bytes", PASS, points=3, evidence="kernel"),
        CheckResult("calls", "the calls", PASS, points=5),
        CheckResult("events", "the events", PASS),
        CheckResult("gpu", "nccl only", SKIP, "nccl only"),
    ], backend="gloo", world_sizes=[2])


def test_where_claims_count_for_nothing_a_claim_that_passed_is_claimed_and_weighs_nothing():
    report = results.count_evidence_only(claims_and_evidence())
    assert [c.status for c in report.checks] == [PASS, PASS, results.CLAIMED, results.CLAIMED, SKIP]
    assert report.status == "passed" and report.points == 5 and report.max_points == 5
    data = json.loads(render_json(report))
    assert data["evidence"] == {"claims_count": False, "decided": 2, "claimed": 2}
    assert data["counts"]["claimed"] == 2 and data["score"] == {"points": 5.0, "max_points": 5.0}
    text = render_text(report)
    assert "  CLAIM  calls" in text and "  PASS   sum" in text and "CLAIM: recorded by the submission's own" in text
    assert "All 4 checks passed; 2 decided on evidence, 2 claimed (not counted)." in text
    suite = ET.fromstring(render_junit(report))
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["calls"].find("skipped").get("message").startswith("claimed:") and cases["sum"].find("skipped") is None
    assert suite.get("skipped") == "3"
    properties = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert properties["decided_on_evidence"] == "2" and properties["claims_count"] == "false"
    from grader.results import report_from_dict

    again = report_from_dict(report.to_dict())
    assert [c.status for c in again.checks] == [c.status for c in report.checks] and not again.claims_count


def test_plain_gradings_count_claims_and_say_how_many_checks_stood_on_evidence():
    report = claims_and_evidence()
    assert report.points == 11 and report.max_points == 11 and report.claims_count
    assert "All 4 checks passed; 2 decided on evidence." in render_text(report)
    assert "CLAIM" not in render_text(report)


def test_a_grading_that_passed_on_claims_alone_does_not_pass_where_claims_count_for_nothing():
    report = claims_and_evidence()
    for check in report.checks[:2]:  # the value and the kernel check skipped: only claims passed
        check.status = SKIP
    results.count_evidence_only(report)
    assert report.status == "failed" and report.exit_code == 1 and report.points == 0
    assert "none was decided on evidence" in render_text(report)


def test_a_claim_that_failed_stays_a_failure_and_costs_its_points_where_claims_count_for_nothing():
    """A submission's records can make a check pass, never fail: a failed claim is believed. It weighs nothing in
    the maximum (the same scale for every submission) and costs its points, never below 0; passing on evidence
    alone with a failed claim is no full mark."""
    report = claims_and_evidence()
    report.checks[3].status, report.status = FAIL, "failed"  # 'events', 1 point
    results.count_evidence_only(report)
    assert report.checks[3].status == FAIL and report.status == "failed"
    assert report.points == 4 and report.max_points == 5
    assert "3/4 checks passed; 2 decided on evidence, 1 claimed (not counted) (exit 1)." in render_text(report)
    report.checks[2].status = FAIL  # 'calls', 5 points more: 5 earned, 6 lost
    assert report.points == 0 and report.max_points == 5
    plain = claims_and_evidence()
    plain.checks[3].status = FAIL
    assert plain.points == 10 and plain.max_points == 11  # where claims count, a failure just earns nothing


def test_junit_xml_has_one_case_per_check_and_the_right_counts():
    suite = ET.fromstring(render_junit(sample()))
    assert suite.tag == "testsuite" and suite.get("name") == "ddp-grade.exercise-03"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("5", "1", "1", "2")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert list(cases) == ["a", "b", "c", "d", "e"]
    assert cases["e"].find("skipped").get("message") == "not checked: b failed"
    failure = cases["b"].find("failure")
    assert failure.get("message") == "rank 1 differs by 0.3 <&>" and "hint: look" in failure.text
    assert "rank 1" in failure.text and "world size 3" in failure.text


def test_junit_for_a_file_that_could_not_be_graded():
    report = Report("", "", "x.py", "unusable", run_problem=RunProblem(UNUSABLE_FILE, "unusable", message="syntax error in x.py line 3\x00"))
    suite = ET.fromstring(render_junit(report))
    case = suite.find("testcase")
    assert case.get("name") == "grading" and case.find("error").get("type") == "unusable"


def test_the_text_report_points_at_the_hint_command_for_a_failing_check():
    text = render_text(sample())
    assert "Stuck on b? `ddp-grade hint 03`" in text
    passed = Report("03", "Train", "p.py", "passed", [CheckResult("a", "first", PASS)])
    assert "ddp-grade hint" not in render_text(passed)


def test_sections_are_documented_shown_under_the_checks_and_survive_the_round_trip():
    from grader.results import report_from_dict

    report = sample()
    report.sections = [{"title": "what ran", "text": "rank 0  F0 B0\nrank 1  .  F0 B0", "data": {"order": [["F0"]]}}]
    data = json.loads(render_json(report))
    section_fields = documented_fields("## A section object")
    assert data["sections"] and all(set(s) == set(section_fields) for s in data["sections"])
    for name, type_text in section_fields.items():
        assert conforms(data["sections"][0][name], type_text), name
    text = render_text(report)
    assert "what ran:\n  rank 0  F0 B0\n  rank 1  .  F0 B0" in text
    assert text.index("what ran:") > text.index("second")
    assert report_from_dict(data).sections == report.sections
    assert json.loads(render_json(sample()))["sections"] == []


def test_every_page_that_names_the_report_schema_names_the_codes_version():
    """README, the learner's page and the schema document say the version the code writes."""
    root = DOC.parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    named = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"(?:JSON|JSON object) \(schema (\d+)", text):
            named.append((page.name, int(m.group(1))))
    named += [(DOC.name, int(m.group(1))) for m in re.finditer(r"`schema` \| int \| always `(\d+)` for this shape \|\n"
                                                              r"\| `exercise`", DOC.read_text(encoding="utf-8"))]
    assert len({name for name, _ in named}) >= 3, named  # README, learner.md, results-schema.md
    assert all(version == results.SCHEMA for _, version in named), named


def test_a_not_checked_check_is_neither_passed_nor_failed_in_the_summary():
    text = render_text(sample())
    assert "1/3 checks passed; 1 not checked until b passes; 2 decided on evidence (exit 1)." in text
    data = json.loads(render_json(sample()))
    assert data["counts"]["not-checked"] == 1 and data["score"]["max_points"] == 5
