"""Exercise 27's verdicts on hand-made records: the epochs after the checkpoint's, where each rank's
training started, and what a split after the same start points at."""

from __future__ import annotations

import torch

from grader.checks import ex27_resume as ex27
from grader.checks.shared.debug_job import Job, RankEnd, Step


def step(*micro: list[int], syncs: int = 1, epoch=(0, 0)) -> Step:
    return Step([list(m) for m in micro], syncs, epoch)


def epoch_steps(epoch: int, rank: int, world_size: int, pass_: int) -> list[Step]:
    order = ex27.sampler_order(epoch, rank, world_size)
    return [step(order[i:i + 8], epoch=(0, pass_)) for i in range(0, len(order), 8)]


def test_epochs_after_the_checkpoints_pass_and_epoch_0_is_named():
    first = ex27.CHECKPOINT_EPOCH + 1
    right = [epoch_steps(first, r, 2, 0) + epoch_steps(first + 1, r, 2, 1) for r in range(2)]
    assert ex27.epochs_verdict(right, 2) == (True, "")
    wrong = [right[0], epoch_steps(0, 1, 2, 0) + epoch_steps(1, 1, 2, 1)]
    ok, why = ex27.epochs_verdict(wrong, 2)
    assert not ok
    assert f"rank 1's first epoch after the resume drew the data order of epoch 0, not epoch {first}'s" in why


def job_with_states(first: list[dict], final: list[dict]) -> Job:
    records = [{"trained": 0, "first_states": [f], "final_states": [e], "events": []} for f, e in zip(first, final)]
    return Job(len(first), records, [RankEnd(r, True) for r in range(len(first))], "/tmp")


def test_a_rank_that_did_not_start_from_the_checkpoint_is_named():
    checkpoint = {"w": torch.ones(2)}
    job = job_with_states([checkpoint, {"w": torch.zeros(2)}], [checkpoint, checkpoint])
    ok, why = ex27.resumed_verdict(job, checkpoint)
    assert not ok and why.startswith("rank 1's first training step did not start from the checkpoint's weights")


def test_ranks_that_split_after_the_same_start_point_at_the_optimizer():
    start = {"w": torch.ones(2)}
    job = job_with_states([start, start], [{"w": torch.ones(2)}, {"w": torch.tensor([1.0, 1.5])}])
    ok, why = ex27.identical_verdict(job, resumed=True)
    assert not ok and "rank 1's model differs from rank 0's" in why and "optimizer's state" in why
    ok, why = ex27.identical_verdict(job, resumed=False)
    assert not ok and "optimizer" not in why
    assert ex27.identical_verdict(job_with_states([start, start], [start, start]), True) == (True, "")
