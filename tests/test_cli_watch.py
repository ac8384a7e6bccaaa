"""`ddp-grade watch`: the polling loop (fast, with a scripted clock) and the command (slow, real grading)."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from grader.cli import main
from grader.commands.watch import FolderEvents, fingerprint, watch_loop

ROOT = Path(__file__).resolve().parent.parent


def scripted_sleep(edits: dict):
    """A sleep() that performs edits[k]() on its k-th call instead of waiting."""
    calls = {"n": 0}

    def sleep(_seconds):
        calls["n"] += 1
        action = edits.get(calls["n"])
        if action:
            action()

    return sleep


def test_grades_at_start_then_once_per_save(tmp_path):
    f = tmp_path / "01_setup.py"
    f.write_text("v1")
    seen = []
    sleep = scripted_sleep({2: lambda: f.write_text("v2"), 6: lambda: f.write_text("v3 longer")})
    n = watch_loop(f, lambda k: seen.append(f.read_text()), poll_s=0, max_grades=3, sleep=sleep)
    assert n == 3
    assert seen == ["v1", "v2", "v3 longer"]


def test_a_save_with_the_same_content_is_not_graded_again(tmp_path):
    import os

    f = tmp_path / "01_setup.py"
    f.write_text("same")
    seen = []
    stop_after = {"polls": 0}

    def sleep(_s):
        stop_after["polls"] += 1
        if stop_after["polls"] == 2:
            os.utime(f, ns=(1, 1))  # touched: new mtime, same bytes
        if stop_after["polls"] == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        watch_loop(f, seen.append, poll_s=0, sleep=sleep)
    assert seen == [1]


def test_a_file_still_being_written_is_graded_once_it_settles(tmp_path):
    f = tmp_path / "01_setup.py"
    f.write_text("old")
    seen = []
    # poll 2: a first half is written; the settle wait (call 3) sees the rest arrive
    sleep = scripted_sleep({2: lambda: f.write_text("new, first half"), 3: lambda: f.write_text("new, complete")})
    watch_loop(f, lambda k: seen.append(f.read_text()), poll_s=0, max_grades=2, sleep=sleep)
    assert seen == ["old", "new, complete"]


def test_a_deleted_file_and_its_return_are_changes(tmp_path):
    f = tmp_path / "01_setup.py"
    f.write_text("x")
    assert fingerprint(tmp_path / "absent.py").digest == ""
    seen = []
    sleep = scripted_sleep({2: f.unlink, 5: lambda: f.write_text("back")})
    watch_loop(f, lambda k: seen.append(f.exists()), poll_s=0, max_grades=3, sleep=sleep)
    assert seen == [True, False, True]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file events are read with Linux inotify")
@pytest.mark.parametrize("how", ["written in place", "replaced by a rename"])
def test_on_linux_a_save_wakes_the_loop_without_waiting_for_the_next_poll(tmp_path, how):
    f = tmp_path / "01_setup.py"
    f.write_text("v1")
    assert FolderEvents.open(f) is not None
    seen = []
    first = threading.Event()

    def on_change(k):
        seen.append(f.read_text())
        first.set()

    # A poll every 10 minutes: only a file event can bring the second grading within the join below.
    loop = threading.Thread(target=watch_loop, args=(f, on_change), kwargs={"poll_s": 600, "max_grades": 2},
                            daemon=True)
    loop.start()
    assert first.wait(30)
    if how == "written in place":
        f.write_text("v2")
    else:
        (tmp_path / "01_setup.py.tmp").write_text("v2")
        os.replace(tmp_path / "01_setup.py.tmp", f)
    loop.join(60)
    assert not loop.is_alive()
    assert seen == ["v1", "v2"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file events are read with Linux inotify")
def test_a_file_event_says_when_a_save_of_the_watched_file_is_complete(tmp_path):
    f = tmp_path / "03_train.py"
    f.write_text("v1")
    events = FolderEvents.open(f)
    try:
        (tmp_path / "notes.txt").write_text("another file")
        assert events.wait(5) is False  # woken, but not by this file
        os.utime(f)
        assert events.wait(5) is False  # touched: nothing was written
        with open(f, "a") as handle:
            handle.write("# more")
            handle.flush()
            assert events.wait(5) is False  # written, still open: may not be complete
        assert events.wait(5) is True  # closed after writing
        (tmp_path / "03_train.py.swp").write_text("v3")
        os.replace(tmp_path / "03_train.py.swp", f)
        assert events.wait(5) is True  # renamed onto it, as many editors save
        assert events.wait(0.05) is False  # nothing new
    finally:
        events.close()


def test_watch_command_grades_the_file_in_one_warm_session(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    f = tmp_path / "01_setup.py"
    shutil.copy(ROOT / "solutions" / "01_setup.py", f)
    result = CliRunner().invoke(main, ["watch", str(f), "--max-grades", "1", "--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "checks passed" in result.output and "save the file to grade again" in result.output


def test_watch_moves_on_by_itself_to_the_next_exercise_after_a_pass_of_the_kits_file(tmp_path, monkeypatch):
    from grader import catalog, kit
    from grader.progress import Progress

    root = tmp_path / "kit"
    (root / "exercises").mkdir(parents=True)
    for ex in catalog.exercises()[:3]:
        (root / "exercises" / ex.filename).write_text(kit.stub_text(ex), encoding="utf-8")
    shutil.copy(ROOT / "solutions" / "01_setup.py", root / "exercises" / "01_setup.py")
    monkeypatch.setenv("DDP_GRADE_ROOT", str(root))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DDP_GRADE_SERVER", "0")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["watch", "01", "--max-grades", "2", "--world-size", "2"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    said = [out.index(words) for words in ("Watching kit/exercises/01_setup.py: grading it now", "checks passed",
                                           "Passed! Moving on to 02", "press Enter", "Watching kit/exercises/02_",
                                           "grading 2 of")]
    assert said == sorted(said), out
    assert "02_shard.py" in out[said[-1]:].splitlines()[0]
    assert "not implemented" in out[said[4]:said[5]].lower(), out
    assert Progress().passed("01") and not Progress().passed("02")


def test_watch_grades_through_the_warm_server_when_one_answers_and_starts_no_pool_of_its_own(tmp_path, monkeypatch):
    from grader import server
    from grader.rank import harness
    from grader.results import Report

    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DDP_GRADE_SERVER", "1")
    f = tmp_path / "01_setup.py"
    shutil.copy(ROOT / "solutions" / "01_setup.py", f)
    asked = []
    monkeypatch.setattr(server, "_answering", lambda: True)
    monkeypatch.setattr(server, "grade_remote", lambda path, exercise_id, options, on_event=None:
                        asked.append(path) or Report("01", "Join and leave a process group", path, "failed"))

    def no_pool(*args, **kwargs):
        raise AssertionError("watch started a pool of its own while the server answered")

    monkeypatch.setattr(harness, "Session", no_pool)
    result = CliRunner().invoke(main, ["watch", str(f), "--max-grades", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].endswith("grading it now through the warm grading server.")
    assert asked == [str(f)] and "grading 1 of" in result.output


def test_watch_of_an_unknown_exercise_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    result = CliRunner().invoke(main, ["watch", "99"])
    assert result.exit_code == 2 and "unknown exercise '99'" in result.output
    missing = CliRunner().invoke(main, ["watch", str(tmp_path / "nope.py")])
    assert missing.exit_code == 2 and "no such file" in missing.output


def _what_runs(tag: str, env: dict) -> str:
    """For a failure's message: the processes carrying ``tag`` (state, process group, command, Python stack
    where it has faulthandler), and the environment the command was given beyond the test's own."""
    import background

    lines = []
    for pid in background.processes_carrying(tag):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            with open(f"/proc/{pid}/wchan") as f:
                waiting = f.read().strip()
            lines.append(f"pid {pid} pgid {os.getpgid(pid)} state {state} wchan {waiting}: {command}")
        except OSError:
            pass
    keys = sorted(k for k in env if k.startswith(("DDP_", "MASTER_", "RANK", "WORLD_", "LOCAL_", "TORCH", "GROUP_")))
    return "processes: " + "; ".join(lines) + f" | environment: {[(k, env[k][:60]) for k in keys]}"


