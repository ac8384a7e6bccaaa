"""Exercise 35's verdicts, from hand-made records (no processes started), and the grader's own data: the recipe
as the reference computes it, and tensors on which every faithful way of computing t * scale casts alike."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from grading_helpers import grading_for
from grading_helpers import verdicts as decided

from grader.rank.drivers import ex35_float8 as ex_rank
from grader.checks.ex35_float8 import reference, verdicts
from grader.grading import Grading

E4M3, E5M2 = ex_rank.E4M3, ex_rank.E5M2
SHARD = ex_rank.GATHER_ROWS * ex_rank.GATHER_COLS
grading = grading_for("35")


def statuses(g: Grading) -> dict:
    return {check: status for check, (status, _) in decided(g).items()}


def messages(g: Grading) -> dict:
    return {check: message for check, (_, message) in decided(g).items()}


def strided(t: torch.Tensor, column_major: bool) -> tuple[torch.Tensor, list[int]]:
    """A matrix and the strides a rank records for it, row-major or column-major."""
    return t.clone(), ([1, t.shape[0]] if column_major else [t.shape[1], 1])


def scaled(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> dict:
    """The record of one _scaled_mm as a right layer makes it: a row-major, b column-major, reciprocal scales."""
    a, a_stride = strided(a, False)
    b, b_stride = strided(b, True)
    return {"op": "_scaled_mm", "shapes": [list(a.shape), list(b.shape)], "dtypes": [], "a": a, "a_stride": a_stride,
            "b": b, "b_stride": b_stride, "scale_a": a_scale.reciprocal(), "scale_b": b_scale.reciprocal(),
            "bias": False, "scale_result": False, "out_dtype": "float32"}


def right_call(call: str) -> dict:
    want = reference.expected_call(call)
    (x8, sx), (w8, sw), (g8, sg) = want["input"], want["weight"], want["grad"]
    t = want["tensors"]
    params = {"weight": t["weight"].clone(), **({"bias": t["bias"].clone()} if t["bias"] is not None else {})}
    grads = {"input": want["grads"]["input"][0].float(), "weight": want["grads"]["weight"][0].float(),
             "bias": want["grads"]["bias"][0].float() if want["grads"]["bias"] is not None else None}
    return {"before": params, "after": copy.deepcopy(params), "backward_ran": True,
            "forward": [scaled(x8, sx, w8.t(), sw)],
            "backward": [scaled(g8, sg, w8, sw), scaled(g8.t(), sg, x8, sx)],
            "output": want["output"][0].float(), "grads": grads}


def right_module(layer: str) -> dict:
    linear = ex_rank.make_linear(layer)
    values = {name: p.detach().clone() for name, p in linear.named_parameters()}
    return {"type": "Float8Linear", "is_module": True,
            "parameters": [{"name": name, "dtype": "float32", "shape": list(v.shape), "is_parameter": True,
                            "requires_grad": True} for name, v in values.items()],
            "values": values, "state_dict": copy.deepcopy(values)}


@functools.cache
def _right_record() -> dict:
    ref = reference.training_reference()
    model = ex_rank.make_mlp()
    x, target = ex_rank.training_data()
    params, state = list(model.parameters()), []
    for step in range(1, ex_rank.STEPS + 1):
        for p in params:
            p.grad = None
        ex_rank.loss_fn(model(x), target).backward()
        ex_rank.adamw_step(params, state, step)
    return {"modules": {layer: right_module(layer) for layer in ("plain", "zero-weight", "no-bias")},
            "calls": {call: right_call(call) for call in ex_rank.CALLS},
            "training": {"losses": list(ref["losses"]),
                         "params": {name: p.detach().clone() for name, p in model.named_parameters()},
                         "error": None}}


def right_record() -> dict:
    return copy.deepcopy(_right_record())


LAYER = (verdicts.check_products, verdicts.check_formats, verdicts.check_scales, verdicts.check_gpu_ready,
         verdicts.check_output, verdicts.check_grads, verdicts.check_master, verdicts.check_training)


def grade_layer(record: dict) -> Grading:
    g = grading()
    for check in LAYER:
        check(g, record)
    return g


# --- the grader's data ---------------------------------------------------------------------------


def test_no_value_the_grader_casts_lies_near_a_float8_rounding_boundary():
    """x * scale in float32, in float64, or x / (1 / scale) cast alike everywhere, so the byte-for-byte comparison
    judges the recipe, not one way of rounding it."""
    for call in ex_rank.CALLS:
        want = reference.expected_call(call)
        for role, dtype in reference.FORMATS.items():
            assert reference.borderline(want["tensors"][role], want[role][1], dtype) == 0, (call, role)
    for size in range(1, 17):  # --world-size N grades N and N + 1 ranks
        for scenario in ex_rank.GATHER_SCENARIOS:
            weight = ex_rank.gather_weight(scenario, size)
            assert reference.borderline(weight, reference.gather_expected(scenario, size)[1], E4M3) == 0


def test_the_borderline_count_sees_a_value_on_a_boundary():
    # 1.0625 lies halfway between E4M3's 1.0 and 1.125.
    assert reference.borderline(torch.tensor([1.0625, 1.0]), torch.tensor(1.0), E4M3) == 1


def test_the_reference_casts_as_torchao_does():
    t = torch.tensor([[0.5, -300.0], [2.0, 0.0]])
    t8, scale = reference.cast(t, E4M3)
    assert float(scale) == pytest.approx(448 / 300)
    assert float(t8.float()[0, 1]) == -448.0
    zero8, zero_scale = reference.cast(torch.zeros(3), E5M2)
    assert float(zero_scale) == pytest.approx(57344 / 1e-12, rel=1e-6) and torch.equal(zero8.float(), torch.zeros(3))
    # Saturation: past E5M2's largest value the cast clamps, where torch's own cast gives inf.
    over = reference.to_float8(torch.tensor([70000.0]), torch.tensor(1.0), E5M2)
    assert float(over.float()) == 57344.0 and torch.isinf(torch.tensor([70000.0]).to(E5M2).float()).all()


def test_the_outliers_are_where_the_statement_says():
    t = reference.call_tensors("outlier")
    assert float(t["input"].abs().max()) == 300.0 and float(t["weight"].abs().max()) == 2.0
    assert float(t["grad"].abs().max()) == 0.5
    assert float(reference.call_tensors("zero-weight")["weight"].abs().max()) == 0.0


# --- the layer ----------------------------------------------------------------------------------


def test_a_right_record_passes_every_check_of_the_layer():
    assert set(statuses(grade_layer(right_record())).values()) == {"pass"}


def test_a_float32_product_fails_scaled_mm():
    record = right_record()
    record["calls"]["plain"]["forward"] = [{"op": "mm", "shapes": [[16, 64], [64, 48]],
                                            "dtypes": ["float32", "float32"]}]
    g = grading()
    verdicts.check_products(g, record)
    assert statuses(g)["scaled-mm"] == "fail" and "a mm of [16, 64] x [64, 48]" in messages(g)["scaled-mm"]


def test_a_missing_backward_product_fails_scaled_mm():
    record = right_record()
    record["calls"]["no-bias"]["backward"].pop()
    g = grading()
    verdicts.check_products(g, record)
    assert "the weight's gradient" in messages(g)["scaled-mm"]


def test_a_call_that_raised_is_named():
    record = right_record()
    record["calls"]["outlier"]["error"] = "RuntimeError: boom (35_float8.py line 3)"
    g = grading()
    verdicts.check_products(g, record)
    assert "call 'outlier'" in messages(g)["scaled-mm"] and "boom" in messages(g)["scaled-mm"]
    assert verdicts.raised_in(record) is not None


def test_a_gradient_in_e4m3_fails_the_formats():
    record = right_record()
    event = record["calls"]["plain"]["backward"][0]
    event["a"] = event["a"].float().to(E4M3)
    g = grading()
    verdicts.check_formats(g, record)
    assert statuses(g)["float8-formats"] == "fail" and "float8_e5m2" in messages(g)["float8-formats"]


def test_a_nan_operand_fails_the_formats_and_names_the_epsilon():
    record = right_record()
    event = record["calls"]["zero-weight"]["forward"][0]
    event["b"] = torch.full_like(event["b"].float(), float("nan")).to(E4M3)
    g = grading()
    verdicts.check_formats(g, record)
    assert "1e-12" in messages(g)["float8-formats"]


def test_a_cast_with_a_stale_scale_is_named():
    record = right_record()
    x = reference.call_tensors("outlier")["input"]
    stale = reference.scale_of(reference.call_tensors("plain")["input"], E4M3)
    record["calls"]["outlier"]["forward"][0]["a"] = reference.to_float8(x, stale, E4M3)
    g = grading()
    verdicts.check_scales(g, record)
    said = messages(g)["scaled-from-amax"]
    assert statuses(g)["scaled-from-amax"] == "fail" and "previous call" in said and "amax is 300" in said


def test_the_scale_itself_in_place_of_its_reciprocal_is_named():
    record = right_record()
    event = record["calls"]["plain"]["forward"][0]
    event["scale_a"] = event["scale_a"].reciprocal()
    g = grading()
    verdicts.check_scales(g, record)
    assert "not its reciprocal" in messages(g)["scaled-from-amax"]


def test_a_scale_off_by_a_float32_rounding_passes():
    record = right_record()
    event = record["calls"]["plain"]["forward"][0]
    event["scale_a"] = torch.nextafter(event["scale_a"], torch.tensor(1.0))
    g = grading()
    verdicts.check_scales(g, record)
    assert statuses(g)["scaled-from-amax"] == "pass"


def test_layouts_a_gpu_refuses_fail_gpu_ready():
    for field, value, words in (("a_stride", [1, 48], "mat1"), ("b_stride", [64, 1], "mat2"), ("bias", True, "Bias")):
        record = right_record()
        record["calls"]["plain"]["backward"][1][field] = value
        g = grading()
        verdicts.check_gpu_ready(g, record)
        assert statuses(g)["gpu-ready"] == "fail" and words in messages(g)["gpu-ready"], field


def test_a_float64_scale_fails_gpu_ready():
    record = right_record()
    record["calls"]["plain"]["forward"][0]["scale_b"] = torch.tensor(0.5, dtype=torch.float64)
    g = grading()
    verdicts.check_gpu_ready(g, record)
    assert "float32 tensor of one element" in messages(g)["gpu-ready"]


def test_the_float32_product_is_recognised_in_a_wrong_output():
    record = right_record()
    t = reference.call_tensors("plain")
    record["calls"]["plain"]["output"] = (t["input"] @ t["weight"].t() + t["bias"]).reshape(2, 8, 48)
    g = grading()
    verdicts.check_output(g, record)
    assert "float32 product" in messages(g)["output-matches"]


def test_a_flattened_output_fails_with_its_shape():
    record = right_record()
    record["calls"]["plain"]["output"] = record["calls"]["plain"]["output"].reshape(16, 48)
    g = grading()
    verdicts.check_output(g, record)
    assert "shape [16, 48]" in messages(g)["output-matches"]


def test_an_output_not_a_tensor_fails_without_raising():
    record = right_record()
    record["calls"]["plain"]["output"] = "not a tensor"
    g = grading()
    verdicts.check_output(g, record)
    assert statuses(g)["output-matches"] == "fail"


def test_a_missing_gradient_fails_grads_match():
    record = right_record()
    record["calls"]["no-bias"]["grads"]["weight"] = None
    g = grading()
    verdicts.check_grads(g, record)
    assert "weight.grad is None" in messages(g)["grads-match"]


def test_a_gradient_off_by_a_float8_step_fails():
    record = right_record()
    grad = record["calls"]["plain"]["grads"]["weight"]
    grad[3, 5] *= 1 + 2 ** -4
    g = grading()
    verdicts.check_grads(g, record)
    assert statuses(g)["grads-match"] == "fail" and "weight.grad" in messages(g)["grads-match"]


def test_renamed_parameters_and_extra_buffers_fail_master_weights():
    record = right_record()
    module = record["modules"]["plain"]
    module["parameters"][0]["name"] = "linear.weight"
    g = grading()
    verdicts.check_master(g, record)
    assert "linear.weight" in messages(g)["master-weights"]
    record = right_record()
    record["modules"]["plain"]["state_dict"]["amax_history"] = torch.zeros(3)
    g = grading()
    verdicts.check_master(g, record)
    assert "amax_history" in messages(g)["master-weights"]


def test_a_state_dict_of_float8_copies_fails_master_weights():
    record = right_record()
    state = record["modules"]["plain"]["state_dict"]
    state["weight"] = state["weight"].to(E4M3)
    g = grading()
    verdicts.check_master(g, record)
    assert "state_dict" in messages(g)["master-weights"]


def test_the_linears_values_are_the_graders_own():
    """A layer that recorded other values for the linear cannot make its own values the expected ones."""
    record = right_record()
    for key in ("values", "state_dict"):
        record["modules"]["no-bias"][key]["weight"] = torch.zeros(ex_rank.OUT, ex_rank.IN)
    record["modules"]["no-bias"]["linear"] = {"weight": torch.zeros(ex_rank.OUT, ex_rank.IN)}
    g = grading()
    verdicts.check_master(g, record)
    assert statuses(g)["master-weights"] == "fail"


def test_malformed_module_records_fail_without_raising():
    for parameters, values in (([1, "x"], {}), ([{"name": "weight"}], []), (None, None)):
        record = right_record()
        record["modules"]["plain"]["parameters"] = parameters
        record["modules"]["plain"]["values"] = values
        g = grading()
        verdicts.check_master(g, record)
        assert statuses(g)["master-weights"] == "fail"


def test_a_float8_weight_parameter_fails_master_weights():
    record = right_record()
    record["modules"]["no-bias"]["parameters"][0]["dtype"] = "float8_e4m3fn"
    g = grading()
    verdicts.check_master(g, record)
    assert "float8_e4m3fn" in messages(g)["master-weights"]


def test_a_weight_changed_by_forward_fails_master_weights():
    record = right_record()
    record["calls"]["plain"]["after"]["weight"][0, 0] += 1e-3
    g = grading()
    verdicts.check_master(g, record)
    assert "changed during forward and backward" in messages(g)["master-weights"]


def test_training_off_by_more_than_an_eighth_fails_at_that_step():
    record = right_record()
    record["training"]["losses"][6] *= 1.2
    g = grading()
    verdicts.check_training(g, record)
    assert "step 7 of 20" in messages(g)["training-close"]


def test_training_within_an_eighth_passes():
    record = right_record()
    record["training"]["losses"] = [v * 1.1 for v in record["training"]["losses"]]
    g = grading()
    verdicts.check_training(g, record)
    assert statuses(g)["training-close"] == "pass"


def test_training_that_stopped_or_sent_nan_fails():
    record = right_record()
    record["training"]["losses"] = record["training"]["losses"][:5]
    record["training"]["error"] = "RuntimeError: oops"
    g = grading()
    verdicts.check_training(g, record)
    assert "after 5 step(s)" in messages(g)["training-close"]
    record = right_record()
    record["training"]["losses"][0] = float("nan")
    g = grading()
    verdicts.check_training(g, record)
    assert statuses(g)["training-close"] == "fail"
    record = right_record()
    record["training"]["params"]["0.weight"] = torch.zeros(3)
    g = grading()
    verdicts.check_training(g, record)
    assert "0.weight [128, 64]" in messages(g)["training-close"]


def test_the_final_weights_are_read_by_name_or_in_the_layers_own_order():
    record = right_record()
    params = record["training"]["params"]
    record["training"]["params"] = {name: params[name] for name in reversed(list(params))}  # bias before weight
    g = grading()
    verdicts.check_training(g, record)
    assert statuses(g)["training-close"] == "pass"
    record["training"]["params"] = {name.replace(".", ".linear.", 1): value for name, value in params.items()}
    g = grading()
    verdicts.check_training(g, record)
    assert statuses(g)["training-close"] == "pass"


def test_parameters_registered_bias_first_pass_master_weights():
    record = right_record()
    module = record["modules"]["plain"]
    module["parameters"].reverse()
    g = grading()
    verdicts.check_master(g, record)
    assert statuses(g)["master-weights"] == "pass"


def test_untrusted_shapes_of_records_fail_without_raising():
    for broken in ({}, {"calls": "x"}, {"calls": {"plain": {"forward": "x"}}}, {"modules": {"plain": 3}}):
        g = grading()
        for check in LAYER:
            check(g, broken)
        assert "pass" not in {statuses(g).get(k) for k in ("scaled-mm", "master-weights", "training-close")}


# --- the all-gather -------------------------------------------------------------------------------


def gather_run(scenario: str, size: int, weight=None, scale=None, events=None) -> dict:
    want, want_scale = reference.gather_expected(scenario, size)
    return {"returned": {"kind": "tuple", "items": [want.clone() if weight is None else weight,
                                                    want_scale.clone() if scale is None else scale]},
            "events": events if events is not None else [
                {"op": "allreduce_", "bytes": 4, "dtype": "float32"},
                {"op": "_allgather_base_", "bytes": SHARD, "dtype": "uint8"}],
            "members": list(range(size))}


def gather_observations(size: int, **changes) -> list[dict]:
    return [{scenario: gather_run(scenario, size, **changes) for scenario in ex_rank.GATHER_SCENARIOS}
            for _ in range(size)]


def test_right_gathers_pass():
    g = grading(3)
    observations = gather_observations(3)
    for obs in observations:
        obs["group"] = gather_run("plain", 2)
    observations[1]["group"] = gather_run("plain", 1)
    observations[1]["group"]["members"] = [1]
    for rank in (0, 2):
        observations[rank]["group"]["members"] = [0, 2]
    verdicts.check_gather(g, observations, 3)
    verdicts.check_gather_bytes(g, observations, 3)
    verdicts.check_gather_group(g, observations, 3)
    assert statuses(g) == {"gather-matches": "pass", "gather-bytes": "pass", "gather-group": "pass"}


def test_shards_cast_with_their_own_amax_are_named():
    whole = ex_rank.gather_weight("outlier", 2)
    rows = ex_rank.GATHER_ROWS
    own = torch.cat([reference.cast(whole[:rows], E4M3)[0], reference.cast(whole[rows:], E4M3)[0]])
    observations = gather_observations(2)
    observations[0]["outlier"]["returned"]["items"][0] = own
    g = grading(2)
    verdicts.check_gather(g, observations, 2)
    assert "own amax" in messages(g)["gather-matches"] and "rank 0" in messages(g)["gather-matches"]


def test_the_gathered_weights_outlier_is_negative():
    for size in (1, 2, 3, 4):
        whole = ex_rank.gather_weight("outlier", size)
        assert float(whole.min()) == ex_rank.GATHER_OUTLIER[1] < 0 and float(whole.max()) < -float(whole.min())


def test_an_amax_taken_without_abs_is_named_not_the_all_reduce():
    """Every rank all-reduced x.max() with MAX: one scale for the whole weight, the wrong one."""
    for scenario, size in (("outlier", 2), ("plain", 4)):
        signed, largest = reference.signed_amax_cast(scenario, size)
        observations = gather_observations(size)
        for obs in observations:
            obs[scenario] = gather_run(scenario, size, weight=signed)
        g = grading(size)
        verdicts.check_gather(g, observations, size)
        said = messages(g)["gather-matches"]
        assert statuses(g)["gather-matches"] == "fail" and f"its largest value ({largest:.4g})" in said
        assert "x.abs().max()" in said and "all-reduce the amax" not in said and "own amax" not in said


def test_a_float64_scale_fails_the_gather():
    want, scale = reference.gather_expected("plain", 2)
    g = grading(2)
    verdicts.check_gather(g, gather_observations(2, scale=scale.double()), 2)
    said = messages(g)["gather-matches"]
    assert statuses(g)["gather-matches"] == "fail" and "the scale returned is float64" in said and "float32" in said


def test_uint8_and_reciprocal_scales_are_named():
    want, scale = reference.gather_expected("plain", 2)
    g = grading(2)
    verdicts.check_gather(g, gather_observations(2, weight=want.view(torch.uint8)), 2)
    assert "view the gathered bytes back" in messages(g)["gather-matches"]
    g = grading(2)
    verdicts.check_gather(g, gather_observations(2, scale=scale.reciprocal()), 2)
    assert "reciprocal" in messages(g)["gather-matches"]


def test_gathering_float32_fails_the_bytes():
    events = [{"op": "allgather_", "bytes": 4 * SHARD, "dtype": "float32"}]
    g = grading(2)
    verdicts.check_gather_bytes(g, gather_observations(2, events=events), 2)
    assert "4 bytes per element" in messages(g)["gather-bytes"]


def test_a_whole_weight_all_reduced_fails_the_bytes():
    events = [{"op": "allreduce_", "bytes": 2 * SHARD, "dtype": "uint8"},
              {"op": "_allgather_base_", "bytes": SHARD, "dtype": "uint8"}]
    g = grading(2)
    verdicts.check_gather_bytes(g, gather_observations(2, events=events), 2)
    assert "besides its shard" in messages(g)["gather-bytes"]


def test_the_group_is_the_graders_not_the_records():
    observations = gather_observations(3)
    for obs in observations:
        obs["group"] = gather_run("plain", 2)
        obs["group"]["members"] = list(range(10 ** 6))  # a rank's word for its group is not taken
    observations[1]["group"] = gather_run("plain", 1)
    g = grading(3)
    verdicts.check_gather_group(g, observations, 3)
    assert statuses(g)["gather-group"] == "pass"


def test_a_scalar_returned_as_the_weight_fails_without_raising():
    observations = gather_observations(2, weight=torch.tensor(1.0).to(E4M3))
    g = grading(2)
    verdicts.check_gather(g, observations, 2)
    assert statuses(g)["gather-matches"] == "fail"


def test_unreadable_events_and_results_fail_without_raising():
    events = [{"op": "allgather_", "bytes": "many"}]
    g = grading(2)
    verdicts.check_gather_bytes(g, gather_observations(2, events=events), 2)
    verdicts.check_gather(g, [{"plain": {"returned": {"kind": "Tensor", "items": None}}}] * 2, 2)
    verdicts.check_gather_group(g, [{}, {}], 2)
    assert statuses(g) == {"gather-matches": "fail", "gather-bytes": "fail", "gather-group": "fail"}
