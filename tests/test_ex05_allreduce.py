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


def test_the_ddp_parameters_the_grader_trains_are_sgd_on_every_rank_s_batch_at_once():
    """The mean of the ranks' gradients (what torch's DDP hands SGD) is the gradient of the loss over all their
    batches together: a second way to the parameters matches-torch-ddp expects."""
    from grader.checks import ex05_allreduce as ex

    for world_size in (1, 2, 3):
        model = ex.build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=ex.LR)
        for step in range(ex.STEPS):
            xs, ys = zip(*(ex.batch(rank, step) for rank in range(world_size)))
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
            optimizer.step()
        got = ex.ddp_parameters(world_size)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), atol=ex.ATOL, rtol=ex.RTOL)