# `ddp-grade watch FILE` with Ctrl-C at one moment of its second grading (the re-grade after a save, whose ranks
# are the spares forked after the first): the command sends SIGINT to its own process group, as a terminal does (the
# command, its warm pool and its spares), when its own code reaches that moment. The ranks' moments are the
# learner's file's own doing (CTRL_C_FROM_THE_FILE), once, from the first rank that gets there.
CTRL_C_AT = """
import os, signal, sys, threading
from grader.rank import harness
from grader.commands import watch

moment, path = sys.argv[1], sys.argv[2]
runs, sent = [], []


def ctrl_c():
    if not sent:
        sent.append(moment)
        os.killpg(os.getpgrp(), signal.SIGINT)


def patch(owner, name, before=None, after=None):
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        if before and before():
            ctrl_c()
        result = original(*args, **kwargs)
        if after and after():
            ctrl_c()
        return result

    setattr(owner, name, patched)


second = lambda: len(runs) >= 2
patch(harness.Session, "run_many", before=lambda: runs.append(1) and False)
if moment == "specs handed out":  # the first rank has its spec, the others not yet
    patch(harness.Session, "_start", after=second)
elif moment == "results being read":
    patch(harness, "_receive", before=second)
elif moment == "spares being forked":
    patch(harness.Session, "_fork", after=lambda: second() and threading.current_thread().name == "ddp-grade spares")
elif moment == "between gradings":  # the second grading's report is out; watch waits for the next save
    patch(watch.FolderEvents, "wait", before=second)
from grader.cli import main
sys.argv = ["ddp-grade", "watch", path, "--world-size", "1"]
main()
"""
# What the save adds to the learner's file for the moments in its ranks: the first rank there sends Ctrl-C to the
# command's process group (its pool's), and every rank then sleeps past any deadline of the test.
CTRL_C_FROM_THE_FILE = """
import os, signal, time


def _ctrl_c_then_sleep():
    try:
        os.close(os.open({first!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        os.killpg(os.getpgid(os.getppid()), signal.SIGINT)
    except FileExistsError:
        pass
    time.sleep(300)
"""
MOMENTS = ["specs handed out", "ranks importing", "ranks running", "results being read", "spares being forked",
           "between gradings"]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.parametrize("moment", MOMENTS)
