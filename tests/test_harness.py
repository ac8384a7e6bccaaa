"""The harness's own promises, unit by unit: bounded reads, reaping, blame, limits, bounded output."""

from __future__ import annotations

from grader.diagnose import rank_record
from grader.report import rank_line

import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from click.testing import CliRunner

from grader.rank import harness, limits
from grader.cli import main
from grader.rank.harness import RankOutcome


def _pair():
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_a_whole_message_is_read():
    reader, writer = _pair()
    writer.send_bytes(b"observations")
    assert harness._recv(reader, time.monotonic() + 5) == b"observations"


def test_a_message_cut_off_half_way_does_not_stall_the_grader():
    reader, writer = _pair()
    os.write(writer.fileno(), struct.pack("!i", 1000) + b"only part of it")
    with pytest.raises(TimeoutError):
        harness._recv(reader, time.monotonic() + 0.3)


def test_an_oversized_message_is_refused_without_reading_it():
    reader, writer = _pair()
    os.write(writer.fileno(), struct.pack("!i", 2**30))
    with pytest.raises(ValueError):
        harness._recv(reader, time.monotonic() + 1, maxsize=1024)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc")
def test_processes_carrying_the_marker_are_found_and_killed_even_in_their_own_session():
    marker = uuid.uuid4().hex
    env = {**os.environ, harness.RUN_MARKER: marker}
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while stray.pid not in harness.marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stray.pid in harness.marked_processes(marker)
        assert harness.reap_strays(marker) >= 1
        assert stray.wait(timeout=10) < 0  # killed by a signal
        assert harness.marked_processes(marker) == []
    finally:
        stray.kill()


def test_a_rank_that_only_lost_its_crashed_peer_is_not_named_as_the_cause():
    victim = RankOutcome(0, "error", error={"type": "RuntimeError", "message": "pair.cc:553] Connection closed by peer"})
    crashed = RankOutcome(1, "exited", exitcode=-11)
    harness._blame([victim, crashed])
    assert victim.status == "killed" and crashed.status == "exited"
    assert "lost a peer" in rank_line(rank_record(victim, ""))
    assert rank_line(rank_record(crashed, "")) == "rank 1 was killed by SIGSEGV before it finished"


def test_a_peer_error_with_no_other_cause_stays_an_error():
    only = RankOutcome(0, "error", error={"type": "RuntimeError", "message": "Connection reset by peer"})
    harness._blame([only, RankOutcome(1, "ok")])
    assert only.status == "error"


def test_a_limit_is_named_with_the_option_that_changes_it():
    detail = limits.describe("memory", limits.limits_dict(memory_mib=512))
    assert detail == "the memory limit (512 MiB resident; --memory-limit changes it)"
    rank = RankOutcome(1, "exited", exitcode=-9, limit="memory", limit_detail=detail)
    assert rank_line(rank_record(rank, "")) == f"rank 1 went over {detail} and was stopped"
    assert "--cpu-limit" in limits.describe("cpu", limits.DEFAULT_LIMITS)
    assert "--output-limit" in limits.describe("output", limits.DEFAULT_LIMITS)
    assert "--tmp-limit" in limits.describe("tmp", limits.DEFAULT_LIMITS)


def test_the_defaults_are_on_and_zero_turns_a_limit_off():
    assert limits.DEFAULT_LIMITS == {"memory_bytes": 2048 * 2**20, "cpu_seconds": 300, "output_bytes": 64 * 2**20,
                                     "tmp_bytes": 512 * 2**20}
    # A sandbox's /tmp always has a size: 0 means its default.
    assert limits.limits_dict(0, 0, 0, 0) == {"memory_bytes": 0, "cpu_seconds": 0, "output_bytes": 0,
                                              "tmp_bytes": 512 * 2**20}
    assert limits.address_space_bytes(0) == 0
    assert limits.address_space_bytes(2**30) > 2**30


