"""Exercise 19's verdicts, from hand-made records (no processes started).

Each verdict is shown passing on the records a right answer leaves and failing on a wrong one.
"""

from __future__ import annotations

import functools

import torch

from grader.rank.drivers import ex19_data_tensor_parallel as rank_side
from grader.checks.ex19_data_tensor_parallel import verdicts as v
from grader.checks.ex19_data_tensor_parallel.reference import local_block, reference_run
from grading_helpers import grading_for, verdicts

WORLD, TP = 4, 2
DP = WORLD // TP


grading = grading_for("19", WORLD)


@functools.cache
def reference(rows: int | None = None) -> dict:
    return reference_run(rows)


def shard_of(rank: int, world_size: int = WORLD, tp_size: int = TP) -> torch.Tensor:
    inputs = rank_side.make_data()[0]
    dp_size = world_size // tp_size
    size = inputs.shape[0] // dp_size
    dp_rank = rank // tp_size
    return inputs[dp_rank * size:(dp_rank + 1) * size]


def collective(op: str, group: list[int], nbytes: int, *, in_forward=False, after=1, updated=False) -> dict:
    return {"kind": "collective", "op": op, "via": "c10d", "group": group, "bytes": nbytes, "dtype": "float64",
            "in_forward": in_forward, "after_forwards": after, "updated": updated}


def right_obs(rank: int, world_size: int = WORLD, tp_size: int = TP, *, batch=None, grad_group=None,
              forward_group=None, state=None) -> dict:
    """What rank_main records of a right answer (``batch``, ``grad_group``, ``forward_group`` and ``state``
    replace the right ones)."""
    dp, tp = rank_side.groups_of(rank, world_size, tp_size)
    ref = reference()
    timeline = []
    x = shard_of(rank, world_size, tp_size) if batch is None else batch
    for step in range(rank_side.STEPS):
        params = {name: local_block(name, ref["before"][step], rank % tp_size, tp_size) for name in rank_side.PARAMETERS}
        timeline.append({"kind": "forward", "grad": True, "module": "TensorParallelMLP", "input": x.clone(),
                         "params": params})
        timeline.append(collective("all_reduce", forward_group or tp, 512, in_forward=True, after=step + 1))
        for name in rank_side.PARAMETERS:
            timeline.append(collective("all_reduce", grad_group or dp, params[name].numel() * 8, after=step + 1))
    for _ in range(3):
        timeline.append(collective("all_gather", tp, 512, after=rank_side.STEPS, updated=True))
    returned = {"kind": "dict", "tensors": dict(ref["final"] if state is None else state), "other": {}}
    return {"tp_size": tp_size, "groups": {"shape": None, "dp": dp, "tp": tp, "dp_type": "ProcessGroup",
                                           "tp_type": "ProcessGroup"},
            "groups_error": None, "train_error": None,
            "probe": {"dp": {"joined": dp, "counts": [1.0 if r in dp else 0.0 for r in range(world_size)]},
                      "tp": {"joined": tp, "counts": [1.0 if r in tp else 0.0 for r in range(world_size)]}},
            "new_groups": [{"ranks": [0, 1], "local": False}, {"ranks": [2, 3], "local": False},
                           {"ranks": [0, 2], "local": False}, {"ranks": [1, 3], "local": False}],
            "returned": returned, "sequence": timeline, "trained": True}


def right_world(world_size: int = WORLD, tp_size: int = TP) -> list[dict]:
    return [right_obs(r, world_size, tp_size) for r in range(world_size)]


def run_all(observations: list[dict], world_size: int = WORLD, tp_size: int = TP) -> dict:
    g = grading()
    assert v.check_group_calls(g, observations, world_size)
    if v.check_members(g, observations, world_size, tp_size):
        v.check_collective_groups(g, observations, world_size, tp_size)
        v.check_tp_grads(g, observations, world_size, tp_size)
        v.check_tp_batches(g, observations, world_size, tp_size)
        v.check_dp_shards(g, observations, world_size, tp_size)
        if v.check_training_error(g, observations, world_size):
            v.check_matches_single(g, observations, reference(), world_size, tp_size)
    return verdicts(g)


