"""Exercise 05's grader helpers, without starting a process group."""

from __future__ import annotations

import torch

from grader.checks import ex05_allreduce as ex05
from grader.child import describe_exception, import_learner

STUB = '''class SimpleDDP:
    def __init__(self, model):
        # TODO
        raise NotImplementedError
'''


def test_not_implemented_in_a_method_is_named_with_its_class(tmp_path):
    path = tmp_path / "05_allreduce.py"
    path.write_text(STUB)
    module = import_learner(str(path))
    try:
        try:
            module.SimpleDDP(None)
        except NotImplementedError as exc:
            ex05._reraise_with_method_name(exc, str(path))
    except NotImplementedError as exc:
        where = describe_exception(exc, str(path))["where"]
    assert where == {"line": 4, "function": "SimpleDDP.__init__", "code": "raise NotImplementedError"}


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
