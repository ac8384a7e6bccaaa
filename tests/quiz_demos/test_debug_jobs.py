"""Topic debug-jobs: the symptoms of the debugging track (exercises 21-27), each claim run on two
gloo ranks (one driver, run once for the module) or, where no process is needed, in the test."""

from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, Subset, TensorDataset

from quiz_demos.world import run_world

HANG_S = 3  # how long the staged monitored_barrier waits for a rank that never comes


def attempt(fn) -> dict:
    """Run ``fn``; what it raised (type and message) and how long it took."""
    started = time.monotonic()
    try:
        fn()
        error = None
    except Exception as exc:  # the observation is the error itself
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - started}


def sgd_step(ddp, opt, x, y) -> None:
    opt.zero_grad()
    F.mse_loss(ddp(x), y).backward()
    opt.step()


# --- in each rank ------------------------------------------------------------------------------


class AuxNet(nn.Module):
    """A body with a main head and an auxiliary head; ``aux_mode`` says how forward runs the aux head."""

    def __init__(self, aux_mode: str = "grad"):
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.aux_mode = aux_mode

    def forward(self, x):
        h = torch.relu(self.body(x))
        if self.aux_mode == "no_grad":
            with torch.no_grad():
                aux = self.aux(h)
            return self.head(h), aux
        return self.head(h), self.aux(h)


def aux_fixes(DDP) -> dict:
    """Two training iterations with the auxiliary loss left out in several ways (default DDP options)."""
    out = {}

    def two_iterations(aux_mode, loss_of, keep_aux_grad=False):
        ddp = DDP(AuxNet(aux_mode))
        for _ in range(2):
            main, aux = ddp(torch.randn(4, 4))
            loss_of(main, aux).backward()
        if keep_aux_grad:
            out["aux_grad"] = ddp.module.aux.weight.grad.clone()

    out["left_out"] = attempt(lambda: two_iterations("grad", lambda m, a: m.sum()))
    out["weight_zero"] = attempt(lambda: two_iterations("grad", lambda m, a: m.sum() + 0.0 * a.sum(), True))
    out["detached"] = attempt(lambda: two_iterations("grad", lambda m, a: m.sum() + 0.1 * a.detach().sum()))
    out["under_no_grad"] = attempt(lambda: two_iterations("no_grad", lambda m, a: m.sum() + 0.1 * a.sum()))
    return out


