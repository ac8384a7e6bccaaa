"""Topic sampler: DistributedSampler's order, padding, truncation and split (no process group needed:
the sampler takes num_replicas and rank as arguments)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler


def shares(n: int, world: int, **kwargs) -> list[list[int]]:
    """Each rank's indices for one epoch of a dataset of ``n`` samples."""
    return [list(DistributedSampler(range(n), num_replicas=world, rank=r, **kwargs)) for r in range(world)]


def epoch_order(sampler: DistributedSampler, epoch: int | None) -> list[int]:
    if epoch is not None:
        sampler.set_epoch(epoch)
    return list(sampler)


def test_without_set_epoch_every_epoch_has_the_same_shuffled_order():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True)
    first, second = epoch_order(sampler, None), epoch_order(sampler, None)
    assert first == second and first != sorted(first)  # shuffled, but the same shuffle again
    assert epoch_order(sampler, 1) != first


def test_set_epoch_only_stores_the_epoch_and_the_order_follows_seed_plus_epoch():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0, seed=3)
    before = dict(vars(sampler))
    sampler.set_epoch(4)
    changed = {k for k in vars(sampler) if vars(sampler)[k] != before.get(k)}
    assert changed == {"epoch"}
    # The order is seed + epoch: seed 3 at epoch 4 is seed 5 at epoch 2.
    other = DistributedSampler(range(20), num_replicas=2, rank=0, seed=5)
    other.set_epoch(2)
    assert list(sampler) == list(other)


def test_padding_repeats_the_first_indices_so_every_rank_gets_the_same_count():
    per_rank = shares(10, 4, shuffle=False)
    assert [len(s) for s in per_rank] == [3, 3, 3, 3]
    seen = sorted(i for s in per_rank for i in s)
    assert seen == sorted(list(range(10)) + [0, 1])  # indices 0 and 1 are used twice
    shuffled = shares(10, 4, shuffle=True)
    counts = torch.bincount(torch.tensor([i for s in shuffled for i in s]), minlength=10)
    assert sorted(counts.tolist()) == [1] * 8 + [2, 2]


def test_drop_last_truncates_to_an_equal_share():
    per_rank = shares(10, 4, drop_last=True)
    assert [len(s) for s in per_rank] == [2, 2, 2, 2]
    assert len({i for s in per_rank for i in s}) == 8  # 2 samples sit out this epoch


def test_each_rank_takes_a_strided_slice():
    assert shares(8, 2, shuffle=False) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_different_seeds_on_different_ranks_overlap_and_skip_samples():
    per_rank = [list(DistributedSampler(range(100), num_replicas=2, rank=r, seed=r)) for r in range(2)]
    assert set(per_rank[0]) & set(per_rank[1])  # some samples on both ranks
    assert len(set(per_rank[0]) | set(per_rank[1])) < 100  # so some on neither
    same = shares(100, 2, seed=7)
    assert not set(same[0]) & set(same[1]) and len(set(same[0]) | set(same[1])) == 100


def test_dataloader_refuses_shuffle_together_with_a_sampler():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(range(10), sampler=sampler, shuffle=True)
    assert len(list(DataLoader(range(10), sampler=sampler))) == 5  # shuffle left at its default


def test_sampler_without_a_process_group_needs_num_replicas_and_rank():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        DistributedSampler(range(10))
    assert len(DistributedSampler(range(1000), num_replicas=3, rank=0)) == 334  # ceil(1000 / 3)


def test_evaluation_with_padding_counts_some_samples_twice():
    for shuffle in (True, False):
        per_rank = shares(10, 4, shuffle=shuffle)
        assert sum(len(s) for s in per_rank) == 12
        assert len({i for s in per_rank for i in s}) == 10
