"""Exercise 43's verdicts from hand-made answers, under the kit's cost model (no processes started)."""

from __future__ import annotations

import itertools

from capacity_records import answer
from grader import capacity
from grader import capacity_plans as plans
from grader.checks import ex43_plan as ex43
from grading_helpers import grading_for, verdicts

grading = grading_for("43")


def test_a_plan_outside_the_rules_says_why():
    model, cluster, tokens = plans.SCENARIOS["8B on 64 GPUs"]
    best = plans.best_plan(model, cluster, tokens)
    g = grading()
    short = answer(capacity.Plan(**{**capacity.to_dict(best), "micro_batches": 1}))
    assert ex43.check_allowed(g, "8B", model, cluster, tokens, short) is None
    status, message = verdicts(g)["plan-allowed"]
    assert status == "fail" and "global batch" in message
    g = grading()
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
    g = grading()
    ex43.check_near(g, [("8B on 64 GPUs", model, cluster, tokens, slow)])
    status, message = verdicts(g)["plan-near-fastest"]
    assert status == "fail" and "x the fastest" in message and "limited by" in message


def fastest(model, cluster, tokens, keep=lambda plan: True, tps=plans.TENSOR_PARALLEL, node=True, heads=True):
    """The fastest plan under 43's rules as a search that bends some of them would find it."""
    sequences = tokens // model.seq_len
    found = []
    for tp, pp, b in itertools.product(tps, plans.divisors(model.layers), plans.MICRO_BATCHES):
        dp = cluster.gpus // (tp * pp)
        if (node and tp > cluster.gpus_per_node) or (heads and model.heads % tp) or cluster.gpus % (tp * pp) \
                or sequences % (dp * b):
            continue
        for zero, schedule, recompute in itertools.product(range(4), capacity.SCHEDULES, capacity.RECOMPUTES):
            plan = capacity.Plan(dp, tp, pp, zero, b, sequences // (dp * b), schedule, "bf16-mixed", recompute)
            if (zero >= 2 and pp > 1) or not keep(plan):
                continue
            if capacity.training_memory(model, plan).total <= cluster.memory_bytes:
                found.append((capacity.step_time(model, plan, cluster).total_s, plan))
    return min(found, key=lambda f: f[0]) if found else (None, None)


def lax_heads(monkeypatch):
    """The cost model without its refusal of a tp that does not divide the heads (a careless 41 and 42)."""
    from grader import capacity_layout
    strict = capacity_layout._require
    monkeypatch.setattr(capacity_layout, "_require",
                        lambda ok, message: None if "heads" in message and "divide" in message else strict(ok, message))


def test_a_search_without_pipeline_stages_is_too_slow_for_one_scenario_and_finds_nothing_for_two():
    model, cluster, tokens = plans.SCENARIOS["70B at 4K tokens on 64 GPUs"]
    best, flat = fastest(model, cluster, tokens), fastest(model, cluster, tokens, keep=lambda p: p.pp == 1)
    assert best[1] == plans.best_plan(model, cluster, tokens) and best[1].pp > 1
    assert flat[0] > ex43.NEAR * best[0]
    for name in ("70B on 1,024 GPUs of 4-GPU nodes", "33B on 1,024 GPUs"):
        assert plans.best_plan(*plans.SCENARIOS[name]).pp > 1
        assert fastest(*plans.SCENARIOS[name], keep=lambda p: p.pp == 1) == (None, None), name


def test_tensor_parallelism_across_two_nodes_is_the_fastest_plan_the_rules_forbid():
    model, cluster, tokens = plans.SCENARIOS["70B on 1,024 GPUs of 4-GPU nodes"]
    seconds, careless = fastest(model, cluster, tokens, tps=(1, 2, 4, 8, 16), node=False)
    assert careless.tp == 8 > cluster.gpus_per_node == 4
    assert seconds < capacity.step_time(model, plans.best_plan(model, cluster, tokens), cluster).total_s
    g = grading()
    assert ex43.check_allowed(g, "4-GPU nodes", model, cluster, tokens, answer(careless)) is None
    assert "tp 8 spans 2 nodes" in verdicts(g)["plan-allowed"][1]


def test_tp_8_is_the_fastest_for_52_heads_if_nobody_checks_that_it_divides_them(monkeypatch):
    model, cluster, tokens = plans.SCENARIOS["33B on 1,024 GPUs"]
    lax_heads(monkeypatch)
    careless = fastest(model, cluster, tokens, heads=False)[1]
    monkeypatch.undo()
    assert careless.tp == 8 and model.heads % 8
    g = grading()
    assert ex43.check_allowed(g, "52 heads", model, cluster, tokens, answer(careless)) is None
    assert "tensor-parallel size 8 does not divide 52 heads" in verdicts(g)["plan-allowed"][1]


def test_a_rounded_batch_fails_and_a_value_error_passes():
    g = grading()
    ex43.check_batch_refused(g, {"value": {"dp": 64.0}})
    status, message = verdicts(g)["uneven-batch-refused"]
    assert status == "fail" and "512.50 sequences" in message
    g = grading()
    ex43.check_batch_refused(g, {"error": "ValueError: not whole", "value_error": True})
    assert verdicts(g)["uneven-batch-refused"][0] == "pass"
