"""Exercise 12's measures and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from grader import catalog
from grader.rank.drivers import ex12_tensor_parallel as rank_side
from grader.checks.ex12_tensor_parallel import reference as ref
from grader.checks.ex12_tensor_parallel import verdicts as v
from grading_helpers import grading_for, verdicts

ACTIVATION = rank_side.BATCH * rank_side.SEQ * rank_side.D_MODEL * 4


grading = grading_for("12")


def right_run(scenario: str, rank: int, world_size: int, want: dict) -> dict:
    """What a correct rank would record for one scenario."""
    hidden = rank_side.block(rank_side.HIDDEN, rank, world_size)
    output, input_grad = want["output"], want["input_grad"]
    if scenario == "column":
        output = output[..., hidden]
    if scenario == "row":
        input_grad = input_grad[..., hidden]
    params = {}
    for path, dim in ref.SPLIT[scenario].items():
        params[path] = {"missing": False, "in_parameters": True,
                        "value": ref.shard(want["values"][path], dim, rank, world_size).clone(),
                        "grad": ref.shard(want["grads"][path], dim, rank, world_size).clone()}
    event = {"op": "all_reduce", "bytes": ACTIVATION, "peer": None, "async_op": False}
    return {"output": output.clone(), "input_grad": input_grad.clone(), "backward_ran": True, "requires_grad": True,
            "params": params, "forward_events": [dict(event)], "backward_events": [dict(event)]}


@functools.cache
def dense_results() -> dict:
    """The grader's dense references (read only: every record below is built from clones)."""
    return {scenario: ref.dense(scenario) for scenario in rank_side.SEEDS}


