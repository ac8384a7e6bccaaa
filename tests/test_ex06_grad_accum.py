"""Exercise 06's reference step, checked against accumulation done by hand in one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.checks import ex06_grad_accum as ex06
from grader.rank.drivers import ex06_grad_accum as ex06_rank


def test_expected_step_equals_scaled_accumulation_averaged_over_ranks():
    world_size, call = 2, 0
    count = ex06.MICRO_COUNTS[call]
    start = ex06.build_model()
    params = {n: p.detach().clone() for n, p in start.named_parameters()}
    # what DDP does: each rank accumulates loss / count, then the ranks' sums are averaged
    per_rank = []
    for rank in range(world_size):
        model = ex06.build_model()
        for i in range(count):
            x, y = ex06.micro_batch(rank, call, i)
            (F.cross_entropy(model(x), y) / count).backward()
        per_rank.append({n: p.grad for n, p in model.named_parameters()})
    want, unscaled = ex06.expected_step(params, call, world_size)
    for name, p in params.items():
        grad = sum(g[name] for g in per_rank) / world_size
        assert torch.allclose(want[name], p - ex06.LR * grad, rtol=1e-5, atol=1e-7)
        assert torch.allclose(unscaled[name], p - ex06.LR * count * grad, rtol=1e-5, atol=1e-7)


def test_micro_losses_are_unscaled_per_micro_batch():
    params = {n: p.detach().clone() for n, p in ex06.build_model().named_parameters()}
    losses = ex06.micro_losses(params, 1, 0)
    assert len(losses) == ex06.MICRO_COUNTS[0]
    x, y = ex06.micro_batch(1, 0, 2)
    with torch.no_grad():
        want = float(F.cross_entropy(ex06.build_model()(x), y))
    assert abs(losses[2] - want) < 1e-6


def test_a_tensor_return_is_not_a_float():
    assert ex06_rank._describe_value(torch.tensor(1.5)) == {"type": "Tensor", "value": 1.5}
    assert ex06_rank._describe_value(2) == {"type": "float", "value": 2.0}
    assert ex06_rank._describe_value(True)["type"] == "bool"
