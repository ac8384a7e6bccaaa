"""Demonstrations for the quiz topic 'fsdp' (grader/quiz/bank/fsdp.toml).

FSDP2 (``fully_shard``) and DeviceMesh on two gloo ranks on CPU, in one world (module fixture).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quiz_demos.world import run_world

pytestmark = pytest.mark.slow


def _two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))


def _kinds(model):
    return {name: type(p).__name__ for name, p in model.named_parameters()}


def fsdp_main(ctx) -> dict:
    with ctx.group():
        return fsdp_observations(ctx.rank, ctx.world_size)


def fsdp_observations(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(10 + rank)
    x = torch.randn(2, 4)

    # Bottom-up: the first layer is its own group, the root group takes what is left (layer 1).
    model = _two_layers()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    weight = model[0].weight
    out["class"] = type(model).__name__
    out["is_fsdp_module"] = isinstance(model, FSDPModule)
    out["has_no_sync"] = hasattr(model, "no_sync")
    out["placements"] = [repr(p) for p in weight.placements]
    out["local_shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    y = model(x)
    out["after_forward_default"] = _kinds(model)         # reshard_after_forward=None
    y.sum().backward()
    out["grads"] = {n: (type(p.grad).__name__, tuple(p.grad.to_local().shape)) for n, p in model.named_parameters()}
    out["after_backward"] = _kinds(model)

    for flag in (True, False):
        m = _two_layers()
        fully_shard(m[0], mesh=mesh, reshard_after_forward=flag)
        fully_shard(m, mesh=mesh)
        m(x)
        out[f"layer0_after_forward_{flag}"] = type(m[0].weight).__name__

    # Accumulating without reduce-scatter: FSDP2 has set_requires_gradient_sync, not no_sync().
    m = _two_layers()
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    m.set_requires_gradient_sync(False)
    m(x).sum().backward()
    out["grads_without_sync"] = [p.grad is None for p in m.parameters()]

    # Same update as one process on the combined batch (mean loss, equal per-rank batches).
    m = _two_layers()
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    nn.functional.mse_loss(m(x), torch.zeros(2, 3)).backward()
    opt.step()
    batches = [torch.empty_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(batches, x)
    ref = _two_layers()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    nn.functional.mse_loss(ref(torch.cat(batches)), torch.zeros(2 * world_size, 3)).backward()
    ref_opt.step()
    out["gap_to_single_process"] = max((p.full_tensor() - r).abs().max().item()
                                       for p, r in zip(m.parameters(), ref.parameters()))

    # HSDP: a 2-D mesh (replicate, shard). Here 2 replicas of a 1-way shard.
    mesh2d = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    out["mesh_sizes"] = {name: mesh2d[name].size() for name in ("replicate", "shard")}
    hsdp = nn.Linear(4, 4)
    fully_shard(hsdp, mesh=mesh2d)
    out["hsdp_placements"] = [repr(p) for p in hsdp.weight.placements]
    hsdp(x).sum().backward()
    grad = hsdp.weight.grad.to_local().contiguous()
    both = [torch.empty_like(grad) for _ in range(world_size)]
    torch.distributed.all_gather(both, grad)
    out["hsdp_replica_grads_equal"] = torch.equal(both[0], both[1])
    return out


@pytest.fixture(scope="module")
def fsdp(session):
    return run_world(session, "quiz_demos.test_fsdp:fsdp_main", 2, timeout_s=180)


def test_fully_shard_turns_parameters_into_dim0_dtensor_shards(fsdp):
    for rank, seen in enumerate(fsdp):
        assert seen["placements"] == ["Shard(dim=0)"], f"rank {rank}"
        assert seen["local_shapes"]["0.weight"] == (3, 4), f"rank {rank}"
    # Uneven dim 0 (3 rows over 2 ranks): torch.chunk-style, 2 rows then 1.
    assert [r["local_shapes"]["1.weight"] for r in fsdp] == [(2, 6), (1, 6)]


def test_fully_shard_swaps_the_class_and_has_no_no_sync(fsdp):
    for seen in fsdp:
        assert seen["class"] == "FSDPSequential" and seen["is_fsdp_module"]
        assert not seen["has_no_sync"]


def test_reshard_after_forward_default_reshards_non_root_keeps_root(fsdp):
    for seen in fsdp:
        assert seen["after_forward_default"] == {"0.weight": "DTensor", "0.bias": "DTensor",
                                                 "1.weight": "Parameter", "1.bias": "Parameter"}
        assert set(seen["after_backward"].values()) == {"DTensor"}


def test_reshard_after_forward_false_keeps_the_unsharded_parameter(fsdp):
    for seen in fsdp:
        assert seen["layer0_after_forward_True"] == "DTensor"
        assert seen["layer0_after_forward_False"] == "Parameter"


def test_gradients_are_reduce_scattered_into_shards(fsdp):
    for seen in fsdp:
        assert seen["grads"]["0.weight"] == ("DTensor", (3, 4))


def test_set_requires_gradient_sync_false_skips_the_sharded_gradient(fsdp):
    for seen in fsdp:
        assert all(seen["grads_without_sync"])


def test_fsdp_step_matches_one_process_on_the_combined_batch(fsdp):
    for rank, seen in enumerate(fsdp):
        assert seen["gap_to_single_process"] < 1e-6, f"rank {rank}"


def test_hsdp_on_a_2d_mesh_replicates_then_shards(fsdp):
    for seen in fsdp:
        assert seen["mesh_sizes"] == {"replicate": 2, "shard": 1}
        assert seen["hsdp_placements"] == ["Replicate()", "Shard(dim=0)"]
        assert seen["hsdp_replica_grads_equal"]