def right_observations(world_size: int) -> tuple[list[dict], dict]:
    expected = dense_results()
    observations = []
    for rank in range(world_size):
        obs = {scenario: right_run(scenario, rank, world_size, expected[scenario]) for scenario in ref.SPLIT}
        share, _ = ref.held_limit(expected["mlp"], world_size)
        obs["mlp"]["held_bytes"] = share
        obs["no_bias"].update(error=None, biases={})
        refused = {"raised": "ValueError", "is_value_error": True, "message": "9 is not divisible by 2"}
        obs["uneven"] = {name: dict(refused) for name in ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP")}
        observations.append(obs)
    return observations, expected


def grade_all(observations: list[dict], expected: dict, world_size: int) -> dict:
    g = grading(world_size)
    v.check_column(g, observations, expected["column"], world_size)
    v.check_row(g, observations, expected["row"], world_size)
    v.check_mlp(g, observations, expected["mlp"], world_size)
    v.check_weight_grads(g, observations, expected, world_size)
    v.check_collectives(g, observations, world_size)
    v.check_held(g, observations, expected["mlp"], world_size)
    v.check_no_bias(g, observations, expected["no_bias"], world_size)
    v.check_uneven(g, observations, world_size)
    return verdicts(g)


def test_a_right_record_passes_every_check_at_each_world_size():
    for world_size in (2, 3, 4):
        observations, expected = right_observations(world_size)
        got = grade_all(observations, expected, world_size)
        assert {status for status, _ in got.values()} == {"pass"}, got
        assert set(got) == {c.id for c in catalog.by_id("12").checks}


def test_a_gradient_summed_again_in_backward_is_named_as_world_size_times_too_large():
    observations, expected = right_observations(3)
    for obs in observations:
        obs["row"]["input_grad"] *= 3
        obs["mlp"]["params"]["fc2.weight"]["grad"] *= 3
    got = grade_all(observations, expected, 3)
    status, message = got["row-input-grad"]
    assert status == "fail" and message.startswith("rank 0:") and "3.00 times the expected values" in message
    status, message = got["weight-grads"]
    assert status == "fail" and "fc2.weight.grad" in message and "3.00 times" in message
    assert got["mlp-output"][0] == "pass"


def test_an_input_gradient_without_the_all_reduce_fails_on_the_rank_that_shows_it():
    observations, expected = right_observations(2)
    observations[1]["column"]["input_grad"] = torch.zeros_like(observations[1]["column"]["input_grad"])
    status, message = grade_all(observations, expected, 2)["column-input-grad"]
    assert status == "fail" and message.startswith("rank 1:") and "'input.grad' differs by up to" in message


def test_an_output_block_of_another_rank_names_the_features_expected():
    observations, expected = right_observations(2)
    observations[0]["column"]["output"] = observations[1]["column"]["output"].clone()
    status, message = grade_all(observations, expected, 2)["column-output"]
    assert status == "fail" and "output features 0 to 23" in message


def test_a_missing_backward_or_parameter_is_said_in_words():
    observations, expected = right_observations(2)
    observations[0]["row"]["backward_ran"] = False
    observations[0]["row"]["requires_grad"] = False
    got = grade_all(observations, expected, 2)
    assert "does not require grad" in got["row-input-grad"][1]
    observations, expected = right_observations(2)
    observations[1]["mlp"]["params"]["fc2.bias"] = {"missing": True}
    status, message = grade_all(observations, expected, 2)["weight-grads"]
    assert status == "fail" and "rank 1: ParallelMLP.fc2.bias does not exist" in message
    observations, expected = right_observations(2)
    observations[1]["column"]["params"]["bias"]["in_parameters"] = False
    status, message = grade_all(observations, expected, 2)["weight-grads"]
    assert status == "fail" and "rank 1: ColumnParallelLinear.bias is not among ColumnParallelLinear.parameters()" \
        in message
    observations, expected = right_observations(2)
    observations[0]["mlp"]["params"]["fc1.weight"]["value"] = expected["mlp"]["values"]["fc1.weight"].clone()
    status, message = grade_all(observations, expected, 2)["weight-grads"]
    assert status == "fail" and "has shape [48, 16]; its block of the dense layer's has [24, 16]" in message


def test_extra_or_oversized_collectives_fail_with_what_was_seen():
    observations, expected = right_observations(2)
    broadcast = {"op": "broadcast", "bytes": ACTIVATION, "peer": None, "async_op": False}
    observations[0]["mlp"]["forward_events"].insert(0, broadcast)
    observations[1]["mlp"]["backward_events"][0]["bytes"] = 2 * ACTIVATION
    got = grade_all(observations, expected, 2)
    status, message = got["forward-one-all-reduce"]
    assert status == "fail" and "made 2 collective call(s): broadcast of 384 bytes, all_reduce of 384 bytes" in message
    status, message = got["backward-one-all-reduce"]
    assert status == "fail" and message.startswith("rank 1:") and "all_reduce of 768 bytes" in message
    observations, expected = right_observations(2)
    observations[0]["mlp"]["backward_events"] = []
    assert "made 0 collective call(s): none" in grade_all(observations, expected, 2)["backward-one-all-reduce"][1]


def test_one_rank_may_skip_its_all_reduces():
    observations, expected = right_observations(1)
    observations[0]["mlp"]["forward_events"] = observations[0]["mlp"]["backward_events"] = []
    got = grade_all(observations, expected, 1)
    assert got["forward-one-all-reduce"][0] == got["backward-one-all-reduce"][0] == "pass"


def test_held_bytes_counts_whole_storages_attributes_and_nested_modules_once():
    full = nn.Linear(4, 8)
    module = nn.Module()
    module.weight = nn.Parameter(full.weight.detach()[:4])  # a view: the whole 8x4 storage
    module.notes = {"copy": full.bias.detach().clone(), "again": [module.weight]}
    assert rank_side.held_bytes(module) == 8 * 4 * 4 + 8 * 4
    outer = nn.Module()
    outer.inner = module
    object.__setattr__(outer, "kept", full)  # a module outside _modules is found too
    assert rank_side.held_bytes(outer) == 8 * 4 * 4 + 8 * 4 + 8 * 4
    cloned = nn.Module()
    cloned.weight = nn.Parameter(full.weight.detach()[:4].clone())
    assert rank_side.held_bytes(cloned) == 4 * 4 * 4


def test_full_weights_on_a_rank_fail_and_a_share_passes():
    observations, expected = right_observations(2)
    share, full = ref.held_limit(expected["mlp"], 2)
    assert share == (16 * 48 + 48 + 48 * 16) * 4 // 2 + 16 * 4 and full == (16 * 48 + 48 + 48 * 16 + 16) * 4
    observations[1]["mlp"]["held_bytes"] = full
    status, message = grade_all(observations, expected, 2)["weights-sharded"]
    assert status == "fail" and f"rank 1: its ParallelMLP holds {full} bytes" in message and str(share) in message
    observations, expected = right_observations(2)
    observations[0]["mlp"]["held_bytes"] = share + ref.HELD_SLACK  # a small index tensor besides the weights
    assert grade_all(observations, expected, 2)["weights-sharded"][0] == "pass"
    observations, expected = right_observations(2)
    for obs in observations:
        obs["mlp"]["held_bytes"] = 100
    status, message = grade_all(observations, expected, 2)["weights-sharded"]
    assert status == "fail" and "less than the dense MLP's" in message


def uneven_split(world_size: int, sizes: list[int] | None = None) -> list[dict]:
    """What each rank records for the uneven scenario when every class splits the n features into
    blocks of ``sizes`` (default: torch.tensor_split's) and computes right."""
    n = rank_side.uneven(world_size)
    sizes = sizes or [len(b) for b in torch.tensor_split(torch.arange(n), world_size)]
    want = ref.dense_uneven(world_size)
    starts = [sum(sizes[:r]) for r in range(world_size)]
    records = []
    for rank in range(world_size):
        part = slice(starts[rank], starts[rank] + sizes[rank])
        column = want["ColumnParallelLinear"]
        row = want["RowParallelLinear"]
        mlp = want["ParallelMLP"]
        records.append({
            "ColumnParallelLinear": {"raised": None, "weight_shape": [sizes[rank], rank_side.D_MODEL], "everywhere": True,
                                     "widths": list(sizes), "run": {"output": column["output"][..., part].clone(),
                                     "input_grad": column["input_grad"].clone(), "backward_ran": True}},
            "RowParallelLinear": {"raised": None, "weight_shape": [rank_side.D_MODEL, sizes[rank]], "everywhere": True,
                                  "widths": list(sizes), "run": {"output": row["output"].clone(),
                                  "input_grad": row["input_grad"][..., part].clone(), "backward_ran": True}},
            "ParallelMLP": {"raised": None, "weight_shape": [sizes[rank], rank_side.D_MODEL], "everywhere": True,
                            "run": {"output": mlp["output"].clone(), "input_grad": mlp["input_grad"].clone(),
                                    "backward_ran": True}},
        })
    return records


def uneven_verdict(world_size: int, records: list[dict]) -> tuple[tuple[str, str], str | None]:
    observations, _ = right_observations(world_size)
    for obs, record in zip(observations, records):
        obs["uneven"] = record
    g = grading(world_size)
    said = v.check_uneven(g, observations, world_size)
    return verdicts(g)["uneven-refused"], said


def refusal(kind: str, message: str = "") -> dict:
    return {"raised": kind, "message": message, "everywhere": False}


def test_a_refusal_with_a_value_error_or_an_assert_passes_and_is_said():
    for kind in ("ValueError", "AssertionError"):
        records = [{name: refusal(kind) for name in rank_side.UNEVEN_CLASSES} for _ in range(3)]
        (status, _), said = uneven_verdict(3, records)
        assert status == "pass" and said == f"3 ranks, 13 features: every class refused ({kind})"
    g = grading(1)
    v.check_uneven(g, [{}], 1)
    assert g.results(None)[-1].status == "skip"


def test_an_uneven_split_that_is_right_on_every_rank_passes_and_is_said():
    (status, _), said = uneven_verdict(3, uneven_split(3))
    assert status == "pass" and "every class split 5 + 4 + 4, results right on every rank" in said
    (status, _), said = uneven_verdict(3, uneven_split(3, [5, 5, 3]))  # torch.chunk's blocks
    assert status == "pass" and "split 5 + 5 + 3" in said
    records = uneven_split(2)
    for record in records:
        record["ParallelMLP"] = refusal("ValueError", "9 is not divisible by 2")
    (status, _), said = uneven_verdict(2, records)
    assert status == "pass" and "ParallelMLP refused (ValueError)" in said
    assert "ColumnParallelLinear split 5 + 4" in said


def test_a_layer_that_builds_and_computes_a_wrong_result_fails_and_says_so():
    floor = uneven_split(2, [4, 4])  # n // W features each: the last one is on no rank
    for record in floor:
        record["ColumnParallelLinear"]["run"]["output"] = record["ColumnParallelLinear"]["run"]["output"][..., :4]
    (status, message), _ = uneven_verdict(2, floor)
    assert status == "fail" and message.startswith("ColumnParallelLinear(nn.Linear(16, 9)) on 2 ranks was built")
    assert "8 features, the dense layer's 9: some features are on no rank" in message and "4 + 4" in message

    records = uneven_split(3)
    records[2]["ParallelMLP"]["run"]["output"] = records[2]["ParallelMLP"]["run"]["output"] * 1.01
    (status, message), _ = uneven_verdict(3, records)
    assert status == "fail" and message.startswith("rank 2: ParallelMLP(nn.Linear(16, 13), nn.Linear(13, 16))")
    assert "wrong result without an error" in message and "Refuse such a split in __init__" in message

    records = uneven_split(2)
    records[1]["RowParallelLinear"]["run"]["input_grad"] = records[1]["RowParallelLinear"]["run"]["input_grad"] * 0
    (status, message), _ = uneven_verdict(2, records)
    assert status == "fail" and message.startswith("rank 1: RowParallelLinear(nn.Linear(9, 16))")
    assert "input.grad" in message


def test_refusing_on_some_ranks_an_accidental_exception_or_a_failing_forward_fail():
    records = uneven_split(2)
    records[0]["RowParallelLinear"] = refusal("ValueError", "9 features")
    (status, message), _ = uneven_verdict(2, records)
    assert status == "fail" and "rank 0: RowParallelLinear" in message and "but rank 1 built it" in message

    records = [{name: refusal("RuntimeError", "shape '[2, 4]' is invalid") for name in rank_side.UNEVEN_CLASSES}] * 2
    (status, message), _ = uneven_verdict(2, records)
    assert status == "fail" and "raised RuntimeError" in message and "not a refusal of the split" in message

    records = uneven_split(2)
    records[1]["ParallelMLP"]["error"] = "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    (status, message), _ = uneven_verdict(2, records)
    assert status == "fail" and message.startswith("rank 1: ParallelMLP")
    assert "then its forward or backward raised" in message

    records = uneven_split(2)
    for record in records:
        record["RowParallelLinear"].update(weight_shape=None, widths=[-1, -1], run=None)
    (status, message), _ = uneven_verdict(2, records)
    assert status == "fail" and "cannot tell which of the 9 features" in message


def test_the_uneven_scenario_is_the_same_in_ranks_and_grader():
    a, b = rank_side.build_uneven(3), rank_side.build_uneven(3)
    assert all(torch.equal(a[k].weight, b[k].weight) for k in ("column", "row", "fc1", "fc2"))
    assert torch.equal(a["x_row"], b["x_row"]) and a["x_row"].shape[-1] == rank_side.uneven(3)
    want = ref.dense_uneven(3)
    assert want["ColumnParallelLinear"]["output"].shape[-1] == rank_side.uneven(3)
    assert want["RowParallelLinear"]["input_grad"].shape[-1] == rank_side.uneven(3)


def test_bias_false_reports_an_error_or_a_bias_that_should_be_none():
    observations, expected = right_observations(2)
    observations[0]["no_bias"] = {"error": "ParallelMLP(fc1, fc2) with bias=False layers raised TypeError: x"}
    status, message = grade_all(observations, expected, 2)["bias-false"]
    assert status == "fail" and "TypeError" in message
    observations, expected = right_observations(2)
    observations[1]["no_bias"]["biases"] = {"fc2.bias": "Parameter"}
    status, message = grade_all(observations, expected, 2)["bias-false"]
    assert status == "fail" and "fc2.bias should be None (full.bias is None), found a Parameter" in message


def test_the_dense_reference_has_the_shapes_the_statement_names():
    mlp = ref.dense("mlp")
    assert mlp["output"].shape == (rank_side.BATCH, rank_side.SEQ, rank_side.D_MODEL) and mlp["input_grad"].shape == mlp["output"].shape
    assert set(mlp["grads"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert set(ref.dense("no_bias")["grads"]) == {"fc1.weight", "fc2.weight"}
    assert ref.shard(mlp["grads"]["fc2.weight"], 1, 1, 4).shape == (rank_side.D_MODEL, rank_side.HIDDEN // 4)
    for world_size in (2, 3, 4):
        assert rank_side.HIDDEN % world_size == 0 and rank_side.uneven(world_size) % world_size != 0


def test_watch_collectives_sees_functional_collectives_and_the_single_names_once():
    """A world of one, in this process: each call is recorded once, under the collective it runs."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from grader.rank import probes

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        events: list = []
        with probes.watch_collectives(events):
            x = torch.ones(4)
            funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
            out = torch.empty(4)
            with pytest.warns(FutureWarning):  # the deprecated name, which calls all_gather_single
                dist.all_gather_into_tensor(out, x)
            dist.all_gather_single(out, x)
            dist.all_reduce(x)
        assert [(e["op"], e["bytes"]) for e in events] == [
            ("all_reduce", 16), ("all_gather_into_tensor", 16), ("all_gather_single", 16), ("all_reduce", 16)]
        assert funcol.all_reduce.__name__ == "all_reduce" and not hasattr(funcol.all_reduce, "__wrapped__")
    finally:
        dist.destroy_process_group()