def test_ctrl_c_at_any_moment_of_a_grading_stops_watch_with_one_line_and_leaves_nothing(moment, tmp_path):
    """Ctrl-C as a terminal sends it, at each moment of a re-grade in turn: watch ends with exit 0 (as documented),
    'Stopped watching.' its one last line, no traceback from any process, and no process left (the learner's ranks
    asleep for 300 s included)."""
    import signal
    import subprocess
    import time
    import uuid

    import background
    from conftest import ctrl_c_reaches_it

    f = tmp_path / "01_setup.py"
    shutil.copy(ROOT / "solutions" / "01_setup.py", f)
    tag = uuid.uuid4().hex
    env = {**os.environ, "DDP_GRADE_TEST_TAG": tag, "DDP_GRADE_STATE_DIR": str(tmp_path / "state")}
    command = subprocess.Popen([sys.executable, "-c", CTRL_C_AT, moment, str(f)], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=ctrl_c_reaches_it)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(command.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("grading 1 of" in line for line in out):
            assert command.poll() is None and time.monotonic() < deadline, f"the first grading: {''.join(out)[-2000:]}"
            time.sleep(0.05)
        saved = f.read_text() + CTRL_C_FROM_THE_FILE.format(first=str(tmp_path / "first"))
        if moment == "ranks importing":
            saved += "\n_ctrl_c_then_sleep()\n"
        elif moment == "ranks running":
            saved += "\n\ndef setup_ddp(rank, world_size, backend=None):\n    _ctrl_c_then_sleep()\n"
        f.write_text(saved)
        try:
            command.wait(timeout=240)  # the learner's ranks sleep 300 s: stopped, not waited for
        except subprocess.TimeoutExpired:
            raise AssertionError(f"watch still running 240 s after Ctrl-C at '{moment}'; {_what_runs(tag, env)}; "
                                 f"{''.join(out)[-1500:]}") from None
        reader.join(timeout=10)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    errors = command.stderr.read()
    assert command.returncode == 0, errors[-2000:]
    shown = "".join(out) + errors
    assert "Traceback" not in shown and "KeyboardInterrupt" not in shown, shown[-3000:]
    lines = [line.strip() for line in out if line.strip()]
    assert lines[-1] == "Stopped watching." and lines.count("Stopped watching.") == 1, shown[-3000:]
    assert background.processes_carrying(tag) == []
