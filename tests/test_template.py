"""The template exercise is a working exercise: grader/checks/ex00_template/ with its catalog entry, stub and
answers in tests/template/. Its verdicts are shown on hand-made records, then real gradings of the stub, the
solution and a wrong answer."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from grader import catalog
from grader.checks import ex00_template as template
from grader.rank.drivers import ex00_template as rank_side
from grader.checks.ex00_template import verdicts as v
from grader.checks.ex00_template.reference import expected_sum
from grader.grading import Grading, Plan
from grader.results import NOT_IMPLEMENTED
from grading_helpers import verdicts

FOLDER = ROOT / "tests" / "template"
EXERCISE = catalog.read((FOLDER / "catalog.toml").read_text(encoding="utf-8"))[0]


def grading(session=None, name: str = "00_template_solution.py", world_sizes=(2,)) -> Grading:
    return Grading(EXERCISE, str(FOLDER / name), session, Plan("gloo", list(world_sizes)), timeout_s=60)


def right_records(world_size: int) -> list[dict]:
    return [{"returned": expected_sum(world_size), "input_after": rank_side.rank_tensor(rank)}
            for rank in range(world_size)]


def test_right_records_pass_every_check():
    g = grading()
    v.check_sum(g, right_records(3), expected_sum(3), 3)
    v.check_input_kept(g, right_records(3), 3)
    assert verdicts(g) == {"sum-everywhere": ("pass", ""), "input-kept": ("pass", "")}


def test_a_sum_into_the_callers_tensor_fails_input_kept_naming_the_rank():
    records = right_records(2)
    records[1]["input_after"] = expected_sum(2)
    g = grading()
    v.check_input_kept(g, records, 2)
    status, message = verdicts(g)["input-kept"]
    assert status == "fail" and message.startswith("'t' differs by up to 3 at [3]") and "t.clone()" in message


def test_a_rank_that_returned_its_own_tensor_fails_the_sum():
    records = right_records(2)
    records[0]["returned"] = rank_side.rank_tensor(0)
    records[1]["returned"] = "a NoneType"  # what plain_tensor records of a function that returned nothing
    g = grading()
    v.check_sum(g, records, expected_sum(2), 2)
    status, message = verdicts(g)["sum-everywhere"]
    assert status == "fail" and "'the returned tensor' differs by up to 13 at [3]" in message and "all 2 ranks" in message


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    ("00_template_solution.py", {"sum-everywhere": "pass", "input-kept": "pass"}),
    ("00_in_place.py", {"sum-everywhere": "pass", "input-kept": "fail"}),
])
def test_the_template_grades_its_answers(session, name, expected):
    g = grading(session, name, EXERCISE.world_sizes)
    template.grade(g)
    assert {c.id: c.status for c in g.results(None)} == expected
    assert g.sizes_run == list(EXERCISE.world_sizes)


@pytest.mark.slow
def test_the_stub_stops_the_grading_as_not_implemented(session):
    g = grading(session, "00_template.py")
    with pytest.raises(g.Stopped) as stopped:
        template.grade(g)
    assert stopped.value.problem.kind == NOT_IMPLEMENTED
    assert torch.equal(expected_sum(2), torch.tensor([10.0, 12.0, 14.0, 16.0], dtype=torch.float64))
