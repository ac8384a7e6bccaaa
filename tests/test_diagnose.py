"""A stuck or failed run is diagnosed from the ranks' stacks and what they reported, as data."""

from __future__ import annotations

import pytest

from conftest import ROOT
from grader import diagnose, results
from grader.harness import RankOutcome, WorldOutcome
from grader.report import problem_of, problem_text

LEARNER = "/work/kit/exercises/07_ring_allreduce.py"
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"


def stack(*frames: tuple[str, int, str]) -> str:
    """A faulthandler dump of the main thread, innermost frame first."""
    lines = ["Current thread 0x00007f (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {function}' for file, line, function in frames]
    lines.append('  File "/work/kit/grader/child.py", line 400 in main')
    return "\n".join(lines) + "\n"


IN_RENDEZVOUS = stack((f"{TORCH}/rendezvous.py", 190, "_create_c10d_store"),
                      (f"{TORCH}/distributed_c10d.py", 1892, "init_process_group"), (LEARNER, 12, "setup"))
IN_ALL_REDUCE = stack((f"{TORCH}/distributed_c10d.py", 2900, "all_reduce"), (LEARNER, 30, "ring_all_reduce"))
IN_BARRIER = stack((f"{TORCH}/distributed_c10d.py", 4800, "barrier"), (LEARNER, 41, "ring_all_reduce"))
IN_SEND = stack((f"{TORCH}/distributed_c10d.py", 2500, "send"), (LEARNER, 22, "ring_all_reduce"))
IN_RECV = stack((f"{TORCH}/distributed_c10d.py", 2600, "recv"), (LEARNER, 23, "ring_all_reduce"))
IN_PDB = stack(("/usr/lib/python3.11/cmd.py", 126, "cmdloop"), ("/usr/lib/python3.11/pdb.py", 300, "interaction"),
               ("/usr/lib/python3.11/bdb.py", 90, "dispatch_line"), (LEARNER, 18, "ring_all_reduce"))
IN_LOOP = stack((LEARNER, 25, "ring_all_reduce"))


def timed_out(*stacks: str, finished: int = 0) -> results.RunProblem:
    ranks = [RankOutcome(i, "ok") for i in range(finished)]
    ranks += [RankOutcome(finished + i, "killed", stack=s) for i, s in enumerate(stacks)]
    return diagnose.timeout_problem(WorldOutcome(len(ranks), ranks, timed_out=True), 30.0, LEARNER)


@pytest.mark.parametrize("stacks, kind, words", [
    ((IN_RENDEZVOUS, IN_LOOP), results.STUCK_RENDEZVOUS, "rank 1 never got there"),
    ((IN_ALL_REDUCE, IN_BARRIER), results.STUCK_COLLECTIVE, "same collective calls in the same order"),
    ((IN_SEND, IN_SEND), results.STUCK_SEND_RECV, "both send first"),
    ((IN_SEND, IN_RECV, IN_SEND), results.STUCK_SEND_RECV, "blocking send/recv"),
    ((IN_PDB, IN_ALL_REDUCE), results.STUCK_DEBUGGER, "debugger prompt"),
    ((IN_LOOP, IN_LOOP), results.STUCK_LEARNER_LOOP, "an endless loop?"),
], ids=["rendezvous", "collective", "send-send", "send-recv", "debugger", "learner-loop"])
def test_a_timeout_names_what_the_stuck_ranks_wait_in(stacks, kind, words):
    problem = timed_out(*stacks)
    assert problem.kind == kind and problem.status == results.TIMEOUT
    text = problem_text(problem)
    assert text.startswith("timed out after 30 s") and words in text
    assert "07_ring_allreduce.py line" in text  # where in the learner's file each rank is


def test_a_collective_only_some_ranks_reach_names_the_ranks_that_finished():
    problem = timed_out(IN_ALL_REDUCE, finished=1)
    assert problem.kind == results.STUCK_COLLECTIVE and problem.finished == [0]
    assert "rank 0 had already finished" in problem_text(problem)
    assert problem.evidence["waiting_in"] == {"1": "all_reduce"}


def test_a_stack_that_was_never_captured_stays_a_plain_timeout():
    problem = timed_out("", "")
    assert problem.kind == results.TIMEOUT_KIND
    assert "no stack was captured" in problem_text(problem)


def test_a_rank_reporting_a_rendezvous_elsewhere_is_diagnosed_with_both_addresses():
    error = {"type": "RendezvousStuck", "phase": "rendezvous", "message": "waited", "at": 1.0,
             "where": {"line": 24, "function": "setup_ddp"},
             "rendezvous": {"addr": "127.0.0.1", "port": "29500", "grader_addr": "127.0.0.1", "grader_port": "41000",
                            "source": "environment", "waited_s": 5.0}}
    outcome = WorldOutcome(2, [RankOutcome(0, "error", error=error), RankOutcome(1, "killed")])
    problem = diagnose.failure_problem(outcome, "/kit/03_train.py")
    assert (problem.kind, problem.status, problem.rank) == (results.STUCK_RENDEZVOUS, results.FAILED, 0)
    text = problem_text(problem)
    assert "127.0.0.1:29500" in text and "MASTER_PORT=41000" in text and "os.environ.setdefault" in text
    assert "03_train.py line 24" in text


@pytest.mark.slow
def test_a_hard_coded_master_port_in_03_is_reported_by_the_rendezvous_watch_not_the_deadline(grade):
    report = grade(ROOT / "tests" / "variants" / "03_hardcoded_port.py", timeout_s=60)
    problem = report.run_problem
    assert report.status == "failed" and problem.kind == results.STUCK_RENDEZVOUS
    assert problem.timeout_s is None  # not the 60 s deadline: a rank reported it after its grace period
    assert problem.evidence["port"] == "29500" and problem.evidence["grader_port"] != "29500"
    assert "MASTER_PORT" in problem_of(report)
