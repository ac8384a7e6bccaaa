"""Exercise 31's model, replay and verdicts, from hand-made records (no processes started).

Each verdict is shown passing on the record a right answer leaves and failing on a wrong one.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from grader.rank.drivers import ex31_fsdp2 as rank_side
from grader.checks.ex31_fsdp2 import reference as ref
from grader.checks.ex31_fsdp2 import verdicts as v
from grader.rank.drivers.shared.stub_models import FusedBlock, Transformer, lm_loss
from grading_helpers import grading_for, verdicts


grading = grading_for("31")


@functools.cache
def replay_of(world_size: int) -> dict:
    """The replay, computed once per world size (the verdicts only read it)."""
    return ref.reference_run(world_size)


def _params(world_size: int, *, plain=(), placement="Shard(dim=0)", dtype="float32") -> list[dict]:
    """What the driver records of the parameters after a shard_model (by default a right one);
    ``placement`` applies to the matrices, the norms' weights stay Shard(dim=0)."""
    out = []
    for name, p in rank_side.build_model().named_parameters():
        entry = {"name": name, "kind": "DTensor", "dtype": dtype, "shape": list(p.shape), "dtensor": True,
                 "placements": [placement if p.dim() == 2 else "Shard(dim=0)"], "mesh": [world_size]}
        if name in plain:
            entry.update(kind="Parameter", dtensor=False)
            del entry["placements"], entry["mesh"]
        else:
            entry["local_shape"] = list(v.local_part(p, entry, 0, world_size).shape)
        out.append(entry)
    return out


def _shards(state: dict, params: list[dict], rank: int, world_size: int) -> dict:
    named = {p["name"]: p for p in params}
    return {k: v.local_part(t, named[k], rank, world_size).clone() for k, t in state.items()}


def _records(world_size: int, states: list[dict] | None = None, params=None, events=None) -> list[dict]:
    """Every rank's record of a run whose parameters followed ``states`` (the replay's by default)."""
    replay = replay_of(world_size)
    states = replay["states"] if states is None else states
    params = params or _params(world_size)
    out = []
    for rank in range(world_size):
        loss = {"type": "float", "value": replay["losses"][0][rank]}
        steps = [{"events": events or _events(world_size), "loss": dict(loss),
                  "shards": _shards(state, params, rank, world_size)} for state in states]
        out.append({"params": params, "initial": _shards(replay["initial"], params, rank, world_size),
                    "steps": steps, "error": None, "state": None})
    final = {k: t.clone() for k, t in states[-1].items()}
    out[0]["state"] = {"keys": list(final), "tensors": final, "types": {k: "Tensor" for k in final}, "error": None}
    return out


def _sizes(world_size: int, params=None) -> dict:
    return v.unit_sizes(params or _params(world_size), rank_side.build_model(), world_size)


def _gather(numel: int, dtype: str = "bfloat16") -> dict:
    itemsize = 2 if dtype == "bfloat16" else 4
    return {"op": "all_gather_single", "bytes": numel * itemsize, "dtype": dtype, "itemsize": itemsize}


def _reduce(numel: int, dtype: str = "float32") -> dict:
    itemsize = 2 if dtype == "bfloat16" else 4
    return {"op": "reduce_scatter_single", "bytes": numel * itemsize, "dtype": dtype, "itemsize": itemsize}


