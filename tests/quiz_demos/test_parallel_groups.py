"""Demonstrations for the quiz topic 'parallel-groups' (grader/quiz/bank/parallel-groups.toml).

Process groups made by hand for a 2-D layout: what new_group gives members and non-members, how
groups are named, a collective on a group the rank is not in, new_subgroups_by_enumeration, groups
made by their members alone, group ranks against global ranks, the default group, DistributedSampler
over the data-parallel ranks, which gradients tensor-parallel peers share, and what DDP does to
tensor-parallel shards with and without the data-parallel group. Four gloo ranks on CPU, one world
(module fixture); the sampler needs no process group.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from quiz_demos.world import run_world

pytestmark = pytest.mark.slow


def groups_main(ctx) -> dict:
    with ctx.group():
        return groups_observations(ctx.rank, ctx.world_size)


def groups_observations(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    out = {}
    # Every rank makes every group of a dp 2 x tp 2 grid, rows (tensor-parallel) first.
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    other_row = rows[1 - rank // 2]
    mine = rows[rank // 2]
    out["non_member_is_placeholder"] = other_row is dist.GroupMember.NON_GROUP_MEMBER
    out["rank_in_other_row"] = dist.get_rank(other_row)
    out["names"] = {"row": mine.group_name, "column": columns[rank % 2].group_name}

    # Group ranks against global ranks.
    out["rank_in_row"] = dist.get_rank(mine)
    out["global_of_row_rank_0"] = dist.get_global_rank(mine, 0)
    out["row_ranks"] = dist.get_process_group_ranks(mine)

    # A collective on a group this rank is not in.
    t = torch.tensor([float(rank + 1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = dist.all_reduce(t, group=other_row)
    out["not_member_all_reduce"] = {"value": t.item(), "returned": returned, "warned": bool(caught)}

    # The default group: group=None is the whole world.
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["default_sum"] = t.item()

    # new_subgroups_by_enumeration: this rank's subgroup and the list of all of them.
    current, subgroups = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    out["enumeration"] = {"current": dist.get_process_group_ranks(current), "count": len(subgroups),
                          "placeholders": sum(g is dist.GroupMember.NON_GROUP_MEMBER for g in subgroups)}

    # Groups made by their members alone, with use_local_synchronization=True.
    own = [rank - rank % 2, rank - rank % 2 + 1]
    local = dist.new_group(own, use_local_synchronization=True)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=local)
    out["local_sync"] = {"sum": t.item(), "name": local.group_name}

    # A tensor-parallel MLP (fc1 column-parallel: a block of its output features, rows of its weight; fc2
    # row-parallel: the matching columns; fc2's bias whole): which gradients the peers share.
    torch.manual_seed(0)
    fc1_w, fc1_b = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    fc2_w, fc2_b = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64)
    block = slice((rank % 2) * 4, (rank % 2 + 1) * 4)
    w1 = fc1_w[block].clone().requires_grad_(True)
    b1 = fc1_b[block].clone().requires_grad_(True)
    w2 = fc2_w[:, block].clone().requires_grad_(True)
    b2 = fc2_b.clone().requires_grad_(True)
    partial = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
    total = partial.detach().clone()
    dist.all_reduce(total, group=mine)
    out_full = partial + (total - partial.detach()) + b2  # the sum in forward, the identity in backward
    out_full.pow(2).sum().backward()
    out["grads"] = {"fc1_weight": w1.grad, "fc2_bias": b2.grad}

    # DDP around this rank's tensor-parallel shard (its value names its tensor-parallel rank), built
    # without a group and with the data-parallel column: what each rank holds after construction.
    from torch.nn.parallel import DistributedDataParallel

    held = {}
    for label, group in (("default_group", None), ("dp_group", columns[rank % 2])):
        shard = torch.nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            shard.weight.fill_(float(rank % 2 + 1))
        DistributedDataParallel(shard, process_group=group)
        held[label] = shard.weight.detach().clone()
    out["ddp_shards"] = held
    return out


@pytest.fixture(scope="module")
def groups(session):
    return run_world(session, "quiz_demos.test_parallel_groups:groups_main", 4, timeout_s=180)


def test_a_non_member_gets_a_placeholder_and_rank_minus_one(groups):
    for seen in groups:
        assert seen["non_member_is_placeholder"] is True
        assert seen["rank_in_other_row"] == -1


def test_groups_are_named_by_the_order_they_are_made_in(groups):
    # Four groups made by every rank, in the same order: the rows are the 1st and 2nd, the columns the
    # 3rd and 4th, whatever the rank (the default group is group 0).
    for rank, seen in enumerate(groups):
        assert seen["names"] == {"row": str(1 + rank // 2), "column": str(3 + rank % 2)}


def test_group_ranks_and_global_ranks(groups):
    for rank, seen in enumerate(groups):
        assert seen["rank_in_row"] == rank % 2
        assert seen["global_of_row_rank_0"] == rank - rank % 2
        assert seen["row_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]


def test_a_collective_on_a_group_the_rank_is_not_in_does_nothing(groups):
    for rank, seen in enumerate(groups):
        assert seen["not_member_all_reduce"] == {"value": float(rank + 1), "returned": None, "warned": True}


def test_the_default_group_is_the_whole_world(groups):
    assert [seen["default_sum"] for seen in groups] == [10.0] * 4


def test_new_subgroups_by_enumeration_returns_this_ranks_subgroup_and_all_of_them(groups):
    for rank, seen in enumerate(groups):
        assert seen["enumeration"] == {"current": [rank % 2, rank % 2 + 2], "count": 2, "placeholders": 1}


def test_members_alone_make_a_group_with_local_synchronization(groups):
    for rank, seen in enumerate(groups):
        assert seen["local_sync"]["sum"] == (3.0 if rank < 2 else 7.0)
        assert not seen["local_sync"]["name"].isdigit()  # named from its ranks, not by a counter
    assert groups[0]["local_sync"]["name"] == groups[1]["local_sync"]["name"] != groups[2]["local_sync"]["name"]


def test_ddp_without_a_group_gives_every_rank_rank_0s_shard(groups):
    for rank, seen in enumerate(groups):
        assert torch.equal(seen["ddp_shards"]["default_group"], torch.full((2, 4), 1.0))  # rank 0's shard
        assert torch.equal(seen["ddp_shards"]["dp_group"], torch.full((2, 4), float(rank % 2 + 1)))  # its own


def test_tensor_peers_share_the_replicated_bias_gradient_not_the_block_gradients(groups):
    for first in (0, 2):
        a, b = groups[first]["grads"], groups[first + 1]["grads"]
        assert torch.equal(a["fc2_bias"], b["fc2_bias"])
        assert not torch.allclose(a["fc1_weight"], b["fc1_weight"])


def test_a_sampler_over_the_data_parallel_ranks_gives_tensor_peers_one_shard():
    from torch.utils.data.distributed import DistributedSampler

    dataset = list(range(8))
    tp_size, dp_size = 2, 2
    shards = {rank: list(DistributedSampler(dataset, num_replicas=dp_size, rank=rank // tp_size, shuffle=False))
              for rank in range(4)}
    assert shards[0] == shards[1] == [0, 2, 4, 6] and shards[2] == shards[3] == [1, 3, 5, 7]
    by_global_rank = [list(DistributedSampler(dataset, num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert by_global_rank[0] != by_global_rank[1]  # tensor peers on different rows
