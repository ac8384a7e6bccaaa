"""Demonstrations for the quiz topic 'memory' (grader/quiz/bank/memory.toml).

Activation checkpointing, gradient buckets and optimizer state, on the installed torch. The DDP
scenarios share one two-rank gloo world (module fixture).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from quiz_demos.world import run_world


class SameLayerTwice(nn.Module):
    """One linear layer applied twice, each application checkpointed."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = checkpoint(self.lin, x, use_reentrant=self.use_reentrant)
        return checkpoint(self.lin, x, use_reentrant=self.use_reentrant)


class LayerThenSameLayerTwice(nn.Module):
    """A linear layer, then a second one applied twice, each application of the second checkpointed."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x = self.first(x)
        x = checkpoint(self.lin, x, use_reentrant=True)
        return checkpoint(self.lin, x, use_reentrant=True)


def _reentrant_twice_after_another_layer(rank):
    """What the first backward does: the error it raises, if any."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(LayerThenSameLayerTwice())
    x = torch.randn(3, 4) * (rank + 1)
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return None


def _weight_grad_sum(rank, world_size, use_reentrant, **ddp_kwargs):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(SameLayerTwice(use_reentrant), **ddp_kwargs)
    x = (torch.randn(3, 4) * (rank + 1)).requires_grad_()
    sums = []
    for _ in range(2):
        model.zero_grad()
        model(x).sum().backward()
        sums.append(model.module.lin.weight.grad.sum().item())
    # What DDP should produce: the average over ranks of each rank's own gradient.
    torch.manual_seed(0)
    plain = SameLayerTwice(use_reentrant=False)
    plain(x).sum().backward()
    expected = plain.lin.weight.grad.clone()
    dist.all_reduce(expected)
    return {"sums": sums, "expected": (expected / world_size).sum().item()}


def _bucket_view_and_sizes(bucket_cap_mb=None, gradient_as_bucket_view=False):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 8)),
        bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    storages = []
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 512)).sum().backward()
        opt.step()
        storages.append({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                         for p in model.parameters()})
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"grad_storages": [len(s) for s in storages],
            "storage_bytes": [sum(s.values()) for s in storages], "grad_bytes": grad_bytes}


def memory_main(ctx) -> dict:
    with ctx.group():
        return memory_observations(ctx.rank, ctx.world_size)


def memory_observations(rank: int, world_size: int) -> dict:
    return {
        "reentrant_default": _weight_grad_sum(rank, world_size, use_reentrant=True),
        "reentrant_after_another_layer": _reentrant_twice_after_another_layer(rank),
        "reentrant_static_graph": _weight_grad_sum(rank, world_size, use_reentrant=True, static_graph=True),
        "non_reentrant": _weight_grad_sum(rank, world_size, use_reentrant=False),
        "copies": _bucket_view_and_sizes(),
        "views": _bucket_view_and_sizes(gradient_as_bucket_view=True),
        "views_cap_1mb": _bucket_view_and_sizes(bucket_cap_mb=1, gradient_as_bucket_view=True),
    }


@pytest.fixture(scope="module")
def memory_world(session):
    return run_world(session, "quiz_demos.test_memory:memory_main", 2, timeout_s=180)


@pytest.mark.slow
def test_reentrant_checkpoint_twice_under_ddp_leaves_ranks_with_different_gradients(memory_world):
    first, second = (r["reentrant_default"] for r in memory_world)
    assert first["expected"] == pytest.approx(second["expected"])
    # No error is raised, but the ranks disagree and neither has the average.
    assert abs(first["sums"][-1] - second["sums"][-1]) > 1e-3
    assert first["sums"][-1] != pytest.approx(first["expected"], abs=1e-4)


@pytest.mark.slow
def test_reentrant_checkpoint_twice_after_another_layer_raises_on_every_rank(memory_world):
    # The usual case, the reused layer inside a larger model: the first backward fails on each rank.
    for rank, seen in enumerate(memory_world):
        error = seen["reentrant_after_another_layer"]
        assert error is not None and "Expected to mark a variable ready only once" in error, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["reentrant_static_graph", "non_reentrant"])
def test_static_graph_or_non_reentrant_checkpoint_gives_the_average(memory_world, variant):
    for rank, seen in enumerate(memory_world):
        got = seen[variant]
        assert got["sums"] == pytest.approx([got["expected"]] * 2, abs=1e-4), f"rank {rank}"


@pytest.mark.slow
def test_gradient_as_bucket_view_makes_grads_views_of_the_bucket(memory_world):
    for seen in memory_world:
        # Three parameters' worth of separate .grad tensors (6 with biases) without it ...
        assert seen["copies"]["grad_storages"] == [6, 6, 6]
        # ... one shared storage per bucket with it (default buckets: 1 MiB first, then 25 MiB).
        assert all(n <= 2 for n in seen["views"]["grad_storages"])


@pytest.mark.slow
def test_buckets_hold_one_copy_of_every_gradient_whatever_the_cap(memory_world):
    for seen in memory_world:
        # With gradients as views, the distinct storages behind .grad are the buckets themselves.
        for case in ("views", "views_cap_1mb"):
            assert seen[case]["storage_bytes"][-1] == seen[case]["grad_bytes"], case
        # The first iteration has one bucket; after the rebuild, two (1 MiB closes the first): more buckets, same bytes.
        assert seen["views_cap_1mb"]["grad_storages"][0] == 1
        assert seen["views_cap_1mb"]["grad_storages"][-1] == 2


def test_checkpoint_without_use_reentrant_warns_and_uses_the_reentrant_variant():
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2)                      # no input requires grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpoint(lin, x)
    messages = [str(w.message) for w in caught]
    assert any("use_reentrant parameter should be passed explicitly" in m for m in messages)
    # The reentrant variant's restriction shows: with no input requiring grad, no graph is kept.
    assert not out.requires_grad
    assert checkpoint(lin, x, use_reentrant=False).requires_grad


def test_checkpointed_segment_runs_forward_twice():
    calls = []

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            calls.append(1)
            return torch.tanh(self.lin(x))

    block = Counted()
    x = torch.randn(2, 4, requires_grad=True)
    block(x).sum().backward()
    assert len(calls) == 1
    calls.clear()
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert len(calls) == 2                     # once in forward, again in backward


def test_adam_keeps_two_full_size_tensors_per_parameter():
    lin = nn.Linear(100, 100)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(1, 100)).sum().backward()
    opt.step()
    state = opt.state[lin.weight]
    assert state["exp_avg"].shape == lin.weight.shape and state["exp_avg"].dtype == torch.float32
    assert state["exp_avg_sq"].shape == lin.weight.shape
    assert state["step"].numel() == 1


def test_adam_allocates_its_state_at_the_first_step_for_parameters_with_gradients():
    used, unused = nn.Linear(10, 10), nn.Linear(10, 10)
    opt = torch.optim.Adam([*used.parameters(), *unused.parameters()])
    assert len(opt.state) == 0                  # nothing after the constructor
    used(torch.randn(2, 10)).sum().backward()
    assert len(opt.state) == 0                  # nor after backward
    opt.step()
    assert set(opt.state) == set(used.parameters())   # the step, for parameters with a gradient only
    assert opt.state[used.weight]["exp_avg_sq"].shape == used.weight.shape


def test_zero_grad_sets_gradients_to_none_and_the_step_skips_them():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    lin(torch.randn(2, 3)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in lin.parameters())
    before = [p.detach().clone() for p in lin.parameters()]
    opt.step()                                  # no gradients: nothing moves, not even weight decay
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