def _events(world_size: int, forward: list[int] | None = None, gather_dtype="bfloat16",
            reduce_dtype="float32") -> list[dict]:
    """One step's events: the root and each block gathered in forward, again in backward, reduced."""
    sizes = _sizes(world_size)
    units = [sizes["root"], *sizes["blocks"]]
    forward = units if forward is None else forward
    backward = [_gather(n, gather_dtype) for n in reversed(sizes["blocks"])]
    reduces = [_reduce(n // world_size, reduce_dtype) for n in reversed(units)]
    return ([_gather(n, gather_dtype) for n in forward] + [{"op": "mark", "what": "forward-returned"}]
            + backward + reduces + [{"op": "all_reduce", "bytes": 4}])


# --- the model, the batches, the replay --------------------------------------------------------------


def test_the_ranks_batches_differ_and_targets_are_the_next_tokens():
    (a, ta), (b, _) = rank_side.make_batch(0, 0), rank_side.make_batch(0, 1)
    assert not torch.equal(a, b) and torch.equal(a[:, 1:], ta[:, :-1])


def test_clipping_acts_at_every_step_and_each_ranks_shards_alone_need_it_too():
    """Else a missing or per-rank clip would change nothing the checks can see."""
    for world_size in (2, 3, 4):
        replay = replay_of(world_size)
        assert min(replay["norms"]) > 2 * rank_side.MAX_NORM, (world_size, replay["norms"])
        assert min(replay["norms"]) / math.sqrt(world_size) > rank_side.MAX_NORM


def test_the_replay_is_torch_clipping_and_sgd_on_the_averaged_bfloat16_gradients():
    world_size = 2
    model = rank_side.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=rank_side.LR)
    for step in range(rank_side.STEPS):
        grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for rank in range(world_size):
            low = Transformer(block=FusedBlock).to(torch.bfloat16)
            low.load_state_dict(model.state_dict())
            tokens, targets = rank_side.make_batch(step, rank)
            lm_loss(low(tokens), targets).backward()
            for n, p in low.named_parameters():
                grads[n] += p.grad.float() / world_size
        for n, p in model.named_parameters():
            p.grad = grads[n]
        torch.nn.utils.clip_grad_norm_(model.parameters(), rank_side.MAX_NORM)
        optimizer.step()
    replay = ref.reference_run(world_size)["states"][-1]
    for name, value in model.state_dict().items():
        assert torch.allclose(value, replay[name], rtol=0, atol=1e-6), name


def test_block_and_root_units_have_sizes_no_other_unit_has():
    for world_size in (1, 2, 3, 4):
        sizes = _sizes(world_size)
        assert len(set(sizes["blocks"])) == 1 and sizes["root"] not in sizes["blocks"]
        assert sum(sizes["blocks"]) + sizes["root"] not in sizes["blocks"]
    assert _sizes(3)["root"] == 96 * 32 + 33 + 96 * 32  # the final norm's 32 rows padded to 33


def test_local_part_follows_torch_chunk():
    full = torch.arange(32 * 2.0).reshape(32, 2)
    entry = {"dtensor": True, "placements": ["Shard(dim=0)"]}
    assert [v.local_part(full, entry, r, 3).shape[0] for r in range(3)] == [11, 11, 10]
    assert v.local_part(full, {"dtensor": False}, 1, 3).shape == full.shape


# --- placements ---------------------------------------------------------------------------------------


def test_dtensors_sharded_on_dim0_pass():
    g = grading()
    v.check_placements(g, [{"params": _params(2)}] * 2, 2, rank_side.build_model())
    got = verdicts(g)
    assert got["dtensor-shards"][0] == "pass" and got["root-unit"][0] == "pass" and "mixed-precision" not in got


def test_a_root_never_sharded_fails_root_unit_and_names_its_parameters():
    root = ("tok_embeddings.weight", "norm.weight", "output.weight")
    g = grading()
    v.check_placements(g, [{"params": _params(2, plain=root)}] * 2, 2, rank_side.build_model())
    status, message = verdicts(g)["root-unit"]
    assert status == "fail" and "'norm.weight'" in message and "never passed to fully_shard" in message
    assert verdicts(g)["dtensor-shards"][0] == "fail"


def test_another_placement_fails():
    g = grading()
    v.check_placements(g, [{"params": _params(2, placement="Shard(dim=1)")}], 2, rank_side.build_model())
    status, message = verdicts(g)["dtensor-shards"]
    assert status == "fail" and "Shard(dim=1)" in message


def test_a_wrong_local_shape_fails():
    params = _params(3)
    params[0]["local_shape"] = [96, 32]
    g = grading(3)
    v.check_placements(g, [{"params": params}], 3, rank_side.build_model())
    status, message = verdicts(g)["dtensor-shards"]
    assert status == "fail" and "[32, 32]" in message


def test_bfloat16_sharded_parameters_fail_mixed_precision():
    g = grading()
    v.check_placements(g, [{"params": _params(2, dtype="bfloat16")}], 2, rank_side.build_model())
    status, message = verdicts(g)["mixed-precision"]
    assert status == "fail" and "the sharded parameters are bfloat16" in message


# --- units and dtypes on the wire ----------------------------------------------------------------------


def _units(world_size: int, events: list[dict]) -> dict:
    g = grading(world_size)
    v.check_units(g, [{"steps": [{"events": events}]}], world_size, _sizes(world_size))
    return verdicts(g)


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_gather_per_block_and_one_for_the_root_pass(world_size):
    got = _units(world_size, _events(world_size))
    assert got["block-units"][0] == "pass" and got["root-unit"][0] == "pass"


def test_the_last_layers_as_a_unit_of_their_own_pass():
    """torchtitan shards the final norm and the head together, then the root: the root's parameters in two."""
    sizes = _sizes(2)
    split = [96 * 32, sizes["root"] - 96 * 32]
    got = _units(2, _events(2, forward=[split[0], *sizes["blocks"], split[1]]))
    assert got["block-units"][0] == "pass" and got["root-unit"][0] == "pass"


def test_one_gather_of_the_whole_model_fails_block_units():
    sizes = _sizes(2)
    got = _units(2, _events(2, forward=[sum(sizes["blocks"]) + sizes["root"]]))
    status, message = got["block-units"]
    assert status == "fail" and "the whole model" in message
    assert got["root-unit"][0] == "not-checked"


def test_gathers_of_each_layer_inside_the_blocks_fail_block_units():
    model = rank_side.build_model()
    per_layer = [p.numel() for block in model.layers for p in block.parameters()]
    got = _units(2, _events(2, forward=[_sizes(2)["root"], *per_layer]))
    status, message = got["block-units"]
    assert status == "fail" and "each smaller than a block" in message


def test_no_gather_of_the_root_fails_root_unit():
    got = _units(2, _events(2, forward=_sizes(2)["blocks"]))
    status, message = got["root-unit"]
    assert got["block-units"][0] == "pass" and status == "fail" and "no other all-gather" in message


def _dtypes(world_size: int, events: list[dict]) -> dict:
    g = grading(world_size)
    v.check_dtypes(g, [{"steps": [{"events": events}]}], world_size)
    return verdicts(g)


def test_bfloat16_gathers_and_float32_reductions_pass():
    got = _dtypes(2, _events(2))
    assert got["mixed-precision"][0] == "pass" and got["fp32-reduce"][0] == "pass"


def test_float32_gathers_fail_mixed_precision():
    status, message = _dtypes(2, _events(2, gather_dtype="float32"))["mixed-precision"]
    assert status == "fail" and "all-gathered parameters in float32" in message


def test_bfloat16_reductions_fail_fp32_reduce():
    status, message = _dtypes(2, _events(2, reduce_dtype="bfloat16"))["fp32-reduce"]
    assert status == "fail" and "ran in bfloat16" in message and "reduce_dtype" in message


def test_no_reduction_at_all_fails_fp32_reduce():
    events = [e for e in _events(2) if e["op"] != "reduce_scatter_single"]
    status, message = _dtypes(2, events)["fp32-reduce"]
    assert status == "fail" and "no reduce-scatter" in message


# --- clipping, training, loss, state dict --------------------------------------------------------------


def _scaled_steps(world_size: int, factor_of_rank) -> list[dict]:
    """Each rank's shards moved as the replay's step 1 moved them, times ``factor_of_rank(rank)``."""
    replay = replay_of(world_size)
    params = _params(world_size)
    records = _records(world_size, states=replay["states"][:1], params=params)
    for rank, record in enumerate(records):
        before = record["initial"]
        after = record["steps"][0]["shards"]
        record["steps"][0]["shards"] = {k: before[k] + factor_of_rank(rank, k) * (after[k] - before[k]) for k in after}
    return records


def _clip(world_size: int, records: list[dict]) -> tuple[str, str]:
    g = grading(world_size)
    v.check_clipping(g, records, replay_of(world_size), world_size)
    return verdicts(g)["global-clip"]


def test_an_update_of_lr_times_max_norm_passes():
    assert _clip(2, _scaled_steps(2, lambda rank, name: 1.0))[0] == "pass"


def test_an_unclipped_update_fails():
    world_size = 2
    raw = replay_of(world_size)["norms"][0]
    status, message = _clip(world_size, _scaled_steps(world_size, lambda rank, name: raw / rank_side.MAX_NORM))
    assert status == "fail" and "nothing clipped it" in message


def test_each_rank_clipping_its_own_shards_fails_and_says_so():
    world_size = 2
    records = _scaled_steps(world_size, lambda rank, name: 1.0)
    own = v.update_norms(records, 0, rank_side.LR)[1]
    records = _scaled_steps(world_size, lambda rank, name: rank_side.MAX_NORM / own[rank])
    status, message = _clip(world_size, records)
    assert status == "fail" and "each rank clipped with the norm of its own shards" in message


def _training(world_size: int, records: list[dict]) -> tuple[str, str]:
    g = grading(world_size)
    v.check_training(g, records, replay_of(world_size), world_size)
    return verdicts(g)["matches-single-process"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_replays_shards_pass(world_size):
    assert _training(world_size, _records(world_size))[0] == "pass"


def test_updates_off_by_a_bfloat16_rounding_pass_and_off_by_a_tenth_fail():
    for factor, expected in ((1.004, "pass"), (1.1, "fail")):
        records = _scaled_steps(2, lambda rank, name, factor=factor: factor if name == "output.weight" else 1.0)
        status, message = _training(2, records)
        assert status == expected, message
    assert "'output.weight'" in message and "of the largest change" in message


def _loss(records: list[dict]) -> tuple[str, str]:
    g = grading(2)
    v.check_loss(g, records, replay_of(2), 2)
    return verdicts(g)["returns-loss"]


def test_the_ranks_own_loss_or_the_mean_pass():
    records = _records(2)
    assert _loss(records)[0] == "pass"
    mean = sum(replay_of(2)["losses"][0]) / 2
    for record in records:
        record["steps"][0]["loss"]["value"] = mean
    assert _loss(records)[0] == "pass"


def test_a_tensor_or_another_value_fails():
    records = _records(2)
    records[1]["steps"][2]["loss"] = {"type": "Tensor", "value": 4.7}
    status, message = _loss(records)
    assert status == "fail" and "returned a Tensor" in message
    records = _records(2)
    records[0]["steps"][0]["loss"]["value"] *= 2
    status, message = _loss(records)
    assert status == "fail" and "step 1, rank 0" in message


def _state(records: list[dict]) -> tuple[str, str]:
    g = grading(2)
    v.check_state_dict(g, records, replay_of(2), 2)
    return verdicts(g)["full-state-dict"]


def test_the_shards_put_together_pass():
    assert _state(_records(2))[0] == "pass"


def test_a_bfloat16_or_renamed_or_stale_state_dict_fails():
    records = _records(2)
    state = records[0]["state"]
    state["tensors"]["output.weight"] = state["tensors"]["output.weight"].to(torch.bfloat16)
    status, message = _state(records)
    assert status == "fail" and "dtype bfloat16" in message
    records = _records(2)
    records[0]["state"]["keys"] = ["module." + k for k in records[0]["state"]["keys"]]
    status, message = _state(records)
    assert status == "fail" and "'module.tok_embeddings.weight'" in message
    records = _records(2)
    records[0]["state"]["tensors"]["norm.weight"] = records[0]["state"]["tensors"]["norm.weight"] + 1
    status, message = _state(records)
    assert status == "fail" and "'norm.weight' is not the ranks' shards put together" in message


def test_an_exception_in_train_step_fails_training_names_the_cause_and_leaves_the_rest_undecided():
    g = grading()
    records = [{"error": "RuntimeError: Connection closed by peer", "steps": []},
               {"error": "RuntimeError: expected m1 and m2 to have the same dtype", "steps": []}]
    assert not v.check_no_error(g, records, 2)
    got = verdicts(g)
    assert got["matches-single-process"][0] == "fail" and "rank 1" in got["matches-single-process"][1]
    assert got["global-clip"][0] == "not-checked"
    g = grading()
    assert v.check_no_error(g, _records(2), 2)


def test_train_step_raising_stops_the_grading_with_its_line_not_a_hint_for_another_cause():
    """A dtype error in the learner's train_step is the run's failure: shown with the learner's frame and the
    exception, not as matches-single-process with a hint about clearing gradients."""
    from grader import results
    from grader.report import problem_text

    record = {"type": "RuntimeError", "message": "expected m1 and m2 to have the same dtype, but got: BFloat16 != float",
              "traceback": "Traceback ...\nRuntimeError: expected m1 and m2 to have the same dtype", "phase": "run",
              "where": {"line": 57, "function": "train_step", "code": "logits = model(tokens).float() @ head"},
              "raised_in_learner": False}
    records = [{"error": "RuntimeError: Connection closed by peer", "steps": [],
                "error_record": dict(record, message="Connection closed by peer", where=None)},
               {"error": "RuntimeError: expected m1 and m2 ...", "steps": [], "error_record": record}]
    g = grading()
    with pytest.raises(g.Stopped) as stopped:
        v.check_no_error(g, records, 2)
    problem = stopped.value.problem
    assert (problem.kind, problem.rank, problem.where.line) == (results.RAISED, 1, 57)
    text = problem_text(problem)
    assert text.startswith("rank 1 raised RuntimeError: expected m1 and m2 to have the same dtype")
    assert "line 57, in train_step: `logits = model(tokens).float() @ head`" in text
    assert "(train_step, step 1)" in text and "rank 0 could not finish without it" in text
    got = {c.id: c.status for c in g.results("stopped")}
    assert got["matches-single-process"] == got["mixed-precision"] == "error"  # not run, neither failed nor hinted
