"""Topic beyond: ZeroRedundancyOptimizer's sharded state, FSDP's sharded parameters, SyncBatchNorm
on CPU and how it is switched on (two gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quiz_demos.world import run_world


def zero_optimizer(ctx, DDP) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(ddp(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        opt.step()
    params = list(model.parameters())
    local = opt.optim.state  # the wrapped optimizer's state: only this rank's shard
    return {"params_with_state": [i for i, p in enumerate(params) if p in local],
            "params": [p.detach().clone() for p in params], "n_params": len(params)}


def fsdp_shards(ctx) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    layer = nn.Linear(8, 8, bias=False)
    full_weight = layer.weight.detach().clone()
    model = FSDP(layer, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.device("cpu"), use_orig_params=True)
    before = next(model.parameters()).detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    flat = next(model.parameters())
    return {"local_param_numel": flat.numel(), "local_grad_numel": flat.grad.numel() if flat.grad is not None else 0,
            "exp_avg_numel": opt.state[flat]["exp_avg"].numel(),
            "param_shape": list(flat.shape), "param_type": type(flat).__name__,
            "slice_before_step": before, "full_weight": full_weight}


def sync_batchnorm(ctx) -> dict:
    bn = nn.SyncBatchNorm(3)
    out = {}
    try:
        bn(torch.randn(4, 3))
        out["train_cpu"] = None
    except ValueError as exc:
        out["train_cpu"] = str(exc)
    bn.eval()
    out["eval_cpu_shape"] = list(bn(torch.randn(4, 3)).shape)  # no sync in eval mode: runs
    return out


def beyond_main(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(ctx.rank)
    with ctx.group():
        out = {"zero": zero_optimizer(ctx, DDP), "syncbn": sync_batchnorm(ctx)}
        out["fsdp"] = fsdp_shards(ctx)
        return out


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_beyond:beyond_main", 2)


@pytest.mark.slow
def test_zero_redundancy_optimizer_keeps_state_for_its_shard_only(ranks):
    shards = [set(r["zero"]["params_with_state"]) for r in ranks]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(ranks[0]["zero"]["n_params"]))
    for a, b in zip(ranks[0]["zero"]["params"], ranks[1]["zero"]["params"]):
        assert torch.equal(a, b)  # every replica is complete and equal after the step


@pytest.mark.slow
def test_fsdp_full_shard_keeps_a_shard_of_parameters_gradients_and_optimizer_state(ranks):
    for r in ranks:
        counts = {k: r["fsdp"][k] for k in ("local_param_numel", "local_grad_numel", "exp_avg_numel")}
        assert counts == {"local_param_numel": 32, "local_grad_numel": 32, "exp_avg_numel": 32}  # 64 / 2


@pytest.mark.slow
def test_fsdp1_keeps_a_flat_one_dimensional_slice_of_the_parameters(ranks):
    # Between iterations each rank's weight is a 1-D view of its half of the flattened (8, 8) weight.
    for r in ranks:
        assert r["fsdp"]["param_shape"] == [32] and r["fsdp"]["param_type"] == "Parameter"
    full = ranks[0]["fsdp"]["full_weight"]
    assert torch.equal(full, ranks[1]["fsdp"]["full_weight"])
    halves = [r["fsdp"]["slice_before_step"] for r in ranks]
    assert torch.equal(torch.cat(halves), full.flatten())     # rank 0: elements 0-31, rank 1: 32-63


@pytest.mark.slow
def test_sync_batchnorm_refuses_cpu_input_in_training(ranks):
    for r in ranks:
        assert "SyncBatchNorm expected input tensor to be on GPU" in r["syncbn"]["train_cpu"]
        assert r["syncbn"]["eval_cpu_shape"] == [4, 3]


def test_convert_sync_batchnorm_keeps_the_parameters_and_ddp_has_no_sync_bn_argument():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
        model[1].running_mean.fill_(0.5)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], nn.SyncBatchNorm)
    assert torch.equal(converted[1].weight, torch.full((4,), 2.0))
    assert torch.equal(converted[1].running_mean, torch.full((4,), 0.5))
    with pytest.raises(TypeError, match="sync_bn"):
        DDP(model, sync_bn=True)