STEP_CHECKS = ("group-members", "collective-groups", "tp-grads-own", "tp-same-batch", "dp-shards", "matches-single")


def test_the_records_of_a_right_answer_pass_every_check():
    for world_size, tp_size in ((4, 2), (2, 1), (4, 4), (4, 1)):
        got = run_all(right_world(world_size, tp_size), world_size, tp_size)
        assert {c: got[c][0] for c in STEP_CHECKS} == {c: "pass" for c in STEP_CHECKS}, (world_size, tp_size, got)


def test_the_layout_is_consecutive_tensor_groups_and_strided_data_groups():
    assert rank_side.groups_of(0, 4, 2) == ([0, 2], [0, 1])
    assert rank_side.groups_of(3, 4, 2) == ([1, 3], [2, 3])
    assert rank_side.groups_of(5, 8, 4) == ([1, 5], [4, 5, 6, 7])
    assert rank_side.groups_of(1, 2, 1) == ([0, 1], [1])
    assert [rank_side.tp_size_for(w) for w in (1, 2, 3, 4, 6)] == [1, 1, 1, 2, 2]


def test_the_reference_is_single_process_sgd_on_the_whole_batch():
    import torch.nn.functional as F

    fc1, fc2 = rank_side.dense_layers()
    inputs, targets = rank_side.make_data()
    F.mse_loss(fc2(F.gelu(fc1(inputs))), targets).backward()
    first_step = reference()["before"][1]
    assert torch.allclose(first_step["fc1.weight"], fc1.weight.detach() - rank_side.LR * fc1.weight.grad)
    assert not torch.equal(reference()["final"]["fc2.bias"], reference()["before"][0]["fc2.bias"])
    # The blocks of one model copy put back together are the whole model.
    whole = reference()["final"]
    blocks = [local_block("fc2_weight", whole, t, 2) for t in range(2)]
    assert torch.equal(torch.cat(blocks, dim=1), whole["fc2.weight"])


def test_swapped_or_strided_groups_fail_group_members():
    observations = right_world()
    for obs in observations:
        obs["groups"]["dp"], obs["groups"]["tp"] = obs["groups"]["tp"], obs["groups"]["dp"]
    got = run_all(observations)
    assert got["group-members"][0] == "fail" and "swapped" in got["group-members"][1]
    observations = right_world()
    observations[2]["probe"]["tp"] = {"joined": [0, 1, 2, 3], "counts": [1.0] * 4}
    got = run_all(observations)
    assert got["group-members"][0] == "fail" and "rank 2" in got["group-members"][1]


def test_make_groups_that_raised_or_returned_one_group_fails():
    observations = right_world()
    observations[1]["groups"] = {"shape": "ProcessGroup"}
    got = run_all(observations)
    assert got["group-members"][0] == "fail" and "not (dp_group, tp_group)" in got["group-members"][1]
    observations = right_world()
    observations[0]["groups_error"] = {"type": "ValueError", "message": "nope", "line": None, "group_calls": False}
    assert run_all(observations)["group-members"][0] == "fail"


def test_new_group_calls_that_differ_fail_same_group_calls():
    observations = right_world()
    for obs in observations:
        obs["groups_error"] = {"type": "GroupCallsDiffer", "message": "the ranks' 1st dist.new_group calls differ",
                               "line": None, "group_calls": True}
    g = grading()
    assert not v.check_group_calls(g, observations, WORLD)
    status, message = verdicts(g)["same-group-calls"]
    assert status == "fail" and "use_local_synchronization" in message


def test_gradients_over_the_world_fail_both_group_checks():
    observations = [right_obs(r, grad_group=list(range(WORLD))) for r in range(WORLD)]
    got = run_all(observations)
    assert got["collective-groups"][0] == "fail" and "data-parallel group [0, 2]" in got["collective-groups"][1]
    assert got["tp-grads-own"][0] == "fail" and "peer(s) [1]" in got["tp-grads-own"][1]
    assert got["tp-same-batch"][0] == "pass" and got["dp-shards"][0] == "pass"


