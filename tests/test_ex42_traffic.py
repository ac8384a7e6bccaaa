"""Exercise 42's verdicts from hand-made records and answers (no processes started)."""

from __future__ import annotations

import math

from capacity_records import RECORDS, answer, model_answers
from grader import capacity
from grader import capacity_plans
from grader.checks import ex42_traffic as ex42
from grader.checks.shared import capacity_cases as cases
from grading_helpers import grading_for, verdicts

grading = grading_for("42")


def test_traffic_equal_to_the_collectives_passes_and_a_missing_factor_two_fails():
    g = grading()
    ex42.check_traffic(g, model_answers(capacity.communication), RECORDS)
    assert verdicts(g)["traffic-measured"][0] == "pass"
    answers = model_answers(capacity.communication)
    for a in answers.values():
        if "all-reduce" in a["value"]["dp"]:
            a["value"]["dp"]["all-reduce"] /= 2
    g = grading()
    ex42.check_traffic(g, answers, RECORDS)
    status, message = verdicts(g)["traffic-measured"]
    assert status == "fail" and "dp all-reduce" in message and "dp2 zero0 fp32" in message


def test_a_collective_the_learner_left_out_fails():
    answers = model_answers(capacity.communication)
    answers["pp2 1f1b"]["value"]["pp"] = {}
    g = grading()
    ex42.check_traffic(g, answers, RECORDS)
    status, message = verdicts(g)["traffic-measured"]
    assert status == "fail" and "pp send: 0 bytes estimated" in message


def test_measured_traffic_applies_the_ring_factor_of_each_group():
    plan = capacity.Plan(dp=4, tp=2, zero=1)
    record = {"collectives": [["dp", "reduce-scatter", 800], ["dp", "all-gather", 800], ["tp", "all-reduce", 64],
                              ["tp", "all-reduce", 64], ["other", "barrier", 4]]}
    assert ex42.measured_traffic(record, plan) == {("dp", "reduce-scatter"): 600.0, ("dp", "all-gather"): 600.0,
                                                   ("tp", "all-reduce"): 128.0}


def test_flops_must_equal_the_counted_flops():
    g = grading()
    cluster = lambda p: capacity_plans.on(capacity_plans.H100, p.world_size)  # noqa: E731
    right = {n: answer(capacity.step_time(cases.SMALL, p, cluster(p))) for n, p in cases.CONFIGS.items()}
    ex42.check_flops(g, right, RECORDS)
    assert verdicts(g)["flops-measured"][0] == "pass"
    right["tp2 full fp32"]["value"]["flops"] *= 0.75
    g = grading()
    ex42.check_flops(g, right, RECORDS)
    status, message = verdicts(g)["flops-measured"]
    assert status == "fail" and "tp2 full fp32" in message and "FlopCounterMode" in message


def test_the_bubble_is_gpipes_fraction_and_swapping_p_and_m_fails():
    plans = [capacity.Plan(pp=p, micro_batches=m) for p, m in ex42.BUBBLES]
    times = [answer(capacity.step_time(ex42.BIG, p, capacity_plans.on(capacity_plans.H100, p.world_size))) for p in plans]
    for plan, t in zip(plans, times):
        share = t["value"]["bubble_s"] / t["value"]["total_s"]
        assert math.isclose(share, (plan.pp - 1) / (plan.micro_batches + plan.pp - 1))
    g = grading()
    ex42.check_bubble(g, list(zip(plans, times)))
    assert verdicts(g)["bubble"][0] == "pass"
    for plan, t in zip(plans, times):
        busy = t["value"]["compute_s"] + t["value"]["tp_s"] + t["value"]["pp_s"]
        t["value"]["bubble_s"] = busy * (plan.micro_batches - 1) / plan.pp
        t["value"]["total_s"] = busy + t["value"]["bubble_s"]
    g = grading()
    ex42.check_bubble(g, list(zip(plans, times)))
    assert verdicts(g)["bubble"][0] == "fail"


def test_the_ring_shares_two_n_minus_one_over_n():
    plans = [capacity.Plan(dp=n) for n in ex42.RING_SIZES]
    right = [answer(capacity.communication(ex42.BIG, p)) for p in plans]
    g = grading()
    ex42.check_ring(g, list(zip(plans, right)))
    assert verdicts(g)["ring-factor"][0] == "pass"
    for a in right:
        a["value"]["dp"] = {"all-reduce": a["value"]["dp"]["all-reduce"] / 2}
    g = grading()
    ex42.check_ring(g, list(zip(plans, right)))
    status, message = verdicts(g)["ring-factor"]
    assert status == "fail" and "2(n-1)/n" in message


def test_every_step_time_case_reaches_each_link_and_term():
    scale = ex42.at_scale()
    inter = [capacity.link(c, p, "tp")[0] == c.inter_node_bandwidth for _, _, p, c in scale]
    assert any(inter) and not all(inter)
    times = [capacity.step_time(m, p, c) for _, m, p, c in scale]
    assert any(t.bubble_s for t in times) and any(t.dp_s for t in times) and any(t.pp_s for t in times)




def test_flops_measured_says_how_many_configurations_are_wrong_not_only_the_first():
    truths = {name: float(records[0]["flops"]) for name, records in RECORDS.items()}
    right = {name: {"value": {"flops": flops}} for name, flops in truths.items()}
    g = grading()
    ex42.check_flops(g, right, RECORDS)
    assert verdicts(g)["flops-measured"][0] == "pass"
    wrong = {name: {"value": {"flops": flops * (0.5 if i % 2 else 1.0)}} for i, (name, flops) in enumerate(truths.items())}
    off = sum(1 for i in range(len(truths)) if i % 2)
    g = grading()
    ex42.check_flops(g, wrong, RECORDS)
    status, message = verdicts(g)["flops-measured"]
    assert status == "fail" and f"(and {off - 1} more of the {len(truths)} configurations)" in message
