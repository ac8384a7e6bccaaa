"""The debugging track's verdicts on hand-made records (no processes): steps read from events,
epochs, the data split, where each rank ended, and the verdicts of exercises 24-26."""

from __future__ import annotations

import pytest
import torch

from grader import catalog
from grader.checks.shared import debug_job
from grader.checks import ex24_rank_drift as ex24
from grader.checks import ex25_data_order as ex25
from grader.checks import ex26_accum_sync as ex26
from grader.checks.shared.debug_job import Job, RankEnd, Step
from grader.grading import Abort, GradeOptions, plan


def rows(n: int) -> torch.Tensor:
    return torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)


def index_of(x: torch.Tensor) -> dict:
    return {row.numpy().tobytes(): i for i, row in enumerate(x)}


def step(*micro: list[int], syncs: int = 1, epoch=(0, 0)) -> Step:
    return Step([list(m) for m in micro], syncs, epoch)


# --- reading a rank's record --------------------------------------------------------------


def test_steps_of_groups_forwards_by_optimizer_step_and_counts_synced_backwards():
    x = rows(8)
    events = [
        {"what": "batch", "loader": 0, "pass": 0},
        {"what": "forward", "ddp": 0, "x": x[0:2]},
        {"what": "sync", "ddp": 0, "bucket": 0, "no_sync": False},
        {"what": "sync", "ddp": 0, "bucket": 1, "no_sync": False},  # two buckets: one synced backward
        {"what": "forward", "ddp": 0, "x": x[2:4]},
        {"what": "sync", "ddp": 0, "bucket": 0, "no_sync": False},
        {"what": "step", "lr": 0.1},
        {"what": "batch", "loader": 0, "pass": 1},
        {"what": "forward", "ddp": 1, "x": x[4:6]},  # another DDP model: not the trained one
        {"what": "forward", "ddp": 0, "x": x[6:8]},
        {"what": "step", "lr": 0.1},
        {"what": "forward", "ddp": 0, "x": x[0:1]},  # after the last step: never stepped
    ]
    steps, left = debug_job.steps_of({"events": events, "trained": 0}, index_of(x))
    assert [s.micro for s in steps] == [[[0, 1], [2, 3]], [[6, 7]]]
    assert [s.syncs for s in steps] == [2, 0]
    assert [s.epoch for s in steps] == [(0, 0), (0, 1)]
    assert left == [[0]]


def test_rows_not_in_the_data_set_are_minus_one():
    x = rows(4)
    assert debug_job.ids_of(x[[3, 1]], index_of(x)) == [3, 1]
    assert debug_job.ids_of(torch.full((1, 2), -5.0), index_of(x)) == [-1]


def test_epochs_of_without_a_loader_splits_the_steps_evenly():
    steps = [step([i], epoch=None) for i in range(6)]
    assert [len(e) for e in debug_job.epochs_of(steps, 3)] == [2, 2, 2]


# --- the data split ----------------------------------------------------------------------


def two_ranks_one_epoch(rank0: list[int], rank1: list[int]) -> list[list[Step]]:
    return [[step(rank0)], [step(rank1)]]


def test_a_split_with_a_samplers_padding_passes():
    ok, why = debug_job.data_split_verdict(two_ranks_one_epoch([0, 2, 4], [1, 3, 0]), 2, 5, 1, 3)
    assert ok, why


def test_the_whole_data_set_on_every_rank_fails_naming_a_shared_sample():
    ok, why = debug_job.data_split_verdict(two_ranks_one_epoch([0, 1, 2, 3], [0, 1, 2, 3]), 2, 4, 1, 4)
    assert not ok and "sample 0 was trained on by ranks 0 and 1" in why and "4 samples" in why


def test_too_many_samples_left_out_fails_with_the_count():
    ok, why = debug_job.data_split_verdict(two_ranks_one_epoch([0], [1]), 2, 12, 1, 2)
    assert not ok and "10 of 12 samples were not trained on" in why


def test_ranks_with_different_epoch_counts_fail():
    steps = [[step([0], epoch=(0, 0)), step([2], epoch=(0, 1))], [step([1], epoch=(0, 0))]]
    ok, why = debug_job.data_split_verdict(steps, 2, 4, 2, 1)
    assert not ok and "rank 1: 1" in why


def test_aligned_by_epoch_lets_a_rank_with_fewer_steps_contribute_nothing():
    steps = [[step([0], epoch=(0, 0)), step([2], epoch=(0, 0)), step([4], epoch=(0, 1))],
             [step([1], epoch=(0, 0)), step([5], epoch=(0, 1))]]
    per_rank, why = debug_job.aligned_by_epoch(steps, 2)
    assert why == ""
    assert per_rank == [[[[0]], [[2]], [[4]]], [[[1]], [], [[5]]]]


