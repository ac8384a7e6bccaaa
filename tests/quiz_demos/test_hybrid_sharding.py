"""Demonstrations for the hybrid-sharding quiz topic, run on the installed torch.

One process: AdamW's update after the step count is reset (the moments kept), and what an optimizer steps
after load_state_dict(assign=True). One world of four gloo ranks (run once for the module, through the
grader's harness) shards a small model with fully_shard on a (2, 2) mesh named ("replicate", "shard") and on
a 1-D mesh of the four ranks, records each parameter's placement and local rows, and runs one training step
on the 2-D mesh with every collective's group and bytes recorded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from quiz_demos.world import run_world
from torch import nn

WORLD = 4


# --- one process ------------------------------------------------------------------------------------


def _adamw_steps(model: nn.Module, optimizer, batches) -> None:
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_replica_whose_step_count_restarts_updates_its_parameters_differently():
    """Two copies of one model and AdamW state; the second's step counts set back to 0, as a recovery that sent
    the moments but not the steps leaves them. The same batch then moves the two copies apart."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(6)]
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _adamw_steps(model, optimizer, batches[:5])
    twin = nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.01)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # the step tensors themselves are shared
    for state in twin_optimizer.state.values():
        state["step"].zero_()
    _adamw_steps(model, optimizer, batches[5:])
    _adamw_steps(twin, twin_optimizer, batches[5:])
    assert not torch.equal(model.weight, twin.weight)
    assert float(optimizer.state[model.weight]["step"]) == 6 and float(twin_optimizer.state[twin.weight]["step"]) == 1
    # With the step count sent too, the copies stay equal bit for bit.
    twin.load_state_dict(model.state_dict())
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _adamw_steps(model, optimizer, batches[:1])
    _adamw_steps(twin, twin_optimizer, batches[:1])
    assert torch.equal(model.weight, twin.weight)


def test_after_load_state_dict_with_assign_the_optimizer_steps_the_old_parameters():
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    old = model.weight
    received = {name: value.detach().clone() + 1 for name, value in model.state_dict().items()}
    model.load_state_dict(received, assign=True)
    assert model.weight is not old and torch.equal(model.weight, received["weight"])
    assert optimizer.param_groups[0]["params"][0] is old
    before = model.weight.detach().clone()
    nn.functional.mse_loss(model(torch.randn(4, 3)), torch.randn(4, 2)).backward()
    optimizer.step()
    assert torch.equal(model.weight, before)  # the model's new weight never moves
    assert old.grad is None and model.weight.grad is not None  # its gradient went where no optimizer looks


# --- one world of four ranks --------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 4)  # every dim 0 divisible by 4: no padding

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def _shard(mesh) -> _Net:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _observe(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from grader.rank import probes

    hybrid_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat_mesh = init_device_mesh("cpu", (WORLD,))
    hybrid, flat = _shard(hybrid_mesh), _shard(flat_mesh)
    weight = dict(hybrid.named_parameters())["blocks.0.weight"]
    obs = {"placements": [repr(p) for p in weight.placements], "hybrid_rows": weight.to_local().shape[0],
           "flat_rows": dict(flat.named_parameters())["blocks.0.weight"].to_local().shape[0],
           "rows": weight.shape[0], "coordinate": hybrid_mesh.get_coordinate(),
           "hybrid_local_elements": sum(p.to_local().numel() for p in hybrid.parameters()),
           "flat_local_elements": sum(p.to_local().numel() for p in flat.parameters()),
           "elements": sum(p.numel() for p in hybrid.parameters())}
    events: list = []
    with probes.watch_groups(events):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
        hybrid(x).square().mean().backward()
    obs["events"] = [dict(e) for e in events]
    obs["block_gradient_bytes"] = 4 * sum(p.numel() for p in _Net().blocks[0].parameters())
    return obs


def observe_main(ctx) -> dict:
    with ctx.group():
        return _observe(ctx.rank)


@pytest.fixture(scope="module")
def observed(session) -> list[dict]:
    return run_world(session, "quiz_demos.test_hybrid_sharding:observe_main", WORLD)


@pytest.mark.slow
def test_a_2d_mesh_replicates_over_dim_0_and_shards_each_parameter_over_dim_1(observed):
    for rank, obs in enumerate(observed):
        assert obs["placements"] == ["Replicate()", "Shard(dim=0)"]
        assert list(obs["coordinate"]) == [rank // 2, rank % 2]
        assert obs["hybrid_rows"] == obs["rows"] // 2  # 1 / shards of the rows, the same in both replicas
        assert obs["flat_rows"] == obs["rows"] // WORLD


@pytest.mark.slow
def test_hybrid_sharding_holds_replicas_times_what_fsdp_over_every_rank_holds(observed):
    for obs in observed:
        assert obs["hybrid_local_elements"] == obs["elements"] // 2
        assert obs["hybrid_local_elements"] == 2 * obs["flat_local_elements"]


@pytest.mark.slow
def test_gradients_are_reduce_scattered_in_the_replica_then_all_reduced_across_replicas(observed):
    for rank, obs in enumerate(observed):
        row, column = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        ops = [(e["op"], e["group"]) for e in obs["events"] if e["op"] in ("reduce_scatter_single", "all_reduce")]
        assert ops and ops[0] == ("reduce_scatter_single", row) and ops[1] == ("all_reduce", column)
        assert {op for op, _ in ops} == {"reduce_scatter_single", "all_reduce"}
        assert all(group == (row if op == "reduce_scatter_single" else column) for op, group in ops)
        gathers = {tuple(e["group"]) for e in obs["events"] if e["op"] == "all_gather_single"}
        assert gathers == {tuple(row)}


@pytest.mark.slow
def test_the_all_reduce_across_replicas_carries_one_shard_of_the_gradient(observed):
    for obs in observed:
        reductions = [e for e in obs["events"] if e["op"] in ("reduce_scatter_single", "all_reduce")]
        # blocks.1 is reduced first (backward runs the last block first): its reduce-scatter takes the unit's
        # whole gradient, the all-reduce that follows 1/2 of it (one shard of 2).
        scatter, reduce = reductions[0], reductions[1]
        assert scatter["bytes"] == obs["block_gradient_bytes"]
        assert reduce["bytes"] == obs["block_gradient_bytes"] // 2