@pytest.mark.slow
def test_limit_options_reach_the_sessions_the_command_makes(tmp_path, monkeypatch):
    seen = []

    class RecordingSession(harness.Session):
        def __init__(self, limits=None, **kwargs):
            seen.append(limits)
            super().__init__(limits=limits, **kwargs)

    monkeypatch.setattr(harness, "Session", RecordingSession)
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["grade", str(tmp_path / "01_setup.py"), "-q", "--memory-limit", "100",
                                       "--cpu-limit", "7", "--output-limit", "0", "--tmp-limit", "32"])
    assert result.exit_code == 2  # no such file; the options were still read
    assert seen == [{"memory_bytes": 100 * 2**20, "cpu_seconds": 7, "output_bytes": 0, "tmp_bytes": 32 * 2**20}]
    with harness.Session(limits={"cpu_seconds": 1}) as session:
        assert session.limits == {**limits.DEFAULT_LIMITS, "cpu_seconds": 1}


def test_only_the_end_of_a_huge_output_is_kept(tmp_path):
    out = tmp_path / "rank0.out"
    out.write_text("noise\n" * 500_000 + "the last line\n")
    tail = harness._tail(str(out))
    assert len(tail) < harness.OUTPUT_TAIL_CHARS + 100
    assert tail.startswith("[... ") and tail.rstrip().endswith("the last line")


@pytest.mark.slow
def test_a_session_removes_its_temporary_folder(tmp_path):
    with harness.Session() as session:
        run_dir = session.new_run_dir()
        open(os.path.join(run_dir, "rank0.out"), "w").write("x")
    assert not os.path.exists(session.tmp)


# --- several worlds at once (Session.run_many) ------------------------------------------


