"""Exercise 17's reference and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from grader import catalog
from grader.rank.drivers import ex17_expert_parallel as rank_side
from grader.checks.ex17_expert_parallel import reference as expected_side
from grader.checks.ex17_expert_parallel import verdicts as v
from grading_helpers import grading_for, verdicts
from grader.rank.harness import RankOutcome, WorldOutcome

ROW = rank_side.D * 8  # bytes of one token's row, float64


grading = grading_for("17")


@functools.cache
def expected(world_size: int) -> dict:
    return {scenario: expected_side.expected_run(scenario, world_size) for scenario in rank_side.SCENARIOS}


def a2a(rows_off: int, dtype: str = "float64", op: str = "alltoall_base_") -> dict:
    return {"op": op, "dtype": dtype, "bytes": rows_off * ROW, "off_rank": rows_off * ROW, "rows": None, "peer": None}


def counts(world_size: int) -> dict:
    return {"op": "alltoall_base_", "dtype": "int64", "bytes": 8 * rank_side.EXPERTS,
            "off_rank": 8 * rank_side.EXPERTS // world_size * (world_size - 1), "rows": None, "peer": None}


def right_run(want: dict, rank: int, world_size: int) -> dict:
    mine, rows = want["ranks"][rank], want["rows"][rank]
    per_rank = rank_side.EXPERTS // world_size
    owned = list(range(rank * per_rank, (rank + 1) * per_rank))
    held = {"bytes": expected_side.router_bytes() + per_rank * expected_side.expert_bytes(), "experts": owned}
    return {
        "output": mine["output"].clone(), "aux": mine["aux"].clone(), "returned": "pair", "backward_ran": True,
        "grads": {"x": mine["x"].clone(), "router": [t.clone() for t in mine["router"]],
                  "experts": {e: [t.clone() for t in want["experts"][e]] for e in owned}},
        "forward_events": [counts(world_size), a2a(rows["out"]), a2a(rows["in"])],
        "backward_events": [a2a(rows["out"]), a2a(rows["in"])],
        "held": held, "held_after": {"bytes": 2 * held["bytes"], "experts": owned},
    }


def right_observations(world_size: int) -> list[dict]:
    want = expected(world_size)
    return [{scenario: right_run(want[scenario], rank, world_size) for scenario in rank_side.SCENARIOS}
            for rank in range(world_size)]


def grade_all(observations: list[dict], world_size: int, bad: WorldOutcome | None = None) -> dict:
    g = grading(world_size)
    want = expected(world_size)
    v.check_output(g, observations, want["plain"], world_size)
    v.check_aux(g, observations, want, world_size)
    v.check_grads(g, observations, want["plain"], world_size)
    v.check_capacity(g, observations, want["tight"], world_size, "tight", "capacity-order")
    v.check_capacity(g, observations, want["skewed"], world_size, "skewed", "skewed-router")
    v.check_sharded(g, observations, world_size)
    v.check_all_to_all_count(g, observations, world_size)
    v.check_routed_bytes(g, observations, want, world_size)
    v.check_bad_input(g, bad if bad is not None else refusals(world_size), world_size)
    return verdicts(g)


def outcome(world_size: int, results: list, statuses: dict | None = None) -> WorldOutcome:
    ranks = [RankOutcome(rank, (statuses or {}).get(rank, "ok"), result=results[rank],
                         exitcode=-6 if (statuses or {}).get(rank) == "exited" else 0)
             for rank in range(world_size)]
    return WorldOutcome(world_size, ranks)


def refusals(world_size: int, **changes) -> WorldOutcome:
    refusal = {"raised": "ValueError", "message": "bad input", "where": "17_expert_parallel.py"}
    result = {"experts": dict(refusal), "columns": dict(refusal), "three_d": dict(refusal)}
    result.update(changes)
    return outcome(world_size, [copy.deepcopy(result) for _ in range(world_size)])


def failed(found: dict) -> dict:
    return {check_id: message for check_id, (status, message) in found.items() if status == "fail"}


# --- the reference ------------------------------------------------------------------------------


def test_the_capacity_queue_takes_every_first_choice_before_any_second_one():
    """Four tokens, two experts, top 2, capacity ceil(0.5 * 4 * 2 / 2) = 2: expert 0 is the first choice of
    tokens 2 and 3 and the second choice of tokens 0 and 1, which lose their places to them (and expert 1
    the other way round). Token by token, tokens 0 and 1 would fill both experts."""
    router = nn.Linear(1, 2, bias=False).double()
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0], [-1.0]], dtype=torch.float64))
    x = torch.tensor([[-1.0], [-2.0], [1.0], [2.0]], dtype=torch.float64)
    routing = expected_side.route(router, x, 2, 0.5)
    assert routing["capacity"] == 2
    assert routing["experts"][:, 0].tolist() == [1, 1, 0, 0]
    assert routing["keep"].tolist() == [[True, False]] * 4
    token_order = expected_side.route(router, x, 2, 0.5, order="token")
    assert token_order["keep"].tolist() == [[True, True], [True, True], [False, False], [False, False]]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_scenarios_tell_the_wrong_capacity_rules_apart(world_size):
    """Each wrong rule gives another output on some rank of the scenario that grades it: otherwise the
    check could not fail it. Tight: no renormalising, no capacity, token order, a global capacity; skewed:
    all but token order (nearly every first choice is the same expert)."""
    for scenario, wrong in (("tight", (0, 1, 2, 3)), ("skewed", (0, 1, 3))):
        want = expected(world_size)[scenario]["ranks"]
        per_rank = [expected_side.alternatives(scenario, world_size, rank) for rank in range(world_size)]
        for index in wrong:
            assert any(not torch.allclose(per_rank[rank][index][1], want[rank]["output"])
                       for rank in range(world_size)), (scenario, per_rank[0][index][0])


def test_the_skewed_router_overflows_one_expert_and_the_plain_one_drops_nothing():
    for world_size in (2, 3, 4):
        want = expected(world_size)
        for r in want["plain"]["ranks"]:
            assert bool(r["routing"]["keep"].all())
        for r in want["skewed"]["ranks"]:
            firsts = r["routing"]["experts"][:, 0]
            assert int((firsts == rank_side.SKEWED_EXPERT).sum()) >= rank_side.TOKENS - 2
            kept = r["routing"]["keep"] & (r["routing"]["experts"] == rank_side.SKEWED_EXPERT)
            assert int(kept.sum()) == r["routing"]["capacity"]
        assert any(not bool(r["routing"]["keep"].all()) for r in want["tight"]["ranks"])


# --- verdicts on right records -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_right_records_pass_every_check(world_size):
    found = grade_all(right_observations(world_size), world_size)
    assert failed(found) == {}
    assert {status for status, _ in found.values()} == {"pass"}


def test_rows_sent_once_per_token_and_rank_also_pass():
    world_size = 4
    observations = right_observations(world_size)
    rows = expected(world_size)["plain"]["rows"]
    assert any(r["out_pairs"] != r["out"] for r in rows)
    for rank, obs in enumerate(observations):
        obs["plain"]["forward_events"][1] = a2a(rows[rank]["out_pairs"])
        obs["plain"]["forward_events"][2] = a2a(rows[rank]["in_pairs"])
    assert "routed-bytes" not in failed(grade_all(observations, world_size))


def test_the_functional_and_list_all_to_alls_count_too():
    observations = right_observations(2)
    for obs in observations:
        events = obs["plain"]["backward_events"]
        events[0]["op"], events[1]["op"] = "all_to_all_single", "alltoall_"
    assert failed(grade_all(observations, 2)) == {}


# --- verdicts on wrong records -------------------------------------------------------------------


def test_gates_not_renormalised_are_named():
    observations = right_observations(2)
    words, value = expected_side.alternatives("plain", 2, 1)[0]
    observations[1]["plain"]["output"] = value
    found = failed(grade_all(observations, 2))
    assert "output-matches" in found and "not renormalised" in found["output-matches"]
    assert "rank 1" in found["output-matches"]


def test_a_forward_that_returns_y_alone_fails_with_words():
    observations = right_observations(2)
    observations[0]["plain"]["returned"] = "Tensor"
    found = failed(grade_all(observations, 2))
    assert "not the pair (y, aux_loss)" in found["output-matches"]


def test_aux_over_every_ranks_counts_is_named():
    world_size = 3
    observations = right_observations(world_size)
    data = rank_side.build("plain", world_size)
    routings = [expected_side.route(data["router"], x, rank_side.TOP_K, 6.0) for x in data["x"]]
    every = sum(torch.bincount(r["experts"].flatten(), minlength=rank_side.EXPERTS) for r in routings)
    observations[0]["plain"]["aux"] = expected_side.aux_loss(routings[0], every).detach()
    found = failed(grade_all(observations, world_size))
    assert "aux-loss-matches" in found and "all-reduced" in found["aux-loss-matches"]


def test_missing_gradients_fail():
    observations = right_observations(2)
    observations[1]["plain"]["grads"]["x"] = None
    assert "x.grad is None" in failed(grade_all(observations, 2))["grads-match"]
    observations = right_observations(2)
    owned = next(iter(observations[0]["plain"]["grads"]["experts"]))
    observations[0]["plain"]["grads"]["experts"][owned] = [None, None, None, None]
    assert "not copies" in failed(grade_all(observations, 2))["grads-match"]
    observations = right_observations(2)
    observations[0]["plain"]["grads"]["router"][0] = observations[0]["plain"]["grads"]["router"][0] * 2
    assert "router.weight.grad" in failed(grade_all(observations, 2))["grads-match"]


def test_token_order_and_global_capacity_fail_the_capacity_checks():
    world_size = 2
    observations = right_observations(world_size)
    for rank, obs in enumerate(observations):
        obs["tight"]["output"] = expected_side.alternatives("tight", world_size, rank)[2][1]
    found = failed(grade_all(observations, world_size))
    assert "capacity-order" in found and "output-matches" not in found
    observations = right_observations(world_size)
    for rank, obs in enumerate(observations):
        obs["skewed"]["output"] = expected_side.alternatives("skewed", world_size, rank)[3][1]
    found = failed(grade_all(observations, world_size))
    assert "skewed-router" in found and "all ranks together" in found["skewed-router"]


def test_a_scenario_that_raised_fails_its_check_and_the_next_is_not_checked():
    observations = right_observations(2)
    for obs in observations:
        obs["tight"] = {"error": "RuntimeError: split sizes"}
        del obs["skewed"]
    g = grading(2)
    want = expected(2)
    v.check_capacity(g, observations, want["tight"], 2, "tight", "capacity-order")
    v.check_capacity(g, observations, want["skewed"], 2, "skewed", "skewed-router")
    found = verdicts(g)
    assert found["capacity-order"][0] == "fail" and "split sizes" in found["capacity-order"][1]
    assert found["skewed-router"][0] == "not-checked"


def test_other_ranks_experts_held_fail():
    observations = right_observations(2)
    observations[0]["plain"]["held"]["experts"] = list(range(12))
    found = failed(grade_all(observations, 2))
    assert "experts-sharded" in found and "6, 7" in found["experts-sharded"]
    observations = right_observations(2)
    observations[1]["plain"]["held_after"]["bytes"] = 10 ** 6
    assert "experts-sharded" in failed(grade_all(observations, 2))
    observations = right_observations(2)
    observations[1]["plain"]["held"]["experts"] = []
    assert "does not hold" in failed(grade_all(observations, 2))["experts-sharded"]


def test_an_all_gather_of_the_batch_fails_count_and_bytes():
    observations = right_observations(2)
    gather = {"op": "_allgather_base_", "dtype": "float64", "bytes": 2 * 16 * ROW, "off_rank": None, "rows": None,
              "peer": None}
    observations[0]["plain"]["forward_events"] = [gather, counts(2)]
    found = failed(grade_all(observations, 2))
    assert "all_gather_into_tensor" in found["all-to-all-count"] and "routed-bytes" in found


def test_no_all_to_all_in_backward_fails_the_count():
    observations = right_observations(3)
    observations[2]["plain"]["backward_events"] = []
    found = failed(grade_all(observations, 3))
    assert "0 all-to-all" in found["all-to-all-count"] and "differentiable" in found["all-to-all-count"]


def test_a_third_float_all_to_all_fails_the_count():
    observations = right_observations(2)
    observations[0]["skewed"]["forward_events"].append(a2a(3))
    assert "3 all-to-all" in failed(grade_all(observations, 2))["all-to-all-count"]


def test_too_many_integers_fail_the_count():
    observations = right_observations(2)
    big = dict(counts(2), bytes=10 ** 5)
    observations[1]["plain"]["forward_events"][0] = big
    assert "integers" in failed(grade_all(observations, 2))["all-to-all-count"]


def test_padded_or_whole_batch_all_to_alls_fail_the_bytes():
    world_size = 2
    observations = right_observations(world_size)
    padded = rank_side.EXPERTS * 16 // world_size  # an [E, capacity] buffer's rows for the other rank
    observations[0]["plain"]["forward_events"][1] = a2a(padded)
    found = failed(grade_all(observations, world_size))
    assert "routed-bytes" in found and f"{padded} rows" in found["routed-bytes"]
    observations = right_observations(world_size)
    observations[1]["tight"]["backward_events"][1] = a2a(rank_side.TOKENS)
    assert "backward" in failed(grade_all(observations, world_size))["routed-bytes"]


def test_bad_input_verdicts():
    assert "bad-input-refused" not in failed(grade_all(right_observations(2), 2, refusals(2)))
    asserted = refusals(2, experts={"raised": "AssertionError", "message": "E % W", "where": "x.py"})
    assert "bad-input-refused" not in failed(grade_all(right_observations(2), 2, asserted))
    accident = refusals(2, columns={"raised": "RuntimeError", "message": "mat1 and mat2 shapes cannot be multiplied",
                                    "where": "linear.py"})
    found = failed(grade_all(right_observations(2), 2, accident))["bad-input-refused"]
    assert "mat1" in found and "accident" in found
    accepted = refusals(2, three_d={"raised": None, "shape": [2, 8, 8]})
    assert "accepted" in failed(grade_all(right_observations(2), 2, accepted))["bad-input-refused"]
    exited = refusals(2)
    exited.ranks[1] = RankOutcome(1, "exited", result=None, exitcode=-6)
    assert "exit code -6" in failed(grade_all(right_observations(2), 2, exited))["bad-input-refused"]


def test_every_catalog_check_is_decided_by_these_verdicts():
    ids = {c.id for c in catalog.by_id("17").checks}
    assert set(grade_all(right_observations(2), 2)) == ids
