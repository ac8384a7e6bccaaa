"""Exercise 18's measures and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import functools

import torch

from grader import catalog
from grader.rank.drivers import ex18_sequence_parallel as rank_side
from grader.checks.ex18_sequence_parallel import reference as ref
from grader.checks.ex18_sequence_parallel import verdicts as v
from grading_helpers import grading_for, verdicts
from grader.rank.harness import RankOutcome, WorldOutcome

NAMES = {"norm.weight": "norm.weight", "norm.bias": "norm.bias", "fc1.weight": "fc1.weight", "fc1.bias": "fc1.bias",
         "fc2.weight": "fc2.weight", "fc2.bias": "fc2.bias"}


grading = grading_for("18")


@functools.cache
def want() -> dict:
    return ref.expected_main(2)  # the same block for 2, 3 and 4 ranks (rank_side.sizes)


def chunk_bytes(world_size: int) -> int:
    return rank_side.chunk_elements(world_size) * 8


def event(op: str, nbytes: int) -> dict:
    return {"op": op, "bytes": nbytes, "peer": None, "async_op": False}


def right_events(world_size: int) -> tuple[list[dict], list[dict]]:
    """What the reference records: a small all-reduce of the lengths, then the two collectives; in backward
    the two conjugates and the three replicated gradients' all-reduces."""
    chunk, whole = chunk_bytes(world_size), chunk_bytes(world_size) * world_size
    forward = [event("all_reduce", 16), event("all_gather_single", whole), event("reduce_scatter_single", chunk)]
    backward = [event("all_gather_single", whole), event("reduce_scatter_single", chunk)] + \
        [event("all_reduce", rank_side.D_MODEL * 8)] * 3
    return forward, backward


def saved_entry(tensor: torch.Tensor) -> dict:
    return {"bytes": tensor.numel() * tensor.element_size(), "views": [{"shape": list(tensor.shape), "values": tensor}]}


def right_saved(rank: int, world_size: int) -> list[dict]:
    """What a rank saves: its chunk of x and the norm's statistics, then the parallel region's tensors."""
    rows = rank_side.chunk_rows(rank, world_size)
    x = rank_side.build("main")["x"][rows]
    stats = torch.randn(x.shape[0], rank_side.BATCH, 1, dtype=torch.float64)
    return [saved_entry(x), saved_entry(stats), saved_entry(stats + 1),
            *[saved_entry(t) for t in ref.inside_tensors(want(), rank, world_size)]]


def right_params(rank: int, world_size: int) -> list[dict]:
    return [{"name": name, "value": ref.share_of(want(), name, rank, world_size).clone(),
             "grad": ref.share_of(want(), name, rank, world_size, "grads").clone()} for name in NAMES]


def right_run(rank: int, world_size: int) -> dict:
    rows = rank_side.chunk_rows(rank, world_size)
    forward, backward = right_events(world_size)
    return {"output": want()["output"][rows].clone(), "input_grad": want()["x_grad"][rows].clone(),
            "backward_ran": True, "forward_events": forward, "backward_events": backward,
            "saved": right_saved(rank, world_size), "params": right_params(rank, world_size)}


def right_group_run(rank: int, world_size: int) -> dict:
    groups = rank_side.groups_of(world_size)
    mine = next(i for i, members in enumerate(groups) if rank in members)
    members = groups[mine]
    dense = ref.reference("group", len(members), salt=mine)
    place, size = members.index(rank), len(members)
    rows = rank_side.chunk_rows(place, size)
    return {"output": dense["output"][rows], "input_grad": dense["x_grad"][rows], "backward_ran": True,
            "members": members, "params": [{"name": name, "value": ref.share_of(dense, name, place, size),
                                            "grad": ref.share_of(dense, name, place, size, "grads")} for name in NAMES]}