def fails_at_once_main(ctx) -> dict:
    """Rank 1 raises at once; rank 0 would run far longer than any test, saying when it is alive."""
    if ctx.rank == 1:
        raise RuntimeError("rank 1 gave up")
    if ctx.kwargs.get("pid_file"):
        with open(ctx.kwargs["pid_file"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(ctx.kwargs["pid_file"] + ".tmp", ctx.kwargs["pid_file"])
    for _ in range(600):
        with open(os.path.join(ctx.run_dir, "alive"), "a") as f:
            f.write(f"{time.monotonic()}\n")
        time.sleep(0.1)
    return {}


def sleeps_then_answers_main(ctx) -> dict:
    time.sleep(ctx.kwargs.get("sleep_s", 0.0))
    return {"rank": ctx.rank, "world_size": ctx.world_size}


def _world(name: str, size: int, **kwargs) -> harness.World:
    return harness.World(f"test_harness:{name}", size, kwargs)


@pytest.mark.slow
def test_worlds_run_together_answer_in_order_each_with_its_own_ranks():
    with harness.Session() as session:
        outcomes = session.run_many([_world("sleeps_then_answers_main", 2), _world("sleeps_then_answers_main", 3)],
                                    learner_path=__file__, timeout_s=60)
    assert [o.world_size for o in outcomes] == [2, 3]
    assert outcomes[0].results() == [{"rank": r, "world_size": 2} for r in range(2)]
    assert outcomes[1].results() == [{"rank": r, "world_size": 3} for r in range(3)]
    assert outcomes[0].run_dir != outcomes[1].run_dir


def waits_for_a_stopped_rank_main(ctx) -> dict:
    """Answers only once the process whose pid is in ``ctx.kwargs["pid_file"]`` is gone (or a zombie)."""
    while True:
        try:
            pid = int(open(ctx.kwargs["pid_file"]).read())
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except (OSError, ValueError):
            if os.path.exists(ctx.kwargs["pid_file"]):
                break  # the pid is written and its /proc entry is gone
        time.sleep(0.05)
    return {"rank": ctx.rank, "saw_it_stopped": True}


@pytest.mark.slow
def test_a_failing_world_gets_its_grace_without_cutting_short_the_world_beside_it(tmp_path):
    """Order, not seconds: the world beside answers only after the failing world's rank 0 was stopped, so
    this finishes only if that rank is stopped when its grace ends, while the world beside still runs."""
    pid_file = str(tmp_path / "rank0.pid")
    with harness.Session() as session:
        failing, beside = session.run_many(
            [_world("fails_at_once_main", 2, pid_file=pid_file),
             _world("waits_for_a_stopped_rank_main", 2, pid_file=pid_file)],
            learner_path=__file__, timeout_s=60, grace_s=0.5)
    assert [r.status for r in failing.ranks] == ["killed", "error"]  # rank 0 stopped after the grace
    assert not failing.timed_out and not beside.timed_out
    assert beside.results() == [{"rank": r, "saw_it_stopped": True} for r in range(2)]


@pytest.mark.slow
def test_worlds_after_a_failed_world_read_last_are_stopped_with_it(tmp_path):
    """``last_read_on_failure``: the grading reads nothing after a world that failed, so the worlds after
    it (here one that would run until the deadline) are stopped with it; the ones before it run on."""
    with harness.Session() as session:
        before, failing, after = session.run_many(
            [_world("sleeps_then_answers_main", 2, sleep_s=0.5), _world("fails_at_once_main", 2),
             _world("sleeps_then_answers_main", 2, sleep_s=600)],
            learner_path=__file__, timeout_s=300, grace_s=0.2, last_read_on_failure=[True, True, True])
    assert before.ok and not before.timed_out
    assert [r.status for r in failing.ranks] == ["killed", "error"] and not failing.timed_out
    assert [r.status for r in after.ranks] == ["killed", "killed"] and not after.timed_out


@pytest.mark.slow
def test_a_world_that_hangs_times_out_alone():
    # The deadline is far beyond what the world beside needs even on a loaded machine: what is
    # asserted is which world timed out, not how fast the other was.
    with harness.Session() as session:
        hung, beside = session.run_many(
            [_world("sleeps_then_answers_main", 2, sleep_s=600), _world("sleeps_then_answers_main", 2)],
            learner_path=__file__, timeout_s=20)
    assert hung.timed_out and [r.status for r in hung.ranks] == ["killed", "killed"]
    assert not beside.timed_out and beside.ok


@pytest.mark.slow
def test_every_process_of_a_grading_bounds_its_name_lookups(monkeypatch):
    """c10d looks up the name of 127.0.0.1 on every store connection; a DNS server that drops the query
    must not stall a rank for glibc's default 5 s (harness.RESOLVER_OPTIONS)."""
    monkeypatch.delenv("RES_OPTIONS", raising=False)
    with harness.Session() as session:
        outcome = session.run("test_harness:resolver_options_main", 1, learner_path=__file__, timeout_s=60)
        assert os.environ["RES_OPTIONS"] == harness.RESOLVER_OPTIONS
    assert outcome.results() == [harness.RESOLVER_OPTIONS]
    monkeypatch.setenv("RES_OPTIONS", "timeout:2")  # the user's own is kept
    with harness.Session() as session:
        outcome = session.run("test_harness:resolver_options_main", 1, learner_path=__file__, timeout_s=60)
    assert outcome.results() == ["timeout:2"]


def resolver_options_main(ctx) -> str | None:
    return os.environ.get("RES_OPTIONS")


def test_a_grading_reads_runs_started_at_once_in_order_and_stops_where_one_by_one_would():
    from grader import catalog
    from grader.grading import Abort, Grading, Plan

    ok = harness.WorldOutcome(2, [RankOutcome(r, "ok", result={"rank": r}) for r in range(2)])
    failed = harness.WorldOutcome(3, [RankOutcome(0, "ok", result={}), RankOutcome(1, "error", error={
        "type": "RuntimeError", "message": "rank 1 gave up", "traceback": "", "where": None, "phase": "run"}),
        RankOutcome(2, "ok", result={})])
    hung = harness.WorldOutcome(2, [RankOutcome(r, "killed") for r in range(2)], timed_out=True)

    class StartsEverythingAtOnce:
        def __init__(self):
            self.started = []

        def run_many(self, worlds, **kwargs):
            self.started.append([(w.driver, w.world_size) for w in worlds])
            return [ok, failed, hung]

    session = StartsEverythingAtOnce()
    g = Grading(catalog.by_id("01"), "01_setup.py", session, Plan("gloo", [2, 3]), timeout_s=30)
    outcomes = g.run_at_once([g.Run("rank_main", 2), g.Run("rank_main", 3), g.Run("rank_main", 2)])
    assert session.started == []  # nothing starts before the first outcome is asked for
    assert next(outcomes) is ok
    assert session.started == [[("grader.rank.drivers.ex01_setup:rank_main", 2),
                                ("grader.rank.drivers.ex01_setup:rank_main", 3),
                                ("grader.rank.drivers.ex01_setup:rank_main", 2)]]
    with pytest.raises(Abort) as stopped:  # the failing rank of the second run, not the third's timeout
        next(outcomes)
    assert stopped.value.problem.rank == 1 and stopped.value.problem.world_size == 3
    assert g.sizes_run == [2, 3]


# --- spares: rank processes forked ahead of the next run --------------------------------------


def pid_main(ctx) -> int:
    return os.getpid()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _spares(session: harness.Session, count: int) -> set[int]:
    deadline = time.monotonic() + 60
    while len(session.spare_pids()) < count:
        assert time.monotonic() < deadline, f"{len(session.spare_pids())} spares after 60 s, {count} expected"
        time.sleep(0.02)
    return set(session.spare_pids())


@pytest.mark.slow
def test_a_session_with_spares_runs_its_next_ranks_on_processes_forked_ahead():
    with harness.Session(spares=True) as session:
        first = session.run("test_harness:pid_main", 3, learner_path=__file__, timeout_s=60)
        waiting = _spares(session, 3)  # as many as the last run used
        second = session.run("test_harness:pid_main", 2, learner_path=__file__, timeout_s=60)
        assert first.ok and second.ok
        assert set(second.results()) <= waiting
        assert not set(second.results()) & set(first.results())  # a spare serves one run, never two
        refilled = _spares(session, 3)
        assert not refilled & set(second.results())
    assert not [pid for pid in waiting | refilled if _running(pid)]  # closing the session ends them


@pytest.mark.slow
def test_a_spare_that_died_while_it_waited_is_passed_over():
    with harness.Session(spares=True) as session:
        session.run("test_harness:pid_main", 2, learner_path=__file__, timeout_s=60)
        dead = _spares(session, 2)
        for pid in dead:
            os.kill(pid, 9)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") for pid in dead) and time.monotonic() < deadline:
            time.sleep(0.02)  # reaped by the pool, which then tells the session
        time.sleep(0.2)
        outcome = session.run("test_harness:pid_main", 2, learner_path=__file__, timeout_s=60)
    assert outcome.ok, [r.status for r in outcome.ranks]
    assert not set(outcome.results()) & dead


@pytest.mark.slow
def test_a_session_without_spares_forks_nothing_ahead():
    with harness.Session() as session:
        outcome = session.run("test_harness:pid_main", 2, learner_path=__file__, timeout_s=60)
        time.sleep(0.5)
        assert outcome.ok and session.spare_pids() == []



@pytest.mark.slow
def test_the_deadline_of_a_run_counts_from_after_its_ranks_are_started(monkeypatch):
    """Starting the ranks (on a cold pool, waiting for it to import torch) is the grader's time: the
    deadline a run waits under begins once every rank is started, and the outcome says how long that took."""
    original_start, original_wait = harness.Session._start, harness._wait_all
    seen = {}

    def slow_start(self, spec):
        time.sleep(0.5)
        rank = original_start(self, spec)
        seen["started_by"] = time.monotonic()
        return rank

    def wait_all(groups, deadline, *args, **kwargs):
        seen["deadline"] = deadline
        return original_wait(groups, deadline, *args, **kwargs)

    monkeypatch.setattr(harness.Session, "_start", slow_start)
    monkeypatch.setattr(harness, "_wait_all", wait_all)
    with harness.Session() as session:
        (outcome,) = session.run_many([_world("sleeps_then_answers_main", 2)], learner_path=__file__, timeout_s=60)
    assert outcome.ok and outcome.start_s >= 1.0
    assert seen["deadline"] >= seen["started_by"] + 60


@pytest.mark.slow
def test_a_gradings_deadline_starts_after_its_checks_are_imported(session, monkeypatch):
    """Importing the exercise's checks (torch, in a cold process) is the grader's time too."""
    import importlib

    from grader import grading
    from grader.grading import GradeOptions, grade_file

    original_import, original_init = importlib.import_module, grading.Grading.__init__
    seen = {}

    def slow_import(name, *args, **kwargs):
        module = original_import(name, *args, **kwargs)
        if name == "grader.checks.ex01_setup":
            time.sleep(0.5)
            seen["imported_by"] = time.monotonic()
        return module

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen["deadline"] = self.deadline

    monkeypatch.setattr(grading.importlib, "import_module", slow_import)
    monkeypatch.setattr(grading.Grading, "__init__", init)
    report = grade_file(os.path.join(os.path.dirname(__file__), "..", "solutions", "01_setup.py"), session,
                        GradeOptions(timeout_s=60))
    assert report.status == "passed"
    assert seen["deadline"] >= seen["imported_by"] + 60


def test_a_ctrl_c_while_ranks_are_handed_out_is_raised_once_every_rank_is_registered():
    """run_many hands out the ranks' specs with Ctrl-C held back (a rank given its spec but not yet in the
    list that is stopped afterwards would be left running): the KeyboardInterrupt comes when the block ends."""
    import os
    import signal

    from grader.rank.harness import _interrupt_deferred

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interrupt_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                reached.append("after the signal")
        assert reached == ["after the signal"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with _interrupt_deferred():  # nothing pending: nothing raised
            reached.append("again")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["after the signal", "again"]


def ctrl_c_handler_at_start(conn) -> None:
    """A process of the pool: which SIGINT handler it started with, before any line of the grader's ran."""
    import signal

    conn.send(repr(signal.getsignal(signal.SIGINT)))


def test_every_process_of_the_pool_starts_with_ctrl_c_ignored():
    """A Ctrl-C at the terminal reaches a spare forked a moment earlier, before its first line ignores it
    (tests/test_cli_watch.py's 'specs handed out' moment, in CI): with Python's handler it ended in a
    KeyboardInterrupt traceback on the command's terminal. The pool hands every fork SIGINT ignored."""
    import signal

    from grader.rank import processes

    ctx = processes._context(None, dynamo=False)
    if ctx.get_start_method() != "forkserver":
        pytest.skip("a pool is a forkserver; this platform has none")
    parent_end, child_end = ctx.Pipe(duplex=False)
    process = processes.start_in_pool(lambda: ctx.Process(target=ctrl_c_handler_at_start, args=(child_end,)))
    child_end.close()
    try:
        assert parent_end.poll(120), "the pool's process said nothing in 120 s"
        assert parent_end.recv() == repr(signal.SIG_IGN)
    finally:
        process.join(30)


SERVER_ENDED_SCRIPT = """
import multiprocessing.forkserver, os, sys
from click.testing import CliRunner
from grader.cli import main
first = CliRunner().invoke(main, ["grade", sys.argv[1], "-q"])
os.write(multiprocessing.forkserver._forkserver._forkserver_alive_fd, b"x")  # what a flood does: it ends
second = CliRunner().invoke(main, ["grade", sys.argv[1], "-q"])
print(first.exit_code, second.exit_code, second.output.strip().splitlines()[-1])
"""


@pytest.mark.slow
def test_a_pool_whose_server_was_ended_is_started_again(tmp_path):
    """Outside a sandbox a rank can reach the pool's server: tests/hostile/01_floods_the_grader.py writes into its
    pipe that should stay empty, and it ends. The next process the grader starts (here at once, while the server
    is still on its way out) finds it gone, and the pool starts a new one instead of failing the grading."""
    solution = Path(__file__).resolve().parent.parent / "solutions" / "01_setup.py"
    env = {**os.environ, "DDP_GRADE_STATE_DIR": str(tmp_path), "DDP_GRADE_SERVER": "0"}
    done = subprocess.run([sys.executable, "-c", SERVER_ENDED_SCRIPT, str(solution)], env=env, capture_output=True,
                          text=True, timeout=600)
    first, second, summary = done.stdout.strip().split(" ", 2)
    assert (first, second) == ("0", "0"), done.stdout + done.stderr[-2000:]
    assert summary.startswith("All ") and " checks passed" in summary, summary
