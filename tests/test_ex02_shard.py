"""Exercise 02: right answers written differently must pass; helper logic of the checks."""

from __future__ import annotations

import textwrap

import pytest
import torch

from grader.checks import ex02_shard

HEADER = """\
import random

import torch
from torch.utils.data import DataLoader, DistributedSampler


"""

STANDARD_LOADER = """
def make_dataloader(dataset, rank, world_size, batch_size, *, seed=0):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
"""

RIGHT_ANSWERS = {
    "contiguous_blocks": """
def shard_indices(num_samples, rank, world_size, *, shuffle=False, seed=0, epoch=0):
    order = list(range(num_samples))
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    per_rank = num_samples // world_size
    return order[rank * per_rank:(rank + 1) * per_rank]
""" + STANDARD_LOADER,
    "python_random_tuple": """
def shard_indices(num_samples, rank, world_size, *, shuffle=False, seed=0, epoch=0):
    order = list(range(num_samples))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    usable = num_samples - num_samples % world_size
    return tuple(order[rank:usable:world_size])


def make_dataloader(dataset, rank, world_size, batch_size, *, seed=0):
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=sampler, drop_last=False)
""",
    "sampler_as_shard": """
def shard_indices(num_samples, rank, world_size, *, shuffle=False, seed=0, epoch=0):
    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    return list(sampler)
""" + STANDARD_LOADER,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RIGHT_ANSWERS))
def test_right_answers_written_differently_pass(grade, tmp_path, name):
    path = tmp_path / "02_shard.py"
    path.write_text(HEADER + textwrap.dedent(RIGHT_ANSWERS[name]))
    report = grade(path)
    failing = {c.id: c.message for c in report.checks if c.status != "pass"}
    assert report.status == "passed", (report.problem, failing, report.details)


def test_describe_flags_what_is_not_a_list_of_ints():
    assert ex02_shard._describe([3, 1]) == ("list", [3, 1], None)
    assert ex02_shard._describe([]) == ("list", [], None)
    assert ex02_shard._describe([5, 2**63, -2**63]) == ("list", [5, -1, -2**63], None)  # past int64: no index
    kind, items, bad = ex02_shard._describe(torch.tensor([2, 0]))
    assert (kind, items, bad) == ("Tensor", [2, 0], None)
    kind, items, bad = ex02_shard._describe([torch.tensor(4), 5])
    assert kind == "list" and items == [4, 5] and bad.startswith("Tensor")
    kind, items, bad = ex02_shard._describe([True, 2**70])
    assert items == [1, -1] and bad.startswith("bool")


def _results(shards_by_name: dict) -> dict:
    return {name: [{"kind": "list", "items": list(s), "bad": None} for s in shards]
            for name, shards in shards_by_name.items()}


def test_epoch_change_needs_a_new_set_not_only_a_new_order():
    same_sets = {"shuffled": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]}
    for k in (1, 2, 3):
        same_sets[f"epoch+{k}"] = [list(reversed(s)) for s in same_sets["shuffled"]]
    with pytest.raises(ex02_shard.Violation, match="the set of indices does not"):
        ex02_shard.check_epoch_changes(16, 2, 0, 0, _results(same_sets))
    changed = dict(same_sets, **{"epoch+2": [[0, 1, 2, 3, 4, 5, 6, 8], [7, 9, 10, 11, 12, 13, 14, 15]]})
    ex02_shard.check_epoch_changes(16, 2, 0, 0, _results(changed))


def test_epoch_change_is_not_required_where_it_may_fail_by_chance():
    one_rank = {"shuffled": [[0, 1, 2]], "epoch+1": [[0, 1, 2]], "epoch+2": [[0, 1, 2]], "epoch+3": [[0, 1, 2]]}
    ex02_shard.check_epoch_changes(3, 1, 0, 0, _results(one_rank))
    tiny = {name: [[0], [1]] for name in ("shuffled", "epoch+1", "epoch+2", "epoch+3")}
    ex02_shard.check_epoch_changes(2, 2, 0, 0, _results(tiny))


def test_disjoint_names_both_ranks():
    results = _results({"plain": [[0, 1], [1, 2]], "shuffled": [[0, 1], [2, 3]]})
    with pytest.raises(ex02_shard.Violation, match="index 1 is in the shards of rank 0 and rank 1"):
        ex02_shard.check_disjoint(4, 2, 0, 0, results)
