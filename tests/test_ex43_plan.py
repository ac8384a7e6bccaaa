"""Exercise 43's verdicts from hand-made answers, under the kit's cost model (no processes started)."""

from __future__ import annotations

from capacity_records import answer, grading, verdicts
from grader import capacity
from grader import capacity_plans as plans
from grader.checks import ex43_plan as ex43


def test_a_plan_outside_the_rules_says_why():
    model, cluster, tokens = plans.SCENARIOS["8B on 64 GPUs"]
    best = plans.best_plan(model, cluster, tokens)
    g = grading("43")
    short = answer(capacity.Plan(**{**capacity.to_dict(best), "micro_batches": 1}))
    assert ex43.check_allowed(g, "8B", model, cluster, tokens, short) is None
    status, message = verdicts(g)["plan-allowed"]
    assert status == "fail" and "global batch" in message
    g = grading("43")
    assert ex43.check_allowed(g, "8B", model, cluster, tokens, answer(best)) == best


def test_the_scenarios_best_plans_fit_and_nothing_fits_the_small_cluster():
    for model, cluster, tokens in plans.SCENARIOS.values():
        best = plans.best_plan(model, cluster, tokens)
        assert best is not None and plans.fits(model, best, cluster)
    _, model, cluster, tokens = ex43.NOTHING_FITS
    assert plans.best_plan(model, cluster, tokens) is None


def test_a_slow_plan_is_named_with_what_limits_it():
    model, cluster, tokens = plans.SCENARIOS["8B on 64 GPUs"]
    slow = capacity.Plan(dp=8, tp=8, zero=3, micro_batches=64)
    g = grading("43")
    ex43.check_near(g, [("8B on 64 GPUs", model, cluster, tokens, slow)])
    status, message = verdicts(g)["plan-near-fastest"]
    assert status == "fail" and "x the fastest" in message and "limited by" in message