def test_a_loss_logged_over_the_world_is_no_gradient():
    observations = right_world()
    for obs in observations:
        obs["sequence"].insert(3, collective("all_reduce", list(range(WORLD)), 8))
    got = run_all(observations)
    assert got["collective-groups"][0] == "pass" and got["tp-grads-own"][0] == "pass"


def test_the_forward_all_reduce_on_the_world_fails_collective_groups_only_there():
    observations = [right_obs(r, forward_group=list(range(WORLD))) for r in range(WORLD)]
    got = run_all(observations)
    assert got["collective-groups"][0] == "fail" and "in forward" in got["collective-groups"][1]
    assert got["tp-grads-own"][0] == "pass"


def test_gathering_after_the_update_and_setup_before_the_first_forward_are_not_judged_by_group():
    observations = right_world()
    for obs in observations:
        obs["sequence"].insert(0, collective("broadcast", list(range(WORLD)), 4096, after=0, updated=None))
        obs["sequence"].append(collective("all_gather", list(range(WORLD)), 4096, after=3, updated=True))
    got = run_all(observations)
    assert got["collective-groups"][0] == "pass" and got["tp-grads-own"][0] == "pass"


def test_tensor_peers_with_different_rows_fail_tp_same_batch():
    inputs = rank_side.make_data()[0]
    observations = [right_obs(r, batch=inputs.chunk(WORLD)[r]) for r in range(WORLD)]
    got = run_all(observations)
    assert got["tp-same-batch"][0] == "fail" and "rows [0, 1, 2, 3]" in got["tp-same-batch"][1]
    assert got["dp-shards"][0] == "fail"


def test_every_rank_on_the_whole_batch_fails_dp_shards_alone():
    inputs = rank_side.make_data()[0]
    observations = [right_obs(r, batch=inputs) for r in range(WORLD)]
    got = run_all(observations)
    assert got["dp-shards"][0] == "fail" and "more than once" in got["dp-shards"][1]
    assert got["tp-same-batch"][0] == "pass" and got["matches-single"][0] == "pass"


def test_strided_shards_and_a_new_split_each_step_pass():
    inputs = rank_side.make_data()[0]
    observations = right_world()
    for rank, obs in enumerate(observations):
        dp_rank = rank // TP
        forwards = [e for e in obs["sequence"] if e["kind"] == "forward"]
        for step, e in enumerate(forwards):
            order = torch.randperm(inputs.shape[0], generator=torch.Generator().manual_seed(step))
            e["input"] = inputs[order[dp_rank::DP]]
    got = run_all(observations)
    assert got["tp-same-batch"][0] == "pass" and got["dp-shards"][0] == "pass"


def test_rows_not_from_the_data_fail_dp_shards():
    observations = [right_obs(r, batch=shard_of(r).float().double() * 2) for r in range(WORLD)]
    got = run_all(observations)
    assert got["dp-shards"][0] == "fail" and "not rows of data" in got["dp-shards"][1]


def test_a_model_never_called_fails_the_batch_checks():
    observations = right_world()
    for obs in observations:
        obs["sequence"] = [e for e in obs["sequence"] if e["kind"] != "forward"]
    got = run_all(observations)
    assert got["tp-same-batch"][0] == "fail" and "model(x)" in got["tp-same-batch"][1]


def test_a_wrong_or_local_state_dict_fails_matches_single():
    ref = reference()
    bad = dict(ref["final"], **{"fc1.bias": ref["final"]["fc1.bias"] + 1e-6})
    got = run_all([right_obs(r, state=bad) for r in range(WORLD)])
    assert got["matches-single"][0] == "fail" and "fc1.bias" in got["matches-single"][1]
    local = {k: local_block(k.replace(".", "_"), ref["final"], 0, TP) for k in rank_side.STATE_KEYS}
    got = run_all([right_obs(r, state=local) for r in range(WORLD)])
    assert got["matches-single"][0] == "fail" and "this rank's block" in got["matches-single"][1]
    missing = {k: t for k, t in ref["final"].items() if k != "fc2.bias"}
    got = run_all([right_obs(r, state=missing) for r in range(WORLD)])
    assert got["matches-single"][0] == "fail" and "no fc2.bias" in got["matches-single"][1]