def plateau_per_rank(ctx, DDP) -> dict:
    """Each rank steps ReduceLROnPlateau with the loss of its own validation shard."""
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    shard_losses = [1.0, 0.9 if ctx.rank == 0 else 1.1]  # epoch 1: rank 0's shard improved, rank 1's did not
    for val_loss in shard_losses:
        sgd_step(ddp, opt, torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
        scheduler.step(val_loss)
    before = ddp.module.weight.detach().clone()
    sgd_step(ddp, opt, torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    return {"lr": opt.param_groups[0]["lr"], "before": before, "after": ddp.module.weight.detach().clone()}


def loaded_after_wrapping(ctx, DDP) -> dict:
    """Rank 0 alone changes its weights after DDP was built (as a late load_state_dict would); plain SGD."""
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(4, 1))
    if ctx.rank == 0:
        with torch.no_grad():
            ddp.module.weight.add_(1.0)
    start = ddp.module.weight.detach().clone()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(200 + ctx.rank)
    ends = []
    for _ in range(3):
        sgd_step(ddp, opt, torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
        ends.append(ddp.module.weight.detach().clone())
    return {"start": start, "ends": ends}


def bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def a_checkpoint() -> dict:
    """An earlier run's checkpoint (the same in every process): weights, SGD momentum, BatchNorm stats, epoch."""
    torch.manual_seed(7)
    net = bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(net(torch.randn(8, 4, generator=g) + 3.0), torch.randn(8, 1, generator=g)).backward()
        opt.step()
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 4}


def rest_of_checkpoint(ctx, DDP) -> dict:
    """Rank 0 alone loads a checkpoint after wrapping, then broadcasts every parameter; one training step."""
    import torch.distributed as dist

    torch.manual_seed(0)
    net = bn_net()
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    start_epoch = 0
    checkpoint = a_checkpoint()
    if ctx.rank == 0:
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
    with torch.no_grad():
        for p in net.parameters():
            dist.broadcast(p, src=0)
    seen = {}

    def look(module, args):  # runs inside DDP's forward, after what DDP does before the module's forward
        seen.setdefault("running_mean", net[1].running_mean.clone())

    net.register_forward_pre_hook(look)
    g = torch.Generator().manual_seed(300 + ctx.rank)
    opt.zero_grad()
    F.mse_loss(ddp(torch.randn(8, 4, generator=g)), torch.randn(8, 1, generator=g)).backward()
    return {
        "momentum_buffers": sum(1 for state in opt.state.values() if "momentum_buffer" in state),
        "start_epoch": start_epoch,
        "running_mean_at_forward": seen["running_mean"],
        "checkpoint_running_mean": checkpoint["model"]["1.running_mean"],
        "grads": [p.grad.clone() for p in net.parameters()],
    }


def accumulate_one_step(ddp, forward_inside: bool, accum: int = 4) -> None:
    """One optimizer step's worth of micro-batches, the first accum - 1 backward passes in no_sync()."""
    import contextlib

    for i in range(accum):
        last = i == accum - 1
        context = contextlib.nullcontext() if last else ddp.no_sync()
        x, y = torch.randn(2, 4), torch.randn(2, 1)
        if forward_inside:
            with context:
                (F.mse_loss(ddp(x), y) / accum).backward()
        else:
            loss = F.mse_loss(ddp(x), y) / accum
            with context:
                loss.backward()


def counting_syncs(DDP) -> dict:
    """Ways of counting DDP's gradient all-reduces over one accumulated step, forward outside or inside no_sync."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for forward_inside in (False, True):
        key = "inside" if forward_inside else "outside"
        # A comm hook and a tensor hook that count their calls.
        ddp = DDP(nn.Linear(4, 1))
        calls = Counter()

        def hook(state, bucket):
            calls["comm_hook"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        ddp.module.weight.register_hook(lambda grad: calls.update(["tensor_hook"]))
        for _ in range(2):  # DDP rebuilds its buckets after the first iteration: count the second
            calls.clear()
            accumulate_one_step(ddp, forward_inside)
        # No hook: the profiler's trace, and a wrapper around the Python all_reduce.
        plain = DDP(nn.Linear(4, 1))
        accumulate_one_step(plain, forward_inside)
        python_calls = []
        original = dist.all_reduce
        dist.all_reduce = lambda *args, **kwargs: (python_calls.append(1), original(*args, **kwargs))[1]
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                accumulate_one_step(plain, forward_inside)
        finally:
            dist.all_reduce = original
        out[key] = {"comm_hook": calls["comm_hook"], "tensor_hook": calls["tensor_hook"],
                    "profiler": sum(1 for e in prof.events() if e.name == "gloo:all_reduce"),
                    "python_all_reduce": len(python_calls)}
    return out


def monitored_barrier_missing_rank(ctx) -> dict:
    """Rank 1 never reaches the barrier (it is busy elsewhere); rank 0 waits in monitored_barrier."""
    import torch.distributed as dist

    # The group is made with a long timeout: the ranks reach this point at different times.
    group = dist.new_group(timeout=timedelta(seconds=120))
    if ctx.rank == 0:
        return attempt(lambda: dist.monitored_barrier(group=group, timeout=timedelta(seconds=HANG_S)))
    return attempt(lambda: time.sleep(HANG_S + 2))  # stuck elsewhere, still in the group


def debug_jobs_main(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(ctx.rank)
    with ctx.group():
        return {
            "aux": aux_fixes(DDP),
            "plateau": plateau_per_rank(ctx, DDP),
            "late_load": loaded_after_wrapping(ctx, DDP),
            "rest": rest_of_checkpoint(ctx, DDP),
            "syncs": counting_syncs(DDP),
            "monitored": monitored_barrier_missing_rank(ctx),  # last: rank 1 goes on without rank 0
        }


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_debug_jobs:debug_jobs_main", 2)


# --- exercise 21: a rank that never comes ----------------------------------------------------


@pytest.mark.slow
def test_monitored_barrier_names_the_rank_that_did_not_arrive(ranks):
    got = ranks[0]["monitored"]
    assert got["error"] and "Rank 1 failed to pass monitoredBarrier" in got["error"], got
    assert got["seconds"] >= HANG_S * 0.9
    assert ranks[1]["monitored"]["error"] is None


# --- exercise 22: an auxiliary loss left out -------------------------------------------------


@pytest.mark.slow
def test_an_aux_loss_weighted_zero_keeps_every_parameter_used(ranks):
    aux = ranks[0]["aux"]
    expected = "Expected to have finished reduction in the prior iteration"
    assert aux["weight_zero"]["error"] is None
    assert torch.count_nonzero(aux["aux_grad"]) == 0  # a gradient of zeros, all-reduced
    for way in ("left_out", "detached", "under_no_grad"):
        assert aux[way]["error"] and expected in aux[way]["error"], (way, aux[way])


# --- exercise 23: shards by hand --------------------------------------------------------------


def batches_per_rank(n: int, world_size: int, batch_size: int = 8) -> list[int]:
    data = TensorDataset(torch.arange(n))
    return [len(DataLoader(Subset(data, list(range(rank, n, world_size))), batch_size=batch_size))
            for rank in range(world_size)]


def test_strided_shards_of_73_samples_give_uneven_batches_on_3_ranks():
    assert batches_per_rank(73, 2) == [5, 5]  # shards of 37 and 36 samples
    assert batches_per_rank(73, 3) == [4, 3, 3]  # 25, 24, 24
    assert batches_per_rank(73, 4) == [3, 3, 3, 3]  # 19, 18, 18, 18
    data = TensorDataset(torch.arange(73))
    for world_size in (2, 3, 4):  # DistributedSampler pads: the same count on every rank
        counts = {len(DataLoader(data, batch_size=8, sampler=DistributedSampler(data, world_size, rank)))
                  for rank in range(world_size)}
        assert len(counts) == 1


# --- exercise 24: a scheduler per rank --------------------------------------------------------


@pytest.mark.slow
def test_plateau_scheduler_on_each_shard_splits_the_learning_rates_and_the_weights(ranks):
    lrs = [r["plateau"]["lr"] for r in ranks]
    assert lrs == [0.1, 0.05]
    assert torch.equal(ranks[0]["plateau"]["before"], ranks[1]["plateau"]["before"])
    assert not torch.allclose(ranks[0]["plateau"]["after"], ranks[1]["plateau"]["after"])


# --- exercise 25: the loader's own sampler ----------------------------------------------------


def test_with_a_batch_sampler_the_loaders_sampler_is_a_placeholder():
    data = TensorDataset(torch.arange(16))
    distributed = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True)
    loader = DataLoader(data, batch_sampler=BatchSampler(distributed, batch_size=4, drop_last=False))
    assert type(loader.sampler) is SequentialSampler
    assert not hasattr(loader.sampler, "set_epoch")
    assert loader.batch_sampler.sampler is distributed

    def first_batch(epoch=None):
        if epoch is not None:
            loader.batch_sampler.sampler.set_epoch(epoch)
        return next(iter(loader))[0].tolist()

    assert first_batch() == first_batch()  # no set_epoch: the same order again
    assert first_batch(0) != first_batch(1)


# --- exercise 26: counting the all-reduces ----------------------------------------------------


@pytest.mark.slow
def test_counting_ddp_all_reduces(ranks):
    syncs = ranks[0]["syncs"]
    assert syncs["outside"]["comm_hook"] == 4 and syncs["inside"]["comm_hook"] == 1
    assert syncs["outside"]["profiler"] == 4 and syncs["inside"]["profiler"] == 1
    assert syncs["outside"]["tensor_hook"] == syncs["inside"]["tensor_hook"] == 4  # one per backward
    assert syncs["outside"]["python_all_reduce"] == syncs["inside"]["python_all_reduce"] == 0


# --- exercise 27: a checkpoint that rank 0 alone loaded ---------------------------------------


@pytest.mark.slow
def test_weights_changed_on_rank0_after_wrapping_keep_their_gap(ranks):
    gap = ranks[0]["late_load"]["start"] - ranks[1]["late_load"]["start"]
    assert torch.allclose(gap, torch.ones_like(gap))
    for end0, end1 in zip(ranks[0]["late_load"]["ends"], ranks[1]["late_load"]["ends"]):
        assert torch.allclose(end0 - end1, gap, atol=1e-6)


@pytest.mark.slow
def test_after_broadcasting_the_parameters_the_rest_of_the_checkpoint_still_differs(ranks):
    rest = [r["rest"] for r in ranks]
    assert rest[0]["momentum_buffers"] == 6 and rest[1]["momentum_buffers"] == 0
    assert (rest[0]["start_epoch"], rest[1]["start_epoch"]) == (5, 0)
    # DDP broadcast rank 0's BatchNorm statistics before the forward: the same on both ranks.
    assert torch.count_nonzero(rest[0]["checkpoint_running_mean"]) > 0
    for r in rest:
        assert torch.equal(r["running_mean_at_forward"], rest[0]["checkpoint_running_mean"])
    for g0, g1 in zip(rest[0]["grads"], rest[1]["grads"]):
        assert torch.allclose(g0, g1)
