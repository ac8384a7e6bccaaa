"""Demonstrations for the float8 quiz topic, run on the installed torch.

One process: the two formats' ranges, the cast's rounding and saturation, what one outlier's scale does to small
values, an all-zero tensor's scale, what torch._scaled_mm does with the scales it is given, a float8 master weight
losing an update, a stale scale meeting a new outlier. One world of two gloo ranks (run once for the module, through
the grader's harness): FSDP2's float8 all-gather by hand (the amax all-reduced, one byte per element sent as uint8).
"""

from __future__ import annotations

import pytest
import torch
from quiz_demos.world import run_world

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def scale_of(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's amax_to_scale: max / max(amax, 1e-12), in float64, kept in float32."""
    return (torch.finfo(dtype).max / torch.clamp(t.abs().max().double(), min=1e-12)).float()


def cast(t: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype)


def test_e4m3_reaches_448_and_e5m2_57344():
    assert torch.finfo(E4M3).max == 448 and torch.finfo(E5M2).max == 57344
    # The smallest positive values (subnormal): 2^-9 and 2^-16.
    assert float(torch.tensor(2.0 ** -9).to(E4M3).float()) == 2.0 ** -9
    assert float(torch.tensor(2.0 ** -16).to(E5M2).float()) == 2.0 ** -16
    # E4M3 has 8 values per power of two, E5M2 4: the spacing just above 1.
    assert float(torch.tensor(1.1).to(E4M3).float()) == 1.125 and float(torch.tensor(1.1).to(E5M2).float()) == 1.0


def test_an_outlier_scale_flushes_small_values_to_zero():
    values = torch.tensor([0.0005, 0.01, 0.5, 1.0])
    with_outlier = torch.cat([values, torch.tensor([-300.0])])
    scale = scale_of(with_outlier, E4M3)  # 448 / 300
    back = cast(with_outlier, scale, E4M3).float() / scale
    assert float(back[0]) == 0.0  # 0.0005 * 1.49 is below half of 2^-9
    assert abs(float(back[1]) - 0.01) / 0.01 > 0.02  # a subnormal: one or two significant bits left
    # Without the outlier the scale is 448 and 0.0005 keeps E4M3's three mantissa bits.
    alone = scale_of(values, E4M3)
    kept = cast(values, alone, E4M3).float() / alone
    assert abs(float(kept[0]) - 0.0005) / 0.0005 <= 2 ** -4


def test_scaled_mm_multiplies_each_operand_by_the_scale_it_is_given():
    a = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    b = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    sa, sb = scale_of(a, E4M3), scale_of(b, E4M3)
    a8, b8 = cast(a, sa, E4M3), cast(b, sb, E4M3)
    plain = a8.float() @ b8.float().t()  # still scaled by sa * sb
    given = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    undone = torch._scaled_mm(a8, b8.t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
    near = lambda x, y: float((x - y).abs().max()) <= 1e-5 * float(y.abs().max())  # noqa: E731
    assert near(given, plain * sa * sb)  # the scales multiplied in: sa * sb times too large
    assert near(undone, plain / (sa * sb))  # the reciprocals undo the casts' scaling
    assert float((undone - a @ b.t()).abs().max()) <= 2 * 2 ** -4 * float((a.abs() @ b.abs().t()).max())


def test_casts_saturate_to_e4m3_but_overflow_to_inf_in_e5m2():
    big = torch.tensor([1e6, -1e6])
    assert big.to(E4M3).float().tolist() == [448.0, -448.0]
    assert torch.isinf(big.to(E5M2).float()).all()
    # torchao clamps first (to_fp8_saturated), so E5M2 saturates too.
    assert cast(big, 1.0, E5M2).float().tolist() == [57344.0, -57344.0]


def test_a_float8_weight_loses_an_update_smaller_than_half_its_spacing():
    weight = torch.tensor(0.1).to(E4M3)  # 0.1015625: E4M3's values near 0.1 are 2^-7 apart
    assert float(weight.float()) == 0.1015625
    updated = (weight.float() - 0.001).to(E4M3)
    assert float(updated.float()) == float(weight.float())  # the update is gone
    master = torch.tensor(0.1)
    for _ in range(10):
        master -= 0.001
    assert abs(float(master) - 0.09) < 1e-6 and float(master.to(E4M3).float()) < float(weight.float())


def test_a_stale_scale_saturates_a_new_outlier():
    before = torch.tensor([1.0, -2.0, 3.0])
    now = torch.tensor([1.0, -2.0, 30.0])
    stale = scale_of(before, E4M3)  # 448 / 3
    seen = cast(now, stale, E4M3).float() / stale
    assert float(seen[2]) == 3.0  # 30 became 448 / scale: ten times too small
    fresh = scale_of(now, E4M3)
    assert float((cast(now, fresh, E4M3).float() / fresh)[2]) == 30.0


def test_an_all_zero_tensor_casts_to_zeros_through_the_clamped_amax():
    zeros = torch.zeros(4, 8)
    scale = scale_of(zeros, E4M3)  # 448 / max(0, 1e-12)
    assert torch.isfinite(scale) and float(scale) == pytest.approx(448 / 1e-12, rel=1e-6)
    assert cast(zeros, scale, E4M3).float().eq(0).all()
    # Without the clamp: 448 / 0 is inf, and 0 x inf is NaN in every element.
    unclamped = (torch.finfo(E4M3).max / zeros.abs().max().double()).float()
    assert torch.isinf(unclamped)
    assert torch.isnan((zeros * unclamped).to(E4M3).float()).all()


# --- two gloo ranks ------------------------------------------------------------------------------


def _observe(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    rows = 8
    weight = torch.randn(rows * world_size, 16, generator=torch.Generator().manual_seed(3)) * 0.02
    weight[rows * world_size - 1, 3] = 1.5  # the last rank's shard holds an outlier
    shard = weight[rank * rows:(rank + 1) * rows]
    obs = {}
    # FSDP2's float8 all-gather by hand: one amax for the whole weight, then one byte per element.
    amax = shard.abs().max()
    obs["own_scale"] = float(scale_of(shard, E4M3))
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    scale = (448.0 / torch.clamp(amax.double(), min=1e-12)).float()
    shard8 = cast(shard, scale, E4M3)
    out = torch.empty(rows * world_size, 16, dtype=torch.uint8)
    dist.all_gather_into_tensor(out, shard8.view(torch.uint8))
    obs["sent_bytes"] = shard8.view(torch.uint8).numel() * shard8.view(torch.uint8).element_size()
    obs["float32_bytes"] = shard.numel() * shard.element_size()
    obs["same_as_whole"] = torch.equal(out, cast(weight, scale_of(weight, E4M3), E4M3).view(torch.uint8))
    obs["scale"], obs["whole_scale"] = float(scale), float(scale_of(weight, E4M3))
    return obs


def observe_main(ctx) -> dict:
    with ctx.group():
        return _observe(ctx.rank, ctx.world_size)


@pytest.fixture(scope="module")
def observed(session) -> list[dict]:
    return run_world(session, "quiz_demos.test_float8:observe_main", 2)


@pytest.mark.slow
def test_fsdp_float8_all_gather_sends_a_byte_per_element_with_the_whole_weights_scale(observed):
    for obs in observed:
        assert obs["sent_bytes"] * 4 == obs["float32_bytes"]
        assert obs["scale"] == obs["whole_scale"]
        assert obs["same_as_whole"]  # the gathered bytes are the whole weight cast with its own scale
    # Without the all-reduce, rank 0 (no outlier) would have cast with another scale.
    assert observed[0]["own_scale"] != observed[0]["whole_scale"]
