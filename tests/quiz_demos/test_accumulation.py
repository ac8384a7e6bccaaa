"""Topic accumulation: what no_sync() skips, where the forward must run, and how to scale the loss
(two gloo ranks; a counting communication hook shows each all-reduce)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quiz_demos.world import run_world

WORLD, ACCUM, MICRO = 2, 4, 2


def micro_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 1, generator=g)


def counted(DDP, model):
    """``model`` in DDP with a hook that all-reduces as usual and counts the buckets it reduced."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DDP(model)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, calls


def accumulation_main(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    out: dict = {}
    with ctx.group():
        start = nn.Linear(4, 1)
        out["start"] = {k: v.clone() for k, v in start.state_dict().items()}

        # no_sync on the first ACCUM-1 micro-batches; the loss divided by ACCUM.
        model = nn.Linear(4, 1)
        model.load_state_dict(start.state_dict())
        ddp, calls = counted(DDP, model)
        per_backward = []
        for step in range(ACCUM):
            x, y = micro_batch(ctx.rank, step)
            before = len(calls)
            if step < ACCUM - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(x), y) / ACCUM).backward()
                if step == 0:
                    out["grad_inside_no_sync"] = model.weight.grad.clone()
            else:
                (F.mse_loss(ddp(x), y) / ACCUM).backward()
            per_backward.append(len(calls) - before)
        out["all_reduces_per_backward"] = per_backward
        out["accumulated_with_no_sync"] = model.weight.grad.clone()

        # The same without no_sync: every backward all-reduces, and the result is the same.
        model = nn.Linear(4, 1)
        model.load_state_dict(start.state_dict())
        ddp, calls = counted(DDP, model)
        for step in range(ACCUM):
            x, y = micro_batch(ctx.rank, step)
            (F.mse_loss(ddp(x), y) / ACCUM).backward()
        out["all_reduces_without_no_sync"] = len(calls)
        out["accumulated_without_no_sync"] = model.weight.grad.clone()

        # Forward outside the context, only backward inside: the backward still all-reduces.
        model = nn.Linear(4, 1)
        ddp, calls = counted(DDP, model)
        x, y = micro_batch(ctx.rank, 0)
        loss = F.mse_loss(ddp(x), y)
        with ddp.no_sync():
            loss.backward()
        out["all_reduces_backward_only_inside"] = len(calls)
        # An empty no_sync block before the forward changes nothing either.
        calls.clear()
        with ddp.no_sync():
            pass
        F.mse_loss(ddp(x), y).backward()
        out["all_reduces_after_empty_block"] = len(calls)
    return out


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_accumulation:accumulation_main", WORLD)


@pytest.mark.slow
def test_no_sync_skips_the_all_reduce_until_the_last_micro_batch(ranks):
    for r in ranks:
        assert r["all_reduces_per_backward"][:ACCUM - 1] == [0] * (ACCUM - 1)
        assert r["all_reduces_per_backward"][-1] >= 1
        assert r["all_reduces_without_no_sync"] >= ACCUM


@pytest.mark.slow
def test_no_sync_gives_the_same_gradient_as_syncing_every_time(ranks):
    for r in ranks:
        torch.testing.assert_close(r["accumulated_with_no_sync"], r["accumulated_without_no_sync"])


@pytest.mark.slow
def test_inside_no_sync_grad_holds_the_local_gradient(ranks):
    assert not torch.allclose(ranks[0]["grad_inside_no_sync"], ranks[1]["grad_inside_no_sync"])
    model = nn.Linear(4, 1)
    model.load_state_dict(ranks[0]["start"])
    x, y = micro_batch(0, 0)
    (F.mse_loss(model(x), y) / ACCUM).backward()
    torch.testing.assert_close(ranks[0]["grad_inside_no_sync"], model.weight.grad)


@pytest.mark.slow
def test_dividing_the_loss_by_the_accumulation_steps_gives_the_large_batch_mean(ranks):
    model = nn.Linear(4, 1)
    model.load_state_dict(ranks[0]["start"])
    batches = [micro_batch(r, s) for r in range(WORLD) for s in range(ACCUM)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.mse_loss(model(x), y).backward()  # one process, the whole WORLD x ACCUM x MICRO batch
    torch.testing.assert_close(ranks[0]["accumulated_with_no_sync"], model.weight.grad)


@pytest.mark.slow
def test_the_forward_must_run_inside_no_sync(ranks):
    for r in ranks:
        assert r["all_reduces_backward_only_inside"] >= 1
        assert r["all_reduces_after_empty_block"] >= 1
