"""Topic core: what DDP averages, what it sends, and what one DDP step equals (two gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quiz_demos.world import run_world

WORLD = 2


def make_batch(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own data: different on every rank, the same in the ranks and in this process."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


class Recorder(nn.Module):
    """A linear layer that remembers the batch size each forward saw."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return self.linear(x)


def core_main(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(ctx.rank)  # each rank initialises its model differently
    out: dict = {}
    with ctx.group():
        model = Recorder()
        out["weight_before_ddp"] = model.linear.weight.detach().clone()
        ddp = DDP(model)
        out["weight_after_ddp"] = model.linear.weight.detach().clone()
        out["start_state"] = copy.deepcopy(model.linear.state_dict())

        # One backward on this rank's own 8 samples, mean loss; the local gradient for comparison.
        x, y = make_batch(ctx.rank, 8)
        plain = copy.deepcopy(model.linear)
        F.mse_loss(plain(x), y).backward()
        out["local_grad"] = plain.weight.grad.clone()
        F.mse_loss(ddp(x), y).backward()
        out["mean_grad"] = model.linear.weight.grad.clone()
        out["seen"] = list(model.seen)

        # The same with a summed loss.
        model.zero_grad()
        F.mse_loss(ddp(x), y, reduction="sum").backward()
        out["sum_grad"] = model.linear.weight.grad.clone()

        # Uneven last batch: 10 samples on rank 0, 6 on rank 1, mean loss.
        model.zero_grad()
        xu, yu = make_batch(ctx.rank, 10 if ctx.rank == 0 else 6)
        F.mse_loss(ddp(xu), yu).backward()
        out["uneven_grad"] = model.linear.weight.grad.clone()

        # Three Adam steps with different data and different dropout masks on each rank.
        net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3))
        ddp_net = DDP(net)
        opt = torch.optim.Adam(ddp_net.parameters(), lr=0.01)
        for step in range(3):
            xs, ys = make_batch(10 * ctx.rank + step, 8)
            opt.zero_grad()
            F.mse_loss(ddp_net(xs), ys).backward()
            opt.step()
        out["after_adam"] = [p.detach().clone() for p in net.parameters()]
        out["adam_state"] = [opt.state[p]["exp_avg_sq"].clone() for p in net.parameters()]

        # Parameters are not broadcast after construction: nudge rank 1's weights, train one step.
        with torch.no_grad():
            if ctx.rank == 1:
                net[0].weight += 1.0
        xs, ys = make_batch(ctx.rank, 8)
        opt.zero_grad()
        F.mse_loss(ddp_net(xs), ys).backward()
        opt.step()
        out["after_nudge"] = net[0].weight.detach().clone()
    return out


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_core:core_main", WORLD)


def single_process_grad(start_state: dict, x, y, reduction="mean") -> torch.Tensor:
    model = nn.Linear(4, 3)
    model.load_state_dict(start_state)
    F.mse_loss(model(x), y, reduction=reduction).backward()
    return model.weight.grad


@pytest.mark.slow
def test_constructor_makes_the_replicas_start_equal(ranks):
    assert not torch.equal(ranks[0]["weight_before_ddp"], ranks[1]["weight_before_ddp"])
    for r in ranks:
        assert torch.equal(r["weight_after_ddp"], ranks[0]["weight_before_ddp"])


@pytest.mark.slow
def test_grad_after_backward_is_the_mean_of_the_local_grads_on_every_rank(ranks):
    mean = sum(r["local_grad"] for r in ranks) / WORLD
    for r in ranks:
        torch.testing.assert_close(r["mean_grad"], mean)
    assert not torch.allclose(ranks[0]["local_grad"], ranks[1]["local_grad"])


@pytest.mark.slow
def test_one_step_equals_the_combined_batch_at_the_same_learning_rate(ranks):
    batches = [make_batch(r, 8) for r in range(WORLD)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    torch.testing.assert_close(ranks[0]["mean_grad"], single_process_grad(ranks[0]["start_state"], x, y))


@pytest.mark.slow
def test_summed_loss_gives_a_gradient_world_size_times_smaller(ranks):
    batches = [make_batch(r, 8) for r in range(WORLD)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    whole = single_process_grad(ranks[0]["start_state"], x, y, reduction="sum")
    torch.testing.assert_close(ranks[0]["sum_grad"] * WORLD, whole)


@pytest.mark.slow
def test_uneven_batches_are_weighted_per_rank_not_per_sample(ranks):
    batches = [make_batch(r, 10 if r == 0 else 6) for r in range(WORLD)]
    per_rank = [single_process_grad(ranks[0]["start_state"], *b) for b in batches]
    overall = single_process_grad(ranks[0]["start_state"], torch.cat([b[0] for b in batches]),
                                  torch.cat([b[1] for b in batches]))
    torch.testing.assert_close(ranks[0]["uneven_grad"], (per_rank[0] + per_rank[1]) / 2)
    assert not torch.allclose(ranks[0]["uneven_grad"], overall, atol=1e-4)


@pytest.mark.slow
def test_ddp_does_not_split_the_input(ranks):
    assert all(r["seen"] == [8] for r in ranks)


@pytest.mark.slow
def test_replicas_stay_identical_with_different_data_and_dropout(ranks):
    for a, b in zip(ranks[0]["after_adam"], ranks[1]["after_adam"]):
        assert torch.equal(a, b)
    for a, b in zip(ranks[0]["adam_state"], ranks[1]["adam_state"]):
        assert torch.equal(a, b)  # the optimizer states are identical too


@pytest.mark.slow
def test_parameters_are_not_broadcast_after_construction(ranks):
    difference = ranks[1]["after_nudge"] - ranks[0]["after_nudge"]
    torch.testing.assert_close(difference, torch.ones_like(difference))
