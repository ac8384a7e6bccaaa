"""Exercise 03's uses-ddp, on records made up here: the ranks' record of a DistributedDataParallel fails it when
missing; what passes it is the bytes the kernel counted from each rank to the others."""

from __future__ import annotations

from grader import catalog, traffic
from grader.checks import ex03_train
from grading_helpers import grading_for, verdicts

grading = grading_for("03")
WRAPPED = {"wraps": [{"built_index": 0}]}


def _counted(sent_by_rank: list[int], counted: set | None = None) -> traffic.RunTraffic:
    world_size = len(sent_by_rank)
    sent = {(rank, (rank + 1) % world_size): n for rank, n in enumerate(sent_by_rank)}
    return traffic.RunTraffic(world_size, sent, 0, set(range(world_size)) if counted is None else counted)


def test_gradients_that_crossed_pass_uses_ddp_on_the_kernels_count():
    """The reference at world size 2 sent 14,465 and 13,313 bytes (measured): well over 9 steps x 848 / 2."""
    g = grading()
    ex03_train.check_uses_ddp(g, [WRAPPED, WRAPPED], 2, _counted([14465, 13313]))
    assert verdicts(g)["uses-ddp"][0] == "pass" and g._verdicts["uses-ddp"].evidence == catalog.KERNEL
    assert ex03_train.least_sent() == 9 * 848 // 2


def test_a_ddp_built_and_never_used_fails_uses_ddp_on_the_bytes_it_did_not_send():
    """tests/hostile/03_trains_alone.py: each rank trains on the whole global batch alone; its records show a
    DistributedDataParallel, the kernel counted 1,432 and 401 bytes."""
    g = grading()
    ex03_train.check_uses_ddp(g, [WRAPPED, WRAPPED], 2, _counted([1432, 401]))
    status, message = verdicts(g)["uses-ddp"]
    assert status == "fail" and "rank 0 recorded a DistributedDataParallel, but it sent the other ranks 1,432" in message
    assert g._verdicts["uses-ddp"].evidence == catalog.KERNEL


def test_a_rank_never_counted_or_a_missing_wrapper_fails_uses_ddp():
    g = grading()
    ex03_train.check_uses_ddp(g, [WRAPPED, WRAPPED], 2, _counted([14465, 13313], counted={0}))
    status, message = verdicts(g)["uses-ddp"]
    assert status == "fail" and "rank 1" in message and "never let the grader read its sockets" in message
    g = grading()
    ex03_train.check_uses_ddp(g, [WRAPPED, {"wraps": []}], 2, _counted([14465, 13313]))
    status, message = verdicts(g)["uses-ddp"]
    assert status == "fail" and "rank 1 never built a DistributedDataParallel" in message
    assert g._verdicts["uses-ddp"].evidence == catalog.CLAIM


def test_where_the_kernel_cannot_count_the_records_decide_as_a_claim():
    g = grading()
    ex03_train.check_uses_ddp(g, [WRAPPED, WRAPPED], 2, None)
    assert verdicts(g)["uses-ddp"][0] == "pass" and g._verdicts["uses-ddp"].evidence == catalog.CLAIM