def held_share(world_size: int) -> int:
    sizes = {name: t.numel() * 8 for name, t in want()["values"].items()}
    return sum(sizes[n] for n in rank_side.REPLICATED) + sum(sizes[n] for n in rank_side.SPLIT) // world_size


def right_observations(world_size: int) -> list[dict]:
    refused = {"raised": "ValueError", "message": "not divisible"}
    return [{"main": right_run(rank, world_size), "second": right_run(rank, world_size),
             "held_bytes": held_share(world_size),
             "group": right_group_run(rank, world_size), "hidden": dict(refused),
             "shape": {**refused, "built": True}} for rank in range(world_size)]


def outcome(world_size: int, results: list | None = None, statuses: dict | None = None) -> WorldOutcome:
    ranks = []
    for rank in range(world_size):
        status = (statuses or {}).get(rank, "ok")
        ranks.append(RankOutcome(rank, status, result=None if results is None else results[rank],
                                 exitcode=-6 if status == "exited" else 0))
    return WorldOutcome(world_size, ranks)


def refusals(world_size: int, raised: str | None = "ValueError") -> WorldOutcome:
    return outcome(world_size, [{"raised": raised, "message": "lengths differ", "length": n}
                                for n in rank_side.uneven_lengths(world_size)])


def grade_all(observations: list[dict], world_size: int, uneven: WorldOutcome | None = None) -> dict:
    g = grading(world_size)
    main_ok = all([v.check_output(g, observations, want(), world_size),
                   v.check_input_grad(g, observations, want(), world_size),
                   v.check_slices(g, observations, want(), world_size),
                   v.check_replicated(g, observations, want(), world_size)])
    v.check_second_step(g, observations, world_size)
    v.check_collectives(g, observations, world_size)
    v.check_saved(g, observations, want(), world_size)
    v.check_held(g, observations, want(), world_size)
    v.check_hidden(g, observations, world_size)
    v.check_shape(g, observations, world_size)
    v.check_group(g, observations, world_size, main_ok)
    v.check_uneven(g, uneven or refusals(world_size), world_size)
    return verdicts(g)


def test_a_right_record_passes_every_check_at_each_world_size():
    for world_size in (2, 3, 4):
        got = grade_all(right_observations(world_size), world_size)
        assert {status for status, _ in got.values()} == {"pass"}, got
        assert set(got) == {c.id for c in catalog.by_id("18").checks}


