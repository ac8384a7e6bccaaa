"""Exercise 10's measures and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader.checks import ex10_zero as ex
from grading_helpers import grading_for, verdicts


grading = grading_for("10")


def test_state_bytes_counts_each_storage_once_and_skips_parameters():
    p = torch.zeros(10)
    shared = torch.zeros(4)

    class Holder:
        def __init__(self, state):
            self.state = state

    a = Holder({0: {"exp_avg": shared, "view": shared[:2], "param": p}})
    b = Holder({1: {"exp_avg": shared, "other": torch.zeros(2, dtype=torch.float64)}})
    assert ex.state_bytes([a, b], {p.untyped_storage().data_ptr()}) == 4 * 4 + 2 * 8


def test_unsharded_adamw_state_is_two_averages_and_a_step_per_parameter():
    params = list(ex.build_model().parameters())
    expected = sum(2 * p.numel() * 4 + 4 for p in params)
    assert ex.unsharded_state_bytes() == expected


def sizes_and_names():
    model = ex.build_model()
    return [p.numel() for p in model.parameters()], [n for n, _ in model.named_parameters()]


def test_round_robin_is_unbalanced_and_largest_first_is_balanced():
    sizes, _ = sizes_and_names()
    n = len(sizes)
    g = grading()
    ex.check_balance(g, [{"local_params": list(range(0, n, 2))}, {"local_params": list(range(1, n, 2))}], sizes, 2)
    status, message = verdicts(g)["balanced-by-size"]
    assert status == "fail" and "rank 0 owns 1536" in message

    g = grading()
    half = n // 2  # (weight, bias) pairs of equal layers: the first half is half the elements
    ex.check_balance(g, [{"local_params": list(range(half))}, {"local_params": list(range(half, n))}], sizes, 2)
    assert verdicts(g)["balanced-by-size"][0] == "pass"


def test_overlapping_or_missing_owners_fail():
    _, names = sizes_and_names()
    n = len(names)
    base = {"is_optimizer": True, "local_is_adamw": True, "local_type": "torch.optim.adamw.AdamW"}
    g = grading()
    ex.check_local_optimizer(g, [{**base, "local_params": list(range(n))}, {**base, "local_params": [0]}], names, 2)
    status, message = verdicts(g)["local-optimizer"]
    assert status == "fail" and "more than one rank" in message and "'0.weight' on ranks [0, 1]" in message

    g = grading()
    ex.check_local_optimizer(g, [{**base, "local_params": [0]}, {**base, "local_params": [1]}], names, 2)
    status, message = verdicts(g)["local-optimizer"]
    assert status == "fail" and f"{n - 2} of {n} parameters are in no rank's" in message


def test_replicated_state_fails_and_a_half_share_passes():
    full = ex.unsharded_state_bytes()
    g = grading()
    ex.check_state(g, [{"state_bytes": full}, {"state_bytes": full}], full, 2052, 2)
    assert verdicts(g)["state-sharded"][0] == "fail"
    g = grading()
    ex.check_state(g, [{"state_bytes": full // 2}, {"state_bytes": full - full // 2}], full, 2052, 2)
    assert verdicts(g)["state-sharded"][0] == "pass"


def test_the_unsharded_adamw_the_grader_trains_is_adamw_on_every_rank_s_batch_at_once():
    """The mean of the ranks' gradients (what DDP hands the optimizer) is the gradient of the loss over all their
    batches together: a second way to the same parameters, with a scheduler too."""
    for world_size, scheduled in ((2, False), (3, True)):
        model = ex.build_model()
        optimizer = torch.optim.AdamW(model.parameters(), **ex.OPTIMIZER_KWARGS)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ex.lr_factor) if scheduled else None
        for step in range(ex.STEPS):
            xs, ys = zip(*(ex.batch(step, rank) for rank in range(world_size)))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        got = ex.unsharded_parameters(ex.build_model, world_size, scheduled=scheduled)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), atol=ex.ATOL, rtol=ex.RTOL)


def test_parameters_left_where_they_started_fail_on_the_grader_s_own_answer():
    unsharded = ex.unsharded_parameters(ex.build_model, 2)
    start = {name: p.detach().clone() for name, p in ex.build_model().named_parameters()}
    g = grading()
    ex.check_parameters(g, [{"sharded": unsharded}, {"sharded": start}], unsharded, 2)
    status, message = verdicts(g)["matches-unsharded"]
    assert status == "fail" and message.startswith("rank 1: after 3 steps '0.weight' differs"), message
    g = grading()
    ex.check_parameters(g, [{"sharded": unsharded}, {"sharded": unsharded}], unsharded, 2)
    assert verdicts(g)["matches-unsharded"][0] == "pass"


def test_a_nan_a_wrong_shape_or_a_missing_parameter_fails_and_is_named():
    unsharded = ex.unsharded_parameters(ex.build_model, 2)
    nan = {**unsharded, "0.weight": torch.full_like(unsharded["0.weight"], float("nan"))}
    flat = {**unsharded, "0.bias": unsharded["0.bias"][:1]}  # one element: it would broadcast, unchecked
    missing = {k: v for k, v in unsharded.items() if k != "2.weight"}
    for record, words in ((nan, "'0.weight' differs by up to inf"), (flat, "'0.bias' has shape [1]"),
                          (missing, "'2.weight' is missing")):
        g = grading()
        ex.check_parameters(g, [{"sharded": unsharded}, {"sharded": record}], unsharded, 2)
        status, message = verdicts(g)["matches-unsharded"]
        assert status == "fail" and message.startswith("rank 1: ") and words in message, message