def test_a_training_error_is_named_with_the_rank_that_caused_it():
    observations = right_world()
    observations[0]["train_error"] = {"type": "RuntimeError", "message": "Connection closed by peer", "line": None,
                                      "group_calls": False}
    observations[3]["train_error"] = {"type": "IndexError", "message": "list index out of range",
                                      "line": "line 9: x = shards[rank]", "group_calls": False}
    got = run_all(observations)
    assert got["matches-single"][0] == "fail" and "rank 3" in got["matches-single"][1]


class _Rank:
    def __init__(self, rank: int, result: dict | None, status: str = "ok"):
        self.rank, self.result, self.status, self.error, self.exitcode = rank, result, status, None, -6

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Outcome:
    def __init__(self, ranks):
        self.ranks = ranks


def bad_outcome(records_per_rank: list[list[dict]]) -> _Outcome:
    return _Outcome([_Rank(r, {"cases": records}) for r, records in enumerate(records_per_rank)])


def refusal(name: str) -> dict:
    return {"name": name, "raised": "ValueError", "message": "bad", "returned": None, "new_groups": 0}


def test_refusing_every_bad_input_passes_and_a_right_uneven_result_too():
    cases = rank_side.bad_cases(WORLD)
    uneven = reference(rank_side.UNEVEN_ROWS)
    g = grading()
    v.check_bad_input(g, bad_outcome([[refusal(c["name"]) for c in cases]] * WORLD), cases, uneven, WORLD)
    assert verdicts(g)["bad-input-refused"][0] == "pass"
    handled = [refusal(c["name"]) for c in cases[:-1]] + [
        {"name": "uneven_rows", "raised": None, "message": None, "new_groups": 4,
         "returned": {"kind": "dict", "tensors": dict(uneven["final"]), "other": {}}}]
    g = grading()
    v.check_bad_input(g, bad_outcome([handled] * WORLD), cases, uneven, WORLD)
    assert verdicts(g)["bad-input-refused"][0] == "pass"


def test_a_bad_input_accepted_or_refused_with_another_error_fails():
    cases = rank_side.bad_cases(WORLD)
    uneven = reference(rank_side.UNEVEN_ROWS)
    accepted = [{"name": "tp_size", "raised": None, "message": None, "new_groups": 4,
                 "returned": {"shape": None, "dp": [0], "tp": [0, 1, 2]}}]
    g = grading()
    v.check_bad_input(g, bad_outcome([accepted] * WORLD), cases, uneven, WORLD)
    status, message = verdicts(g)["bad-input-refused"]
    assert status == "fail" and "tp_size = 3" in message and "returned groups" in message
    other = [refusal("tp_size"), {"name": "input_features", "raised": "RuntimeError", "message": "mat1 and mat2",
                                  "returned": None, "new_groups": 0}]
    g = grading()
    v.check_bad_input(g, bad_outcome([other] * WORLD), cases, uneven, WORLD)
    status, message = verdicts(g)["bad-input-refused"]
    assert status == "fail" and "RuntimeError" in message
    wrong_uneven = [refusal(c["name"]) for c in cases[:-1]] + [
        {"name": "uneven_rows", "raised": None, "message": None, "new_groups": 4,
         "returned": {"kind": "dict", "tensors": dict(reference()["final"]), "other": {}}}]
    g = grading()
    v.check_bad_input(g, bad_outcome([wrong_uneven] * WORLD), cases, uneven, WORLD)
    assert verdicts(g)["bad-input-refused"][0] == "fail"


def test_a_rank_that_died_on_bad_input_fails_bad_input_refused():
    cases = rank_side.bad_cases(WORLD)
    outcome = bad_outcome([[refusal("tp_size")]] * WORLD)
    outcome.ranks[2] = _Rank(2, None, status="exited")
    g = grading()
    v.check_bad_input(g, outcome, cases, reference(rank_side.UNEVEN_ROWS), WORLD)
    status, message = verdicts(g)["bad-input-refused"]
    assert status == "fail" and "rank 2" in message