# --- how the ranks ended --------------------------------------------------------------------


def waited(rank: int, collective: str, line: int) -> RankEnd:
    raised = {"type": "DistBackendError", "message": "[../gloo/transport/tcp/pair.cc] Timed out waiting 6000ms",
              "waiting_in": collective, "where": {"function": "main", "line": line, "code": "x"}}
    return RankEnd(rank, False, raised)


def test_a_hang_is_told_rank_by_rank_with_the_collective_and_line():
    job = Job(3, [None] * 3, [waited(0, "all_reduce", 40), waited(1, "barrier", 52), RankEnd(2, True)], "/tmp")
    assert debug_job.hung(job)
    text = debug_job.ends_message(job)
    assert "rank 0 waited in dist.all_reduce at main(), line 40" in text
    assert "rank 1 waited in dist.barrier at main(), line 52" in text
    assert "rank 2 finished main()" in text and "different collectives" in text


def test_an_exception_is_told_by_its_first_sentence():
    raised = {"type": "RuntimeError", "message": "Expected to have finished reduction in the prior iteration "
              "before starting a new one. This error indicates ...\nParameter indices which did not receive grad "
              "for rank 0: 4 5", "waiting_in": "forward", "where": None}
    job = Job(2, [None, None], [RankEnd(0, False, raised), RankEnd(1, False, raised)], "/tmp")
    assert not debug_job.hung(job)
    text = debug_job.ends_message(job)
    assert text.startswith("ranks 0 and 1 raised RuntimeError: Expected to have finished reduction")
    assert "Parameter indices which did not receive grad for rank 0: 4 5" in text


# --- exercise 24: the learning rates -----------------------------------------------------


def test_ranks_at_different_rates_in_an_epoch_fail():
    log = [{"lr": 0.1, "val_loss": 1.0, "best": 1.0}, {"lr": 0.05, "val_loss": 1.0, "best": 1.0}]
    ok, why = ex24.schedule_verdict([[0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.1, 0.1]], [2, 2], log)
    assert not ok and "epoch 1: the ranks trained at different learning rates (rank 0: 0.05, rank 1: 0.1)" in why


def test_rates_that_follow_the_whole_validation_set_pass():
    log = [{"lr": 0.1, "val_loss": 1.0, "best": 1.0}, {"lr": 0.05, "val_loss": 1.0, "best": 1.0}]
    ok, why = ex24.schedule_verdict([[0.1, 0.1, 0.05, 0.05]] * 2, [2, 2], log)
    assert ok, why


# --- exercise 25: a new order each epoch ---------------------------------------------------


def test_the_same_order_in_two_epochs_fails_with_its_first_batch():
    steps = [[step([3, 1], epoch=(0, 0)), step([3, 1], epoch=(0, 1))]]
    ok, why = ex25.new_order_verdict(steps, epochs=2)
    assert not ok and "epoch 1 trained on the same samples in the same order as epoch 0" in why
    ok, why = ex25.new_order_verdict([[step([3, 1], epoch=(0, 0)), step([1, 3], epoch=(0, 1))]], epochs=2)
    assert ok, why


# --- exercise 26: all-reduces per step -------------------------------------------------------


def test_a_sync_per_micro_batch_fails_with_the_counts():
    steps = [[step([0], [1], [2], [3], syncs=4)]]
    ok, why = ex26.sync_verdict(steps)
    assert not ok and "all-reduced the gradients 4 times for one optimizer step of 4 micro-batches" in why
    ok, why = ex26.sync_verdict([[step([0], [1], [2], [3], syncs=0)]])
    assert not ok and "never all-reduced" in why
    assert ex26.sync_verdict([[step([0], [1], [2], [3], syncs=1)]]) == (True, "")


def test_a_step_per_micro_batch_is_no_accumulation():
    ok, why = ex26.accumulation_verdict([[step([0], syncs=1)]])
    assert not ok and f"after 1 micro-batch(es), expected {ex26.ACCUM_STEPS}" in why


# --- the plan: a CPU job on any machine ---------------------------------------------------------


def test_a_debugging_job_is_graded_on_gloo_even_with_gpus_and_refuses_nccl():
    ex = catalog.by_id("21")
    assert plan(ex, GradeOptions(backend="auto"), gpus=4, nccl=True).backend == "gloo"
    with pytest.raises(Abort) as raised:
        plan(ex, GradeOptions(backend="nccl"), gpus=4, nccl=True)
    assert "a CPU job (gloo)" in raised.value.problem.message
