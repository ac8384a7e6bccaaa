"""Exercise 01's verdicts from hand-made records: the checks that only a GPU machine could
show failing with a real submission (backend, nccl-device) or that no realistic CPU bug reaches."""

from __future__ import annotations

import pytest

from grader import catalog, traffic
from grader.checks import ex01_setup
from grader.grading import Abort, Grading, Plan


class _Session:
    """Grading never starts a process in these tests."""


def _grading(backend: str = "gloo", world_size: int = 2) -> Grading:
    return Grading(catalog.by_id("01"), "01_setup.py", _Session(), Plan(backend, [world_size]), timeout_s=30)


def _observation(rank: int, world_size: int = 2, **changes) -> dict:
    obs = {
        "grader_port": "41000", "aborted": None,
        "calls": [{"backend": None, "init_method": None, "timeout_s": 300.0, "world_size": world_size,
                   "rank": rank, "uses_store": False, "master_addr": "127.0.0.1", "master_port": "41000"}],
        "initialized": True, "rank": rank, "world_size": world_size, "backend": "gloo",
        "all_reduce": world_size * (world_size + 1) / 2, "initialized_after_cleanup": False,
        "second_cleanup_error": None,
    }
    obs.update(changes)
    return obs


def _verdicts(g: Grading) -> dict:
    return {c.id: c for c in g.results(None)}


def test_a_correct_record_passes_every_check_it_covers():
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1)], 2)
    verdicts = _verdicts(g)
    for check_id in ("joins-group", "backend", "collective-works", "port-from-env", "timeout-set",
                     "cleanup-destroys", "cleanup-twice"):
        assert verdicts[check_id].status == "pass", check_id
    assert verdicts["nccl-device"].status == "skip"


def test_gloo_on_a_machine_with_a_gpu_per_rank_fails_backend(monkeypatch):
    monkeypatch.setattr(ex01_setup.torch.cuda, "device_count", lambda: 2)
    g = _grading(backend="nccl")
    records = [_observation(r, cuda_device=r) for r in range(2)]
    ex01_setup.check_run(g, records, 2)
    verdict = _verdicts(g)["backend"]
    assert verdict.status == "fail" and "joined with gloo, expected nccl" in verdict.message


def test_every_rank_on_gpu_0_fails_nccl_device(monkeypatch):
    monkeypatch.setattr(ex01_setup.torch.cuda, "device_count", lambda: 2)
    g = _grading(backend="nccl")
    records = [_observation(r, backend="nccl", cuda_device=0) for r in range(2)]
    ex01_setup.check_run(g, records, 2)
    verdict = _verdicts(g)["nccl-device"]
    assert verdict.status == "fail" and verdict.rank == 1 and "cuda:0, expected cuda:1" in verdict.message


def test_a_wrong_all_reduce_result_fails_collective_works():
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1, all_reduce=2.0)], 2)
    verdict = _verdicts(g)["collective-works"]
    assert verdict.status == "fail" and "gave 2, expected 3" in verdict.message


def test_a_hard_coded_port_stops_grading_after_failing_port_from_env():
    g = _grading()
    calls = [{**_observation(0)["calls"][0], "master_port": "29500"}]
    records = [_observation(r, calls=calls, aborted="would meet at port 29500") for r in range(2)]
    with pytest.raises(Abort):
        ex01_setup.check_run(g, records, 2)
    verdict = _verdicts(g)["port-from-env"]
    assert verdict.status == "fail" and "29500" in verdict.message


def test_the_grader_asks_for_a_backend_setup_ddp_would_not_pick_itself():
    assert ex01_setup.requested_backend("gloo") == "cpu:gloo"
    assert ex01_setup.requested_backend("nccl") == "gloo"


def test_on_gpus_joining_with_the_requested_gloo_passes_and_leaves_nccl_device_to_the_nccl_runs():
    g = _grading(backend="nccl")
    ex01_setup.check_requested_backend(g, [_observation(r, backend="gloo") for r in range(2)], "gloo", 2)
    verdicts = _verdicts(g)
    assert verdicts["backend"].status == "pass" and verdicts["nccl-device"].status == "error"  # not decided here


def test_a_backend_argument_that_is_ignored_fails_backend():
    g = _grading(backend="nccl")
    records = [_observation(r, backend="nccl", cuda_device=r) for r in range(2)]
    ex01_setup.check_requested_backend(g, records, "gloo", 2)
    verdict = _verdicts(g)["backend"]
    assert verdict.status == "fail" and "joined with nccl, expected gloo" in verdict.message


def test_a_setup_that_refuses_the_requested_backend_fails_backend_with_its_error():
    g = _grading()
    records = [_observation(r, setup_error="ValueError: unknown backend cpu:gloo") for r in range(2)]
    ex01_setup.check_requested_backend(g, records, "cpu:gloo", 2)
    verdict = _verdicts(g)["backend"]
    assert verdict.status == "fail" and "raised ValueError: unknown backend cpu:gloo" in verdict.message


def _counted(sent: dict, world_size: int = 2, counted: set | None = None) -> traffic.RunTraffic:
    return traffic.RunTraffic(world_size, sent, 0, set(range(world_size)) if counted is None else counted)


def test_collective_works_stands_on_the_bytes_the_kernel_counted_between_the_ranks():
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1)], 2, counted=_counted({(0, 1): 156, (1, 0): 149}))
    verdict = _verdicts(g)["collective-works"]
    assert verdict.status == "pass" and verdict.evidence == catalog.KERNEL


def test_the_right_sum_with_no_message_between_the_ranks_fails_collective_works():
    """A group that exists only in the ranks' records: each says it got the sum, the kernel saw a connection open
    (8 bytes) and nothing else."""
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1)], 2, counted=_counted({(0, 1): 8, (1, 0): 8}))
    verdict = _verdicts(g)["collective-works"]
    assert verdict.status == "fail" and verdict.evidence == catalog.KERNEL and verdict.rank == 0
    assert "sent the other ranks 8 bytes (the kernel's count)" in verdict.message


def test_a_rank_whose_sockets_were_never_read_fails_collective_works():
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1)], 2,
                         counted=_counted({(0, 1): 156, (1, 0): 149}, counted={0}))
    verdict = _verdicts(g)["collective-works"]
    assert verdict.status == "fail" and verdict.rank == 1 and "never let the grader read its sockets" in verdict.message


def test_a_group_of_one_sends_nothing_and_collective_works_stands_on_its_sum():
    """--world-size 1: the reference's one rank sends no byte (there is no other rank), which is right; its sum
    decides, as a claim, and a wrong sum still fails."""
    g = _grading()
    ex01_setup.check_run(g, [_observation(0, world_size=1)], 1, counted=_counted({}, world_size=1))
    verdict = _verdicts(g)["collective-works"]
    assert verdict.status == "pass" and verdict.evidence == catalog.CLAIM
    g = _grading()
    ex01_setup.check_run(g, [_observation(0, world_size=1, all_reduce=2.0)], 1, counted=_counted({}, world_size=1))
    assert _verdicts(g)["collective-works"].status == "fail"


def test_where_the_kernel_cannot_be_read_collective_works_stands_on_the_ranks_claim():
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1)], 2)
    assert _verdicts(g)["collective-works"].evidence == catalog.CLAIM
    g = _grading()
    ex01_setup.check_run(g, [_observation(0), _observation(1, all_reduce=2.0)], 2,
                         counted=_counted({(0, 1): 156, (1, 0): 149}))
    verdict = _verdicts(g)["collective-works"]
    assert verdict.status == "fail" and verdict.evidence == catalog.CLAIM and "gave 2, expected 3" in verdict.message