def test_the_dense_reference_saves_its_whole_input_and_statistics_outside_the_region():
    rk_x = rank_side.SEQ * rank_side.BATCH * rank_side.D_MODEL * 8
    assert ref.outside_bytes_dense(want()) == rk_x + 2 * rank_side.SEQ * rank_side.BATCH * 8
    assert [rank_side.chunk_rows(r, 3) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert rank_side.uneven_lengths(4) == [4, 3, 3, 3] and rank_side.uneven_hidden(2) % 2
    assert rank_side.groups_of(4) == [[0, 2], [1, 3]] and rank_side.groups_of(3) == [[0, 2], [1]]
    assert rank_side.sizes(2) == rank_side.sizes(3) == rank_side.sizes(4) == (rank_side.SEQ, rank_side.HIDDEN)
    assert rank_side.sizes(5) == (15, 60) and rank_side.uneven_lengths(5) == [4, 3, 3, 3, 3]
    assert ref.expected_main(5)["output"].shape == (15, rank_side.BATCH, rank_side.D_MODEL)


def test_a_bias_added_on_every_rank_is_named():
    observations = right_observations(3)
    rows = rank_side.chunk_rows(1, 3)
    observations[1]["main"]["output"] = want()["output"][rows] + 2 * want()["values"]["fc2.bias"]
    got = grade_all(observations, 3)
    status, message = got["output-matches"]
    assert status == "fail" and message.startswith("world size 3, rank 1 (positions 4-7 of 12)")
    assert "counted 3 times, not once" in message
    assert got["uses-group"] == ("pass", "")


def test_an_input_gradient_of_the_own_hidden_block_alone_is_named():
    observations = right_observations(2)
    own = ref.own_term(0, 2)["x_grad"][rank_side.chunk_rows(0, 2)]
    observations[0]["main"]["input_grad"] = own
    status, message = grade_all(observations, 2)["input-grad-matches"]
    assert status == "fail" and "own hidden block's term" in message and "reduce-scatter" in message


def test_parameters_are_found_by_value_even_transposed_and_strided_blocks_are_not():
    observations = right_observations(2)
    for p in observations[1]["main"]["params"]:
        if p["name"] == "fc1.weight":
            p["name"], p["value"], p["grad"] = "w_in", p["value"].T.contiguous(), p["grad"].T.contiguous()
    assert grade_all(observations, 2)["slice-grads-match"] == ("pass", "")
    observations = right_observations(2)
    strided = want()["values"]["fc1.weight"][1::2]
    observations[1]["main"]["params"][2] = {"name": "fc1_weight", "value": strided, "grad": strided}
    status, message = grade_all(observations, 2)["slice-grads-match"]
    assert status == "fail" and "no parameter of the block holds rows 36-71 of fc1.weight" in message
    assert "fc1_weight [36, 16]" in message


def test_replicated_gradients_that_differ_fail_agreement_and_averaged_ones_fail_the_match_only():
    observations = right_observations(3)
    observations[2]["main"]["params"][0]["grad"] = observations[2]["main"]["params"][0]["grad"] * 0.5
    got = grade_all(observations, 3)
    assert got["replicated-grads-agree"][0] == "fail" and "differs from rank 0's" in got["replicated-grads-agree"][1]
    assert got["replicated-grads-match"][0] == "fail"
    assert got["uses-group"][0] == "pass"
    observations = right_observations(2)
    for obs in observations:
        for p in obs["main"]["params"]:
            if p["name"] in rank_side.REPLICATED:
                p["grad"] = p["grad"] / 2
    got = grade_all(observations, 2)
    assert got["replicated-grads-agree"] == ("pass", "")
    assert got["replicated-grads-match"][0] == "fail" and "averaged, not summed" in got["replicated-grads-match"][1]


def test_an_all_reduce_of_an_activation_fails_and_torch_nn_scatters_count_as_one_reduce_scatter():
    observations = right_observations(2)
    whole = chunk_bytes(2) * 2
    observations[0]["main"]["forward_events"] = [event("all_gather_into_tensor", whole), event("all_reduce", whole)]
    got = grade_all(observations, 2)
    status, message = got["forward-gather-scatter"]
    assert status == "fail" and "0 reduce-scatter(s) and 1 other" in message and "all-reduce of 3072 bytes" in message
    assert got["backward-gather-scatter"] == ("pass", "")
    observations = right_observations(3)
    for obs in observations:  # torch.distributed.nn.functional.all_gather's backward on gloo: W scatters
        obs["main"]["backward_events"] = [event("all_gather", chunk_bytes(3))] + \
            [event("scatter", chunk_bytes(3))] * 3 + [event("all_reduce", 128)]
    assert grade_all(observations, 3)["backward-gather-scatter"] == ("pass", "")
    observations[0]["main"]["backward_events"] = observations[0]["main"]["backward_events"][:-2]
    assert grade_all(observations, 3)["backward-gather-scatter"][0] == "fail"
    observations = right_observations(4)
    observations[3]["main"]["backward_events"] = [event("all_gather_into_tensor", chunk_bytes(4) * 4)]
    status, message = grade_all(observations, 4)["backward-gather-scatter"]
    assert status == "fail" and "rank 3" in message and "1 all-gather(s), 0 reduce-scatter(s)" in message


def test_a_norm_on_the_whole_sequence_fails_the_saved_check_and_chunk_sized_saves_pass():
    observations = right_observations(2)
    whole_x = rank_side.build("main")["x"]
    observations[0]["main"]["saved"][0] = saved_entry(whole_x)
    status, message = grade_all(observations, 2)["saved-activations-sharded"]
    assert status == "fail" and "384 elements" in message and "dense block keeps 3456" in message
    observations = right_observations(4)
    x = observations[1]["main"]["saved"][0]["views"][0]["values"]
    # A LayerNorm written by hand keeps several chunk-sized tensors (x - mean, the normalised x): fine.
    observations[1]["main"]["saved"] += [saved_entry(x - 1), saved_entry(x * 2)]
    # The parallel region's tensors in another layout (batch-first, flattened) are still recognised.
    normed = want()["normed"].transpose(0, 1).reshape(-1, rank_side.D_MODEL).clone()
    observations[1]["main"]["saved"][3] = saved_entry(normed)
    assert grade_all(observations, 4)["saved-activations-sharded"] == ("pass", "")


def test_weights_held_beyond_the_share_or_missing_fail():
    observations = right_observations(2)
    observations[1]["held_bytes"] += want()["values"]["fc1.weight"].numel() * 8 // 2
    status, message = grade_all(observations, 2)["weights-sharded"]
    assert status == "fail" and "rank 1" in message and ".clone()" in message
    observations = right_observations(2)
    for obs in observations:
        obs["held_bytes"] = held_share(2) // 2
    status, message = grade_all(observations, 2)["weights-sharded"]
    assert status == "fail" and "some weights are on no rank" in message


def test_bad_input_must_be_refused_on_every_rank_with_value_error_or_assert():
    observations = right_observations(2)
    observations[1]["hidden"] = {"raised": None}
    status, message = grade_all(observations, 2)["hidden-not-divisible-refused"]
    assert status == "fail" and "9 hidden features for 2 ranks" in message and "rank 1 went on" in message
    observations = right_observations(2)
    for obs in observations:
        obs["shape"] = {"raised": "RuntimeError", "message": "Given normalized_shape=[16]", "built": True}
    status, message = grade_all(observations, 2)["wrong-shape-refused"]
    assert status == "fail" and "raised RuntimeError" in message
    for obs in observations:
        obs["shape"] = {"raised": "AssertionError", "message": "expected 16", "built": True}
        obs["hidden"] = {"raised": "AssertionError", "message": "9 % 2"}
    got = grade_all(observations, 2)
    assert got["wrong-shape-refused"] == got["hidden-not-divisible-refused"] == ("pass", "")


def test_a_sum_that_hides_uneven_chunks_fails_the_rank_that_went_on():
    assert rank_side.uneven_lengths(4, "sum-hides") == [2, 4, 3, 3] and rank_side.uneven_lengths(3, "sum-hides") == [3, 5, 4]
    results = [{"raised": "ValueError", "message": "not 4 chunks of 2", "length": 2},
               {"raised": "ValueError", "message": "not 4 chunks of 4", "length": 4},
               {"raised": "RuntimeError", "message": "Timed out waiting 5000ms", "length": 3},
               {"raised": "RuntimeError", "message": "Timed out waiting 5000ms", "length": 3}]
    g = grading(4)
    v.check_uneven(g, outcome(4, results), 4, "sum-hides")
    status, message = verdicts(g)["uneven-sequence-refused"]
    assert status == "fail" and "(their sum is 12 = 3 x 4" in message
    assert "ranks 0, 1 raised ValueError, but rank 2 did not refuse" in message and "not only the total" in message
    g = grading(4)
    v.check_uneven(g, refusals(4), 4, "sum-hides")
    assert verdicts(g)["uneven-sequence-refused"][0] == "pass"


def test_uneven_chunks_must_be_refused_by_every_rank():
    assert grade_all(right_observations(4), 4, refusals(4, "AssertionError"))["uneven-sequence-refused"][0] == "pass"
    status, message = grade_all(right_observations(4), 4, outcome(4, statuses={1: "exited"}))["uneven-sequence-refused"]
    assert status == "fail" and "lengths [4, 3, 3, 3]" in message and "exit code -6" in message
    results = [{"raised": "ValueError", "message": "lengths", "length": 4}] + \
        [{"raised": None, "length": 3, "output": None}] * 3
    status, message = grade_all(right_observations(4), 4, outcome(4, results))["uneven-sequence-refused"]
    assert status == "fail" and "rank 0 raised ValueError, but rank 1 did not refuse: it went on without an error" \
        in message


def test_a_block_that_ignores_its_group_fails_uses_group_with_the_group_advice():
    observations = right_observations(4)
    observations[2]["group"]["output"] = observations[2]["group"]["output"] + 0.1
    status, message = grade_all(observations, 4)["uses-group"]
    assert status == "fail" and "rank 2, in group [0, 2]" in message and "dist.get_rank(group)" in message
    observations[0]["main"]["output"] = observations[0]["main"]["output"] + 0.1  # wrong without group= too
    status, message = grade_all(observations, 4)["uses-group"]
    assert status == "fail" and "as without group=" in message
    observations = right_observations(4)
    observations[3]["group"] = {"error": "ValueError: Global rank 1 is not part of group", "members": [1, 3]}
    status, message = grade_all(observations, 4)["uses-group"]
    assert status == "fail" and "Global rank 1" in message


def test_a_tanh_gelu_fails_the_output_and_not_the_saved_activations():
    # What autograd saves inside the parallel region is told by its shape, not its values: a GELU of
    # another shape of curve changes the values there, not where they lie.
    observations = right_observations(2)
    for rank, obs in enumerate(observations):
        block = rank_side.hidden_block(rank, 2, rank_side.HIDDEN)
        tanh = torch.nn.functional.gelu(want()["hidden"][..., block], approximate="tanh")
        obs["main"]["saved"][-1] = saved_entry(tanh.reshape(-1, tanh.shape[-1]).clone())
        obs["main"]["output"] = obs["main"]["output"] + 1e-4
    got = grade_all(observations, 2)
    assert got["output-matches"][0] == "fail"
    assert got["saved-activations-sharded"] == ("pass", "")
    # A norm with the eps off (so the gathered input's values differ too) is still fc1's gathered input.
    observations[0]["main"]["saved"][3] = saved_entry(want()["normed"] * 1.001)
    assert grade_all(observations, 2)["saved-activations-sharded"] == ("pass", "")


def test_a_norm_that_ignores_its_eps_is_named():
    observations = right_observations(2)
    default_eps = ref.reference("main", 2, eps=1e-5)["output"]
    for rank, obs in enumerate(observations):
        obs["main"]["output"] = default_eps[rank_side.chunk_rows(rank, 2)].clone()
    status, message = grade_all(observations, 2)["output-matches"]
    assert status == "fail" and "LayerNorm's default eps 1e-5, not the norm's eps (0.001)" in message
    assert rank_side.build("main")["norm"].eps == rank_side.NORM_EPS != 1e-5


def test_hooks_that_pile_up_fail_the_second_step_with_how_many_times():
    observations = right_observations(3)
    assert grade_all(observations, 3)["second-step-matches"] == ("pass", "")
    second = observations[1]["second"]
    for p in second["params"]:
        if p["name"] in rank_side.REPLICATED:
            p["grad"] = p["grad"] * 3  # all-reduced twice: the first sum, summed again over 3 ranks
    status, message = grade_all(observations, 3)["second-step-matches"]
    assert status == "fail" and "rank 1" in message and "norm.weight.grad" in message
    assert "it is 3 times the first step's" in message and "registered in forward" in message
    observations = right_observations(2)
    del observations[0]["second"]
    status, message = grade_all(observations, 2)["second-step-matches"]
    assert status == "fail" and "no second step could be run" in message
