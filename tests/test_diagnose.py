"""A stuck or failed run is diagnosed from the ranks' stacks and what they reported, as data."""

from __future__ import annotations

import pytest

from conftest import ROOT
from grader import diagnose, results
from grader.rank.harness import RankOutcome, WorldOutcome
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


def _learner_file(tmp_path, body: str) -> str:
    path = tmp_path / "32_dtensor_tp.py"
    path.write_text(body)
    return str(path)


def test_a_learners_exception_is_shown_with_its_file_line_and_the_lines_text(tmp_path):
    from grader.rank.child import describe_exception, import_learner

    path = _learner_file(tmp_path, "import torch\n\ndef train_step(x):\n    return x.float() @ x.bfloat16()\n")
    module = import_learner(path)
    try:
        module.train_step(__import__("torch").ones(2, 2))
    except RuntimeError as exc:
        error = describe_exception(exc, path)
    assert error["where"] == {"line": 4, "function": "train_step", "code": "return x.float() @ x.bfloat16()"}
    assert error["raised_in_learner"] is True  # by a C++ operator: no Python frame below the learner's
    outcome = WorldOutcome(2, [RankOutcome(0, "error", error=error), RankOutcome(1, "killed")])
    problem = diagnose.failure_problem(outcome, path)
    assert problem.kind == results.RAISED and problem.where.code == "return x.float() @ x.bfloat16()"
    text = problem_text(problem)
    assert text.startswith("rank 0 raised RuntimeError: ")
    assert "(32_dtensor_tp.py line 4, in train_step: `return x.float() @ x.bfloat16()`)" in text
    assert problem.to_dict()["where"]["code"] == "return x.float() @ x.bfloat16()"  # the JSON report has it too


def test_not_implemented_yet_is_only_a_not_implemented_error_raised_at_the_learners_own_line(tmp_path):
    from grader.rank.child import describe_exception, import_learner

    path = _learner_file(tmp_path, "import torch\n\ndef parallelize(model):\n    # TODO: the plan\n"
                                   "    raise NotImplementedError\n\n"
                                   "def train(x):\n    return x.redistribute()\n\n"
                                   "def step(x):\n    return torch.ops.aten.not_there(x)\n")
    module = import_learner(path)

    class Inside:  # stands for torch: a NotImplementedError from a library the learner called
        def redistribute(self):
            raise NotImplementedError("Operator aten.x is not supported with use_local_output=False")

    errors = []
    for call in (module.parallelize, lambda _: module.train(Inside())):
        try:
            call(None)
        except NotImplementedError as exc:
            errors.append(describe_exception(exc, path))
    stub, inside = (diagnose.failure_problem(WorldOutcome(1, [RankOutcome(0, "error", error=e)]), path) for e in errors)
    assert stub.kind == results.NOT_IMPLEMENTED and problem_text(stub) == "not implemented yet: parallelize"
    assert inside.kind == results.RAISED and inside.where.line == 8
    text = problem_text(inside)
    assert "raised NotImplementedError: Operator aten.x is not supported" in text and "not implemented yet" not in text
    assert "line 8, in train: `return x.redistribute()`" in text
    # Raised by C++ below the learner's line (no Python frame of torch's): the line is not a raise, not a stub.
    error = dict(errors[1], where={"line": 11, "function": "step", "code": "return torch.ops.aten.not_there(x)"},
                 raised_in_learner=True)
    assert diagnose.failure_problem(WorldOutcome(1, [RankOutcome(0, "error", error=error)]), path).kind == results.RAISED


def test_a_rank_that_aborted_is_shown_with_gloos_own_line():
    output = ("epoch 0\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 64 vs 48\n")
    outcome = WorldOutcome(3, [RankOutcome(0, "killed"), RankOutcome(1, "exited", exitcode=-6, output=output),
                               RankOutcome(2, "killed")])
    problem = diagnose.failure_problem(outcome, LEARNER)
    text = problem_text(problem)
    assert text.startswith("rank 1 was killed by SIGABRT before it finished; its last words: what():  [enforce fail")
    assert "64 vs 48" in text and problem.evidence["said"].startswith("what():")
    assert diagnose.last_words("a\nb\n") == "b" and diagnose.last_words("") == ""
