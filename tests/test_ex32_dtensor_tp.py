"""Exercise 32's model, placements and verdicts, from hand-made records (no processes started).

Each verdict is shown passing on the record a right answer leaves and failing on a wrong one.
"""

from __future__ import annotations

import functools

import pytest
import torch

from grader.rank.drivers import ex32_dtensor_tp as rank_side
from grader.checks.ex32_dtensor_tp import reference as ref
from grader.checks.ex32_dtensor_tp import verdicts as v
from grader.checks.shared import dtensors
from grader.checks.shared.dtensors import expected_local
from grading_helpers import grading_for, verdicts

WORLD, TP = 4, 2
DP = WORLD // TP
MODEL = rank_side.build_model()
SHAPES = {name: list(p.shape) for name, p in MODEL.named_parameters()}
NAMES = list(SHAPES)


grading = grading_for("32", WORLD)


@functools.cache
def reference(world_size: int = WORLD, tp_size: int = TP) -> dict:
    return ref.reference_run(world_size, tp_size)


def coord(rank: int, tp_size: int = TP) -> list[int]:
    return [rank // tp_size, rank % tp_size]


def tp_placement(name: str) -> str:
    """A right plan's placement of ``name`` on "tp"."""
    if name.endswith(v.ROWWISE):
        return "Shard(dim=1)"
    if name.endswith(v.NORMS):
        return "Replicate()"
    return "Shard(dim=0)"  # column-parallel linears, the head and the embeddings (split by vocabulary rows)


def entry(name: str, rank: int, placements: list[str] | None = None, names=("dp", "tp"), shape=(DP, TP)) -> dict:
    """What the driver records of one parameter on ``rank`` (by default after a right parallelize)."""
    if placements is None:
        on_tp = tp_placement(name)
        on_dp = f"_StridedShard(dim=0, sf={TP})" if on_tp == "Shard(dim=0)" else "Shard(dim=0)"
        placements = [on_dp, on_tp]
    out = {"kind": "DTensor", "dtensor": True, "shape": SHAPES[name], "dtype": "float32", "placements": placements,
           "mesh_names": list(names), "mesh_shape": list(shape), "coord": coord(rank), "layout": [[0, 1], [2, 3]]}
    out["local_shape"] = list(expected_local(torch.empty(SHAPES[name]), out).shape)
    return out


def plain(name: str) -> dict:
    return {"kind": "Parameter", "dtensor": False, "shape": SHAPES[name], "dtype": "float32",
            "local_shape": SHAPES[name]}


def mesh(names=("dp", "tp"), shape=(DP, TP), layout=((0, 1), (2, 3))) -> dict:
    return {"type": "DeviceMesh", "device_type": "cpu", "shape": list(shape), "names": list(names),
            "layout": [list(row) for row in layout]}


def norm_input(rank: int, length: int = rank_side.SEQ // TP) -> dict:
    return {"kind": "DTensor", "dtensor": False, "shape": [rank_side.BATCH, length, 32],
            "local_shape": [rank_side.BATCH, length, 32]}


def event(op: str, group: list[int], via: str = "functional", size: int = 64) -> dict:
    return {"op": op, "via": via, "group": group, "bytes": size, "dtype": "float32"}


LAYERS = len(MODEL.layers)
MARK = {"op": "mark", "what": "forward-returned", "via": None, "group": None, "bytes": 0}


def step_events(rank: int, units: list[int] | None = None, gathers_per_block: int = 2) -> list[dict]:
    """A right step's collectives: DTensor's among the rank's row, FSDP's among its column. In the forward (up to
    the mark) the root's unit and each block's are gathered among the column (``units``: their bytes), and the
    sequence ``gathers_per_block`` times per block, before the head and for the logits among the row."""
    tp, dp = v.groups_of(rank, WORLD, TP)
    units = [6208] + [10368] * LAYERS if units is None else units
    forward = [event("all_gather_into_tensor", dp, via="c10d", size=size) for size in units]
    for _ in range(LAYERS):
        forward += [event("all_gather_into_tensor", tp, size=2048)] * gathers_per_block
        forward += [event("reduce_scatter_tensor", tp, size=4096)]
    forward += [event("all_gather_into_tensor", tp, size=2048), event("all_gather_into_tensor", tp, size=6144)]
    return forward + [dict(MARK), event("all_gather_into_tensor", tp), event("reduce_scatter_tensor", tp),
                      event("all_gather_into_tensor", dp, via="c10d"), event("reduce_scatter_tensor", dp, via="c10d")]


def record(rank: int, params: dict | None = None, **changes) -> dict:
    """One rank's record after a right parallelize and three right steps (values from the dense run)."""
    params = params or {name: entry(name, rank) for name in NAMES}
    ref = reference()
    group = rank // TP
    logits = {"kind": "Tensor", "dtensor": False, "shape": list(ref["logits"][group].shape),
              "local_shape": list(ref["logits"][group].shape), "local": ref["logits"][group].clone()}
    steps = [{"events": step_events(rank), "loss": 1.0,
              "locals": {n: expected_local(state[n], params[n]).clone() for n in NAMES}}
             for state in ref["states"]]
    out = {"mesh": mesh(), "device_type": "cpu", "params": params, "setup_events": [], "error": None,
           "parallelize_error": None, "returned": None, "output": logits, "steps": steps,
           "norms": {"layers.0.attention_norm": norm_input(rank)}}
    out.update(changes)
    return out


def records(**changes) -> list[dict]:
    return [record(rank, **changes) for rank in range(WORLD)]


def run_all(observations: list[dict]) -> dict:
    g = grading()
    v.check_mesh(g, observations, WORLD, TP)
    v.check_tp_placements(g, observations, WORLD, TP, NAMES)
    v.check_dp_shards(g, observations, WORLD, TP, SHAPES)
    v.check_sequence_parallel(g, observations, WORLD, TP, rank_side.SEQ, NAMES)
    v.check_subgroups(g, observations, WORLD, TP)
    v.check_units(g, observations, WORLD, TP, LAYERS)
    v.check_forward_gathers(g, observations, WORLD, TP, LAYERS)
    if v.check_training_error(g, observations, WORLD):
        v.check_matches_dense(g, observations, reference(), WORLD, TP)
    return verdicts(g)


# --- the model, the data, the placements -------------------------------------------------------------


def test_each_data_parallel_group_gets_its_own_batch():
    """Else a mesh whose groups are transposed would train on the same numbers and pass matches-dense."""
    (a, ta), (b, _) = rank_side.make_batch(0, 0), rank_side.make_batch(0, 1)
    assert not torch.equal(a, b) and torch.equal(a[:, 1:], ta[:, :-1])
    ref = reference()
    assert not torch.allclose(ref["logits"][0], ref["logits"][1])


def test_the_heads_and_sequence_divide_by_the_tensor_parallel_size():
    assert rank_side.SEQ % TP == 0 and all(shape[0] % TP == 0 for name, shape in SHAPES.items()
                                           if name.endswith(v.COLWISE))


def test_groups_are_rows_and_columns_of_the_mesh():
    assert v.groups_of(0, 4, 2) == ([0, 1], [0, 2])
    assert v.groups_of(3, 4, 2) == ([2, 3], [1, 3])
    assert v.groups_of(1, 2, 2) == ([0, 1], [1])


def test_a_strided_shard_is_read_as_fsdp_lays_it_over_a_tensor_parallel_split():
    """Tensor parallelism splits dim 0 over "tp" first; FSDP then splits each rank's part over "dp". Rank
    (d, t) holds elements t*4 + d*2 and t*4 + d*2 + 1 of 8, shown as (_StridedShard(0, sf=2), Shard(0))."""
    full = torch.arange(8.0)
    for d in range(2):
        for t in range(2):
            placed = {"dtensor": True, "placements": ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
                      "mesh_shape": [2, 2], "coord": [d, t]}
            assert dtensors.expected_local(full, placed).tolist() == [t * 4 + d * 2, t * 4 + d * 2 + 1]
    replicated = {"dtensor": True, "placements": ["Shard(dim=0)", "Replicate()"], "mesh_shape": [2, 2], "coord": [1, 0]}
    assert dtensors.expected_local(full, replicated).tolist() == [4, 5, 6, 7]
    partial = {"dtensor": True, "placements": ["Partial(sum)"], "mesh_shape": [2], "coord": [0]}
    assert dtensors.expected_local(full, partial) is None


def test_placements_parse():
    assert dtensors.parse("Shard(dim=1)") == ("shard", 1)
    assert dtensors.parse("_StridedShard(dim=0, sf=2)") == ("strided", 0, 2)
    assert dtensors.parse("Replicate()") == ("replicate",)
    assert dtensors.parse("Partial(sum)")[0] == "other"


# --- each verdict, right and wrong -------------------------------------------------------------------------


def test_a_right_answers_records_pass_every_check():
    assert {k: s for k, (s, _) in run_all(records()).items()} == {c: "pass" for c in v.CHECKS}


@pytest.mark.parametrize("wrong, says", [
    (mesh(names=("tp", "dp")), "dimensions are swapped"),
    (mesh(shape=(1, 4), layout=((0, 1, 2, 3),)), "it is (2, 2)"),
    (mesh(layout=((0, 2), (1, 3))), "tensor-parallel groups are [0, 2], [1, 3]"),
    ({"type": "DeviceMesh", "device_type": "cpu", "shape": [4], "names": ["dp"], "layout": [0, 1, 2, 3]}, "1-D"),
    (mesh(names=("data", "model")), "named"),
])
def test_a_wrong_mesh_fails_and_says_what_is_wrong(wrong, says):
    got = run_all(records(mesh=wrong))
    assert got["mesh"][0] == "fail" and says in got["mesh"][1], got["mesh"]


def test_mesh_sizes_swapped_are_named_so():
    swapped = mesh(shape=(2, 4), layout=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert "the sizes are swapped" in v.mesh_problem(swapped, 8, 2, "cpu")
    right = mesh(shape=(4, 2), layout=((0, 1), (2, 3), (4, 5), (6, 7)))
    assert v.mesh_problem(right, 8, 2, "cpu") is None
    assert "device type" in v.mesh_problem(dict(right, device_type="cuda"), 8, 2, "cpu")


def test_colwise_and_rowwise_swapped_fail_tp_placements_naming_the_swap():
    params = {name: entry(name, 0) for name in NAMES}
    name = "layers.0.attention.wq.weight"
    params[name] = entry(name, 0, ["Shard(dim=0)", "Shard(dim=1)"])
    got = run_all([record(0, params)] + [record(r) for r in range(1, WORLD)])
    assert got["tp-placements"][0] == "fail" and "swapped ColwiseParallel and RowwiseParallel" in got["tp-placements"][1]
    assert "rank 0" in got["tp-placements"][1] and name in got["tp-placements"][1]


def test_a_linear_the_plan_left_out_fails_tp_placements():
    params = {name: entry(name, 1) for name in NAMES}
    name = "output.weight"
    params[name] = entry(name, 1, ["Shard(dim=0)"], names=("dp",), shape=(DP,))
    got = run_all([record(0)] + [record(1, params)] + [record(r) for r in range(2, WORLD)])
    assert got["tp-placements"][0] == "fail" and "never split it over \"tp\"" in got["tp-placements"][1]


def test_parameters_fully_shard_never_saw_fail_dp_shards():
    params = {name: plain(name) if name.startswith("norm") else entry(name, 0) for name in NAMES}
    got = run_all([record(0, params)] + [record(r) for r in range(1, WORLD)])
    assert got["dp-shards"][0] == "fail" and "not sharded over \"dp\"" in got["dp-shards"][1]


def test_meshes_swapped_where_used_are_named_in_the_message():
    params = {name: entry(name, 0, ["Shard(dim=0)", "Shard(dim=0)"], names=("tp", "dp")) for name in NAMES}
    got = run_all([record(0, params)] + [record(r) for r in range(1, WORLD)])
    assert got["tp-placements"][0] == "fail" and "swapped where they are used" in got["tp-placements"][1]


def test_a_norm_weight_split_or_run_on_the_whole_sequence_fails_sequence_parallel():
    params = {name: entry(name, 0) for name in NAMES}
    name = "layers.1.ffn_norm.weight"
    params[name] = entry(name, 0, ["Shard(dim=0)"], names=("dp",), shape=(DP,))
    got = run_all([record(0, params)] + [record(r) for r in range(1, WORLD)])
    assert got["sequence-parallel"][0] == "fail" and "not replicated over \"tp\"" in got["sequence-parallel"][1]
    whole = {"layers.0.attention_norm": norm_input(2, length=rank_side.SEQ)}
    got = run_all([record(r) if r != 2 else record(2, norms=whole) for r in range(WORLD)])
    assert got["sequence-parallel"][0] == "fail" and "(the whole sequence)" in got["sequence-parallel"][1]
    assert "rank 2" in got["sequence-parallel"][1]


def test_collectives_outside_the_subgroups_fail_and_name_the_group():
    observations = records()
    observations[1]["steps"][1]["events"].append(event("all_reduce", [0, 1, 2, 3], via="c10d"))
    got = run_all(observations)
    assert got["subgroups"][0] == "fail" and "the whole world" in got["subgroups"][1]
    assert "rank 1, in step 2" in got["subgroups"][1]


def test_tensor_parallel_traffic_on_the_data_parallel_group_fails_subgroups():
    observations = records()
    for rank, obs in enumerate(observations):
        tp, dp = v.groups_of(rank, WORLD, TP)
        obs["steps"][0]["events"] = [event("all_gather_into_tensor", dp), event("reduce_scatter_tensor", tp, "c10d")]
    got = run_all(observations)
    assert got["subgroups"][0] == "fail" and "swapped" in got["subgroups"][1]


def test_a_group_training_on_another_groups_batch_fails_matches_dense():
    """The logits of rank 2 (group 1) are group 0's: what a transposed mesh gives."""
    observations = records()
    observations[2]["output"] = dict(observations[0]["output"])
    got = run_all(observations)
    assert got["matches-dense"][0] == "fail" and "rank 2: the first forward's logits" in got["matches-dense"][1]


def test_a_step_that_moved_a_parameter_differently_fails_matches_dense():
    observations = records()
    name = "layers.2.feed_forward.w2.weight"
    observations[3]["steps"][1]["locals"][name] = observations[3]["steps"][1]["locals"][name] * 1.05
    got = run_all(observations)
    assert got["matches-dense"][0] == "fail" and "after step 2, rank 3" in got["matches-dense"][1]
    assert name in got["matches-dense"][1]


def test_an_exception_in_training_is_the_verdict_of_matches_dense_naming_the_cause_not_a_peer():
    observations = records()
    observations[0]["error"] = "RuntimeError: Connection closed by peer"
    observations[3]["error"] = "RuntimeError: shape mismatch"
    observations[3]["steps"] = observations[3]["steps"][:1]
    got = run_all(observations)
    assert got["matches-dense"][0] == "fail" and got["matches-dense"][1].startswith("rank 3: step 2 raised")


def test_parallelize_raising_in_fully_shard_is_recorded_on_dp_shards_and_explained():
    observations = [{"parallelize_error": {"error": "ValueError: Cannot distribute a DTensor with device mesh",
                                           "stage": "parallelize_module", "line": "line 9: apply_tp(model)"}}] * WORLD
    g = grading()
    assert v.check_parallelize(g, observations, WORLD) is False
    got = verdicts(g)
    assert got["tp-placements"][0] == "fail" and "fully_shard ran first" in got["tp-placements"][1]
    assert got["matches-dense"][0] == "not-checked"


def with_steps(**kwargs) -> list[dict]:
    """Every rank's record with each step's collectives made by step_events(rank, **kwargs)."""
    out = records()
    for rank, obs in enumerate(out):
        for step in obs["steps"]:
            step["events"] = step_events(rank, **kwargs)
    return out


def test_the_root_alone_sharded_fails_block_units_with_one_gather_of_the_whole_model():
    """pytorch/examples' fsdp_tp_example.py: one fully_shard on the root, over "dp"."""
    got = run_all(with_steps(units=[37312]))
    status, message = got["block-units"]
    assert status == "fail" and "one all-gather of 37312 bytes among its data-parallel group [0, 2]" in message
    assert "in one FSDP unit" in message and "fully_shard each block first" in message
    assert got["dp-shards"][0] == got["gathers-per-forward"][0] == got["matches-dense"][0] == "pass"
    status, message = run_all(with_steps(units=[6208] + [3456] * 9))["block-units"]
    assert status == "fail" and "10 all-gathers" in message and "not each layer inside it" in message


def test_a_plan_without_prepare_module_input_gathers_each_input_again_and_fails():
    """wq, wk and wv each gather the norm's sequence-split output: 4 per block, 14 in all, where 8 do."""
    assert v.most_forward_gathers(LAYERS) == 8
    got = run_all(with_steps(gathers_per_block=4))
    status, message = got["gathers-per-forward"]
    assert status == "fail" and "made 14 all-gathers of activations among its tensor-parallel group [0, 1]" in message
    assert "8 at most" in message and "PrepareModuleInput" in message
    assert got["matches-dense"][0] == got["block-units"][0] == "pass"
    # The logits left sharded for loss_parallel (torchtitan): one gather fewer, fine.
    assert run_all(with_steps(gathers_per_block=2))["gathers-per-forward"] == ("pass", "")
