"""Exercise 02: right answers written differently must pass; helper logic of the checks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from grader.checks import ex02_shard as ex
from grader.rank.drivers import ex02_shard as rank_side
from grader.checks.ex02_shard import verdicts as v
from grader.report import details_of, problem_of

ROOT = Path(__file__).resolve().parent.parent

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
    assert report.status == "passed", (problem_of(report), failing, details_of(report))


def test_describe_flags_what_is_not_a_list_of_ints():
    assert rank_side._describe([3, 1]) == ("list", [3, 1], None)
    assert rank_side._describe([]) == ("list", [], None)
    assert rank_side._describe([5, 2**63, -2**63]) == ("list", [5, -1, -2**63], None)  # past int64: no index
    kind, items, bad = rank_side._describe(torch.tensor([2, 0]))
    assert (kind, items, bad) == ("Tensor", [2, 0], None)
    kind, items, bad = rank_side._describe([torch.tensor(4), 5])
    assert kind == "list" and items == [4, 5] and bad.startswith("Tensor")
    kind, items, bad = rank_side._describe([True, 2**70])
    assert items == [1, -1] and bad.startswith("bool")


def _results(shards_by_name: dict) -> dict:
    return {name: [{"kind": "list", "items": list(s), "bad": None} for s in shards]
            for name, shards in shards_by_name.items()}


def test_epoch_change_needs_a_new_set_not_only_a_new_order():
    same_sets = {"shuffled": [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]}
    for k in (1, 2, 3):
        same_sets[f"epoch+{k}"] = [list(reversed(s)) for s in same_sets["shuffled"]]
    with pytest.raises(v.Violation, match="the set of indices does not"):
        v.check_epoch_changes(16, 2, 0, 0, _results(same_sets))
    changed = dict(same_sets, **{"epoch+2": [[0, 1, 2, 3, 4, 5, 6, 8], [7, 9, 10, 11, 12, 13, 14, 15]]})
    v.check_epoch_changes(16, 2, 0, 0, _results(changed))


def test_epoch_change_is_not_required_where_it_may_fail_by_chance():
    one_rank = {"shuffled": [[0, 1, 2]], "epoch+1": [[0, 1, 2]], "epoch+2": [[0, 1, 2]], "epoch+3": [[0, 1, 2]]}
    v.check_epoch_changes(3, 1, 0, 0, _results(one_rank))
    tiny = {name: [[0], [1]] for name in ("shuffled", "epoch+1", "epoch+2", "epoch+3")}
    v.check_epoch_changes(2, 2, 0, 0, _results(tiny))


def test_disjoint_names_both_ranks():
    results = _results({"plain": [[0, 1], [1, 2]], "shuffled": [[0, 1], [2, 3]]})
    with pytest.raises(v.Violation, match="index 1 is in the shards of rank 0 and rank 1"):
        v.check_disjoint(4, 2, 0, 0, results)


# --- the shortcut: every example at once ----------------------------------------------------


class InProcess:
    """Stands in for both the grading and the worker: runs a learner file's shard_indices here."""

    Stopped = RuntimeError

    def __init__(self, path):
        import importlib.util

        spec = importlib.util.spec_from_file_location("learner_under_test", path)
        self.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.module)
        self.learner_path = str(path)
        self.examples: list = []  # (num_samples, world_size, seed, epoch) of every call, in order
        self.records: dict = {}

    def function(self, name):
        return getattr(self.module, name)

    def call(self, worker, name, **kwargs):
        _, seed, epoch = kwargs["configs"][0]
        self.examples.append((kwargs["num_samples"], kwargs["world_size"], seed, epoch))
        return rank_side.shards(self, **kwargs)

    def try_call(self, worker, name, *, within_s, **kwargs):
        return rank_side.shards_at_once(self, **kwargs)

    def record(self, check_id, passed, message=""):
        self.records.setdefault(check_id, passed)

    @staticmethod
    def with_context(exc, context):
        return exc


def test_the_shortcut_checks_the_examples_hypothesis_tries_on_a_passing_answer_in_its_order():
    reference = InProcess(ROOT / "solutions" / "02_shard.py")
    ex.grade_shards(reference, None)
    assert reference.records == {check_id: True for check_id in v.SHARD_CHECKS}
    assert tuple(dict.fromkeys(reference.examples)) == ex.passing_examples()
    assert len(ex.passing_examples()) > ex.EXAMPLES // 2


@pytest.mark.parametrize("variant", sorted(p.name for p in (ROOT / "tests" / "variants").glob("02_*.py")))
def test_the_shortcut_passes_the_reference_and_leaves_every_wrong_answer_to_hypothesis(variant):
    assert ex.passes_every_example_at_once(InProcess(ROOT / "solutions" / "02_shard.py"), None)
    wrong = InProcess(ROOT / "tests" / "variants" / variant)
    if not ex.passes_every_example_at_once(wrong, None):
        return
    # Only a variant whose mistake is in make_dataloader may pass the shortcut: Hypothesis agrees.
    ex.grade_shards(wrong, None)
    assert all(wrong.records.values()), (variant, wrong.records)


def test_a_reply_the_shortcut_cannot_read_is_left_to_hypothesis():
    class Garbled(InProcess):
        def try_call(self, worker, name, *, within_s, **kwargs):
            return [{"items": "not a tensor"}] * len(kwargs["examples"])

    assert not ex.passes_every_example_at_once(Garbled(ROOT / "solutions" / "02_shard.py"), None)
