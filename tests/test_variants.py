"""Broken variants: realistic wrong answers, each of which must fail the right check.

Each file in tests/variants/ is named NN_what_is_wrong.py (NN: the exercise) and
says at its top what the grader must answer:

    # expect-fail: check-id [check-id ...]     these checks fail
    # expect-pass: check-id [check-id ...]     these checks are still decided, and pass
    # expect-not-checked: check-id [...]       these checks are not decided: a check they need failed
    # expect-cause: check-id cause-id          check-id fails, explained by cause-id: shown and hinted first
    # expect-status: timeout|unusable|failed   the overall status (default failed)
    # expect-problem: text                     the report's problem line contains this
    # grade-options: timeout_s=8 world_size=2  options for this variant
"""

from __future__ import annotations

import re

import pytest

from conftest import VARIANTS, statuses
from grader.report import details_of, problem_of

FILES = sorted(VARIANTS.glob("[0-9][0-9]_*.py"))


def expectations(path) -> dict:
    text = path.read_text()
    found = {"fail": [], "pass": [], "not-checked": [], "cause": [], "status": "failed", "problem": None,
             "options": {}}
    for key, value in re.findall(r"^# expect-(fail|pass|not-checked|cause|status|problem): *(.+)$", text, re.M):
        if key in ("fail", "pass", "not-checked"):
            found[key] += value.split()
        elif key == "cause":
            found[key].append(tuple(value.split()))
        else:
            found[key] = value.strip()
    for line in re.findall(r"^# grade-options: *(.+)$", text, re.M):
        for item in line.split():
            k, v = item.split("=")
            found["options"][k] = float(v) if k == "timeout_s" else (int(v) if v.isdigit() else v)
    return found


def test_every_variant_says_what_it_expects():
    assert FILES, "no broken variants found"
    for path in FILES:
        e = expectations(path)
        assert e["fail"] or e["problem"], f"{path.name} has no expect-fail or expect-problem line"


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_variant_fails_with_the_right_check(grade, path):
    e = expectations(path)
    report = grade(path, **e["options"])
    assert report.status == e["status"], (problem_of(report), details_of(report)[-2000:])
    got = statuses(report)
    for check_id in e["fail"]:
        assert got.get(check_id) == "fail", (check_id, got, problem_of(report))
        message = next(c.message for c in report.checks if c.id == check_id)
        assert message.strip(), f"{check_id} failed without saying what was observed"
    for check_id in e["pass"]:
        assert got.get(check_id) == "pass", (check_id, got, problem_of(report))
    for check_id in e["not-checked"]:
        assert got.get(check_id) == "not-checked", (check_id, got, problem_of(report))
        verdict = next(c for c in report.checks if c.id == check_id)
        assert verdict.likely_cause and got.get(verdict.likely_cause) == "fail", (check_id, verdict.likely_cause)
    for effect, cause in e["cause"]:
        verdict = next(c for c in report.checks if c.id == effect)
        assert verdict.likely_cause == cause and cause in verdict.hint, (effect, verdict.likely_cause, verdict.hint)
        order = [c.id for c in report.failures_by_cause()]
        assert order.index(cause) < order.index(effect), order
    if e["problem"]:
        assert problem_of(report) and e["problem"] in problem_of(report), problem_of(report)
