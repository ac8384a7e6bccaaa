"""Exercise 05's grader helpers, without starting a process group."""

from __future__ import annotations

import torch

from grader.checks import ex05_allreduce as ex05


def test_local_gradients_are_those_of_the_rank_batch():
    params = {n: p.detach().clone() for n, p in ex05.build_model().named_parameters()}
    grads = [ex05.local_gradients(params, rank, 0) for rank in range(2)]
    assert not torch.allclose(grads[0]["head.weight"], grads[1]["head.weight"])  # ranks' data differ
    assert torch.equal(ex05.local_gradients(params, 1, 0)["head.bias"], grads[1]["head.bias"])


def test_a_summed_gradient_is_reported_as_the_sum():
    mean = {"w": torch.tensor([0.5, -1.0])}
    ok, _ = ex05._averaged_verdict({"w": mean["w"].clone()}, mean, 2, 0, "step 0, rank 0")
    assert ok
    ok, message = ex05._averaged_verdict({"w": mean["w"] * 2}, mean, 2, 0, "step 0, rank 0")
    assert not ok and "the sum" in message and "w.grad" in message
    ok, message = ex05._averaged_verdict({"w": None}, mean, 2, 0, "step 0, rank 0")
    assert not ok and "None" in message
