"""Broken variants: realistic wrong answers, each of which must fail the right check.

Each file in tests/variants/ is named NN_what_is_wrong.py (NN: the exercise) and
says at its top what the grader must answer:

    # expect-fail: check-id [check-id ...]     these checks fail
    # expect-pass: check-id [check-id ...]     these checks are still decided, and pass
    # expect-not-checked: check-id [...]       these checks are not decided: a check they need failed
    # expect-cause: check-id cause-id          check-id fails, explained by cause-id: shown and hinted first
    # expect-status: timeout|unusable|failed   the overall status (default failed)
    # expect-problem: text                     the report's problem line contains this
    # expect-message: check-id text            check-id's message contains this (one line per text): the
                                               failure names its cause, not another
    # grade-options: timeout_s=8 world_size=2  options for this variant
"""

from __future__ import annotations

import re

import pytest

import background
from conftest import VARIANTS, statuses
from grader.report import details_of, problem_of

FILES = sorted(VARIANTS.glob("[0-9][0-9]_*.py"))


def expectations(path) -> dict:
    text = path.read_text()
    found = {"fail": [], "pass": [], "not-checked": [], "cause": [], "status": "failed", "problem": None,
             "messages": [], "options": {}}
    for key, value in re.findall(r"^# expect-(fail|pass|not-checked|cause|status|problem): *(.+)$", text, re.M):
        if key in ("fail", "pass", "not-checked"):
            found[key] += value.split()
        elif key == "cause":
            found[key].append(tuple(value.split()))
        else:
            found[key] = value.strip()
    for check_id, words in re.findall(r"^# expect-message: *(\S+) +(.+)$", text, re.M):
        found["messages"].append((check_id, words.strip()))
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
        for check_id, _ in e["messages"]:
            assert check_id in e["fail"], f"{path.name}: expect-message names {check_id}, not expected to fail"


def _graded(path):
    """The variant as a parameter; one that waits more than it computes is graded in the background."""
    e = expectations(path)
    marks = [background.grading(path, e["options"])] if background.waits(path, e) else []
    return pytest.param(path, id=path.stem, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("path", [_graded(path) for path in FILES])
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
    for check_id, words in e["messages"]:
        message = next((c.message for c in report.checks if c.id == check_id), None)
        assert message is not None and words in message, (check_id, words, message)
    if e["problem"]:
        assert problem_of(report) and e["problem"] in problem_of(report), problem_of(report)


# Checks no variant here can fail, and why. Both are decided only with --backend nccl on GPUs (which GPU a rank
# computes on); the suite grades with gloo on the CPU, where the grader skips them. tests/test_gpu.py grades the
# solutions on NCCL where GPUs are present.
UNFAILABLE_HERE = {
    ("01", "nccl-device"): "NCCL only: whether each rank set its own GPU before the first collective",
    ("15", "device-local-rank"): "NCCL only: whether each torchrun worker computes on the GPU of its LOCAL_RANK",
}


def test_every_check_of_every_exercise_is_failed_by_a_variant():
    from grader import catalog

    failed = {(path.name[:2], check_id) for path in FILES for check_id in expectations(path)["fail"]}
    checks = {(ex.id, c.id) for ex in catalog.exercises() for c in ex.checks}
    missing = sorted(checks - failed - set(UNFAILABLE_HERE))
    assert not missing, f"checks no variant in tests/variants/ fails: {missing}"
    assert set(UNFAILABLE_HERE) <= checks, "an exemption names a check the catalog no longer has"
    assert not set(UNFAILABLE_HERE) & failed, "an exempted check has a variant now: drop the exemption"
    unknown = sorted(pair for pair in failed if pair not in checks)
    assert not unknown, f"variants expect checks the catalog does not have: {unknown}"
