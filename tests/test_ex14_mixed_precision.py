"""Exercise 14's arithmetic and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import math

import pytest
import torch

from grader.checks import ex14_mixed_precision as ex
from grader.rank.drivers import ex14_mixed_precision as ex_rank
from grader.grading import Abort
from grading_helpers import grading_for, verdicts


grading = grading_for("14")


def start() -> dict:
    return {k: v.detach().clone() for k, v in ex.build_model().state_dict().items()}


def test_the_written_out_scale_sequence_is_what_gradscaler_does():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=ex.INIT_SCALE, growth_factor=ex.GROWTH_FACTOR,
                                  backoff_factor=ex.BACKOFF_FACTOR, growth_interval=ex.GROWTH_INTERVAL)
    seen = []
    for step in range(ex.STEPS):
        loss = (param * (float("inf") if step in ex.NONFINITE_STEPS else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen.append(scaler.get_scale())
    assert seen == ex.expected_scales()
    for step in ex.NONFINITE_STEPS:
        assert seen[step] < seen[step - 1]
    # A rank that skipped update() at the bad batch raises at its next step: the last, after its backward.
    assert ex.BAD_BATCH_STEP == ex.STEPS - 2


def test_the_reference_gradient_does_not_depend_on_the_scale():
    for index, name in enumerate(ex.DTYPES):
        dtype = getattr(torch, name)
        scaled, losses = ex.reference_gradient(start(), 0, index, dtype, 256.0, 2)
        plain, plain_losses = ex.reference_gradient(start(), 0, index, dtype, 1.0, 2)
        assert losses == plain_losses
        for k in plain:
            assert torch.allclose(scaled[k], plain[k], rtol=1e-3, atol=1e-6), (name, k)


def test_max_norm_is_above_the_true_norm_on_step_0_and_below_it_later():
    max_norms = ex.plan_max_norms(2)
    params = start()
    grad, _ = ex.reference_gradient(params, 0, 0, torch.bfloat16, ex.INIT_SCALE, 2)
    true_norm = ex.norm(grad)
    assert true_norm < max_norms[0][0] < true_norm * ex.INIT_SCALE
    assert all(f < 1 for f in ex.NORM_FACTORS[1:])


def _step(factor_of_grad: float, scale: float = 256.0):
    before = start()
    grad = {k: torch.full_like(v, 0.1) for k, v in before.items()}
    g_norm = ex.norm(grad)
    after = ex.sgd(before, grad, factor_of_grad)
    return before, after, grad, g_norm


def test_clipping_the_true_gradients_passes_and_each_mistake_is_named():
    before, after, grad, g_norm = _step(0.5)
    ok, _ = ex._clip_verdict(before, after, grad, g_norm, g_norm * 0.5, 256.0, "step 1")
    assert ok
    before, after, grad, g_norm = _step(1.0)
    ok, message = ex._clip_verdict(before, after, grad, g_norm, g_norm * 0.5, 256.0, "step 1")
    assert not ok and "not clipped" in message and "0.5 x the gradient" in message
    # max_norm above the true norm: the scaled gradients, 256 times larger, get clipped to 4/256
    before, after, grad, g_norm = _step(4.0 / 256)
    ok, message = ex._clip_verdict(before, after, grad, g_norm, g_norm * 4.0, 256.0, "step 0")
    assert not ok and "scaler.unscale_(optimizer) before clip_grad_norm_" in message
    before, after, grad, g_norm = _step(0.0)
    ok, message = ex._clip_verdict(before, after, grad, g_norm, g_norm * 4.0, 256.0, "step 0")
    assert not ok and "did not change" in message


def test_the_scaled_loss_is_named_and_a_tensor_is_not_a_float():
    rec = {"returned": {"type": "float", "value": 2.0 * 256}, "scale_before": 256.0}
    ok, message = ex._loss_verdict(rec, 2.0, "step 0, rank 1")
    assert not ok and "scaled loss" in message
    ok, message = ex._loss_verdict({"returned": ex_rank._describe_value(torch.tensor(2.0)), "scale_before": 1.0},
                                   2.0, "step 0, rank 1")
    assert not ok and "Tensor" in message
    assert ex._loss_verdict({"returned": {"type": "float", "value": 2.0005}, "scale_before": 1.0}, 2.0, "")[0]


def _skip_record(after: dict, before: dict) -> dict:
    return {"before": before, "after": after, "error": None}


def test_a_skipped_step_passes_and_an_applied_or_nan_step_fails():
    before = start()
    g = grading()
    assert ex.check_skip(g, [_skip_record(before, before)] * 2, ex.INF_STEP, "float16", 2)
    assert verdicts(g)["skips-nonfinite"][0] == "pass"

    g = grading()
    moved = {k: v + 0.01 for k, v in before.items()}
    ex.check_skip(g, [_skip_record(before, before), _skip_record(moved, before)], ex.INF_STEP, "float16", 2)
    status, message = verdicts(g)["skips-nonfinite"]
    assert status == "fail" and "rank 1" in message and "every rank must skip" in message

    g = grading()
    nan = {k: torch.full_like(v, float("nan")) for k, v in before.items()}
    assert not ex.check_skip(g, [_skip_record(nan, before)] * 2, ex.INF_STEP, "float16", 2)
    status, message = verdicts(g)["skips-nonfinite"]
    assert status == "fail" and "applied instead of skipped" in message


def test_ranks_holding_the_same_nans_are_identical():
    a = {"w": torch.tensor([1.0, float("nan")])}
    b = {"w": torch.tensor([1.0, float("nan")])}
    assert ex.largest_difference(ex._comparable(a), ex._comparable(b)) is None
    c = {"w": torch.tensor([1.0, 2.0])}
    assert ex.largest_difference(ex._comparable(a), ex._comparable(c)) is not None


def test_a_scaler_refusing_the_next_step_fails_scale_updates():
    before = start()
    ok_step = {"before": before, "after": before, "scale_before": 256.0, "scale_after": 256.0,
               "computed_in": ["torch.bfloat16"], "returned": {"type": "float", "value": 1.0}, "grads_after": [],
               "error": None}
    refused = dict(ok_step, error="RuntimeError: unscale_() is being called after step().")
    runs = [{"dtype": "bfloat16", "steps": [ok_step, refused]}] * 2
    g = grading()
    ex.check_dtype_run(g, runs, 0, [1.0] * ex.STEPS, 2)
    found = verdicts(g)
    assert found["scale-updates"][0] == "fail" and "scaler.update()" in found["scale-updates"][1]
    assert found["skips-nonfinite"][0] == "fail" and "raised on rank 0" in found["skips-nonfinite"][1]


def test_a_scale_left_unchanged_after_the_inf_step_says_so():
    rec = {"scale_before": 512.0, "scale_after": 512.0}
    message = ex._scale_message(rec, ex.INF_STEP, ex.expected_scales(), 0, 2)
    assert "halves the scale after a skipped step" in message and "512" in message


def test_the_bad_batch_makes_only_the_last_ranks_loss_nan_and_every_gradient_nan():
    params = start()
    for world_size in (2, 3):
        x, _ = ex.batch(world_size - 1, ex.BAD_BATCH_STEP, 0, world_size)
        assert not bool(torch.isfinite(x).all())
        assert all(bool(torch.isfinite(ex.batch(r, s, 0, world_size)[0]).all())
                   for r in range(world_size) for s in range(ex.STEPS) if (r, s) != (world_size - 1, ex.BAD_BATCH_STEP))
        for index, name in enumerate(ex.DTYPES):
            grad, losses = ex.reference_gradient(params, ex.BAD_BATCH_STEP, index, getattr(torch, name), 256.0,
                                                 world_size)
            assert [math.isfinite(v) for v in losses] == [True] * (world_size - 1) + [False], (name, losses)
            assert not math.isfinite(ex.norm(grad))


def test_every_max_norm_is_finite():
    for world_size in (2, 3):
        assert all(math.isfinite(m) and m > 0 for per_dtype in ex.plan_max_norms(world_size) for m in per_dtype)


def test_a_nan_loss_returned_for_a_nan_loss_passes():
    rec = {"returned": {"type": "float", "value": float("nan")}, "scale_before": 256.0}
    assert ex._loss_verdict(rec, float("nan"), "step 4, rank 1")[0]
    ok, message = ex._loss_verdict({"returned": {"type": "float", "value": 0.0}, "scale_before": 256.0},
                                   float("nan"), "step 4, rank 1")
    assert not ok and "held an inf" in message


def _scale_record(before: float, after: float) -> dict:
    return {"scale_before": before, "scale_after": after}


def test_a_rank_that_skips_update_on_its_own_nan_loss_is_named():
    g = grading()
    ex.check_scales_agree(g, [_scale_record(256.0, 128.0), _scale_record(256.0, 256.0)], ex.BAD_BATCH_STEP,
                          "bfloat16", 2)
    status, message = verdicts(g)["skips-nonfinite"]
    assert status == "fail"
    assert "rank 1's batch held an inf" in message and "skipped scaler.update()" in message
    assert "rank 1's own loss" in message and "on every rank, every step" in message

    g = grading()
    ex.check_scales_agree(g, [_scale_record(256.0, 128.0)] * 2, ex.BAD_BATCH_STEP, "bfloat16", 2)
    assert "skips-nonfinite" not in verdicts(g)


def test_the_scale_message_at_the_bad_batch_names_the_nan_loss():
    rec = _scale_record(256.0, 256.0)
    message = ex._scale_message(rec, ex.BAD_BATCH_STEP, ex.expected_scales(), 1, 2)
    assert "own loss was NaN" in message
    message = ex._scale_message(rec, ex.BAD_BATCH_STEP, ex.expected_scales(), 0, 2)
    assert "own loss" not in message and "halves the scale after a skipped step" in message


def test_the_scalers_stage_is_read_without_changing_it():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    assert ex_rank._scaler_stage(scaler, optimizer) == "READY"
    assert id(optimizer) not in scaler._per_optimizer_states
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    assert ex_rank._scaler_stage(scaler, optimizer) == "UNSCALED"
    scaler.step(optimizer)
    assert ex_rank._scaler_stage(scaler, optimizer) == "STEPPED"
    scaler.update()
    assert ex_rank._scaler_stage(scaler, optimizer) == "READY"


def _errored(error: str, stage: str) -> dict:
    return {"error": error, "stage_before": stage, "computed_in": ["torch.bfloat16"],
            "where": {"line": 12, "function": "train_step_amp", "code": "scaler.unscale_(optimizer)"}}


def test_a_second_unscale_in_one_call_is_told_from_a_missing_update():
    twice = "RuntimeError: unscale_() has already been called on this optimizer since the last update()."
    assert "second time" in ex.called_twice(_errored(twice, "READY"))
    assert ex.called_twice(_errored(twice, "UNSCALED")) is None
    assert ex.called_twice(_errored("RuntimeError: unscale_() is being called after step().", "STEPPED")) is None
    assert "second time" in ex.called_twice(_errored("RuntimeError: step() has already been called since the last "
                                                     "update().", "READY"))
    assert ex.called_twice(_errored("ValueError: something else", "READY")) is None
    assert ex.called_twice({"error": None, "stage_before": "READY"}) is None


def test_a_second_unscale_stops_the_grading_and_says_where():
    twice = "RuntimeError: unscale_() has already been called on this optimizer since the last update()."
    runs = [[{"dtype": name, "steps": [_errored(twice, "READY")]} for name in ex.DTYPES]] * 2
    g = grading()
    with pytest.raises(Abort) as stopped:
        ex.check_called_twice(g, runs, 2)
    assert "line 12" in stopped.value.problem.message and "second time" in stopped.value.problem.message
    found = verdicts(g)
    status, message = found["clips-true-gradients"]
    assert status == "fail" and "every rank" in message and "line 12" in message
    assert "scaler.unscale_(optimizer) ran a second time in the same step" in message
    assert found["autocast-forward"][0] == "pass"

    g = grading()
    ex.check_called_twice(g, [[{"dtype": "bfloat16", "steps": [_errored(twice, "UNSCALED")]}]] * 2, 2)
    assert verdicts(g) == {}
