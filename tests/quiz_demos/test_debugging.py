"""Topic debugging: which mismatches hang (here: time out after a few seconds), which do not, and
what reports them (two gloo ranks; each hang is staged on its own group with a short timeout)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quiz_demos.world import run_world

HANG_S = 4  # the timeout of the groups where a hang is staged


def bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def attempt(fn) -> dict:
    """Run ``fn``; what it raised (type and message) and how long it took."""
    started = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:  # the observation is the error itself
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - started}


def train_steps(ddp, steps: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(torch.randn(4, 4)), torch.randn(4, 1)).backward()
        opt.step()


def eval_then_train(ctx, DDP) -> dict:
    """Rank 0 alone evaluates through the DDP wrapper under no_grad, then both train."""
    ddp = DDP(bn_net())
    # Two steps first: DDP rebuilds its buckets at the second training forward (one more
    # collective), as it has long done by the end of a real epoch.
    train_steps(ddp, 2)

    def evaluate_then_train():
        if ctx.rank == 0:
            ddp.eval()
            with torch.no_grad():
                for _ in range(3):
                    ddp(torch.randn(4, 4))
            ddp.train()
        train_steps(ddp, 2)

    return attempt(evaluate_then_train)


def staged_group():
    """A new group whose collectives time out after HANG_S. It is made with a long timeout and then
    shortened: making a group waits for every rank, and the ranks reach it seconds apart (after a
    staged hang on one rank only)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    group = dist.new_group(timeout=timedelta(seconds=120))
    _set_pg_timeout(timedelta(seconds=HANG_S), group)
    return group


def guarded_collective(ctx) -> dict:
    import torch.distributed as dist

    group = staged_group()
    return attempt(lambda: dist.all_reduce(torch.ones(1), group=group) if ctx.rank == 0 else None)


def uneven_batches(ctx, DDP) -> dict:
    group = staged_group()
    ddp = DDP(nn.Linear(4, 1), process_group=group)
    return attempt(lambda: train_steps(ddp, 3 if ctx.rank == 0 else 2))


def with_join(ctx, DDP) -> dict:
    ddp = DDP(nn.Linear(4, 1))
    batches = 5 if ctx.rank == 0 else 3

    def run():
        with ddp.join():
            train_steps(ddp, batches)

    return attempt(run)


def detail_checks(ctx) -> dict:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (set as torch reads it) on a new group; mismatched shapes."""
    import os

    import torch.distributed as dist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        # The wrapper DETAIL adds reports the mismatch at once; the long timeout only lets the
        # ranks reach this point seconds apart.
        group = dist.new_group(timeout=timedelta(seconds=120))
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
        dist.set_debug_level_from_env()
    return attempt(lambda: dist.all_reduce(torch.ones(2 + ctx.rank), group=group))


def unused_causes(ctx, DDP) -> dict:
    class TwoOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.a(x), self.b(x)

    class AuxHead(nn.Module):
        """An auxiliary head that forward uses only in training mode (as Inception's)."""

        def __init__(self):
            super().__init__()
            self.body, self.head, self.aux = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            h = self.body(x)
            return self.head(h) + self.aux(h) if self.training else self.head(h)

    def two_iterations(ddp, loss_of):
        for _ in range(2):
            loss_of(ddp(torch.randn(2, 4))).backward()

    out = {}
    out["one_output_in_loss"] = attempt(lambda: two_iterations(DDP(TwoOutputs()), lambda o: o[0].sum()))
    out["aux_head_in_eval"] = attempt(lambda: two_iterations(DDP(AuxHead()).eval(), lambda o: o.sum()))
    out["aux_head_in_train"] = attempt(lambda: two_iterations(DDP(AuxHead()), lambda o: o.sum()))
    out["dropout_in_eval"] = attempt(
        lambda: two_iterations(DDP(nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.Linear(4, 1))).eval(),
                               lambda o: o.sum()))
    return out


def debugging_main(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(ctx.rank)
    with ctx.group():
        return {
            "eval": eval_then_train(ctx, DDP),
            "guarded": guarded_collective(ctx),
            "uneven": uneven_batches(ctx, DDP),
            "join": with_join(ctx, DDP),
            "detail": detail_checks(ctx),
            "unused": unused_causes(ctx, DDP),
        }


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_debugging:debugging_main", 2)


@pytest.mark.slow
def test_rank0_evaluating_alone_under_no_grad_then_training_finishes(ranks):
    assert [r["eval"]["error"] for r in ranks] == [None, None]


@pytest.mark.slow
def test_a_collective_only_rank0_calls_waits_until_the_timeout(ranks):
    guarded = [r["guarded"] for r in ranks]
    assert guarded[1]["error"] is None
    assert guarded[0]["error"] and guarded[0]["seconds"] >= HANG_S * 0.9


@pytest.mark.slow
def test_an_extra_batch_on_one_rank_waits_for_a_partner_that_never_comes(ranks):
    assert ranks[1]["uneven"]["error"] is None
    assert ranks[0]["uneven"]["error"] and ranks[0]["uneven"]["seconds"] >= HANG_S * 0.9


@pytest.mark.slow
def test_join_lets_ranks_with_fewer_batches_finish_together(ranks):
    assert [r["join"]["error"] for r in ranks] == [None, None]


@pytest.mark.slow
def test_detail_debug_reports_mismatched_shapes(ranks):
    for r in ranks:
        assert r["detail"]["error"] and "shape" in r["detail"]["error"].lower(), r["detail"]


@pytest.mark.slow
def test_unused_parameter_causes(ranks):
    unused = ranks[0]["unused"]
    expected = "Expected to have finished reduction in the prior iteration"
    assert expected in unused["one_output_in_loss"]["error"]
    assert expected in unused["aux_head_in_eval"]["error"]
    assert unused["aux_head_in_train"]["error"] is None
    assert unused["dropout_in_eval"]["error"] is None  # eval mode alone leaves every parameter used


def test_default_timeout_is_30_minutes():
    from torch.distributed import constants
    from torch.distributed.distributed_c10d import _get_default_timeout

    assert constants.default_pg_timeout == timedelta(minutes=30)
    assert _get_default_timeout("gloo") == timedelta(minutes=30)
