"""`ddp-grade doctor` and the live progress line."""

from __future__ import annotations

import io
import time

import pytest
from click.testing import CliRunner

from grader.cli import main
from grader import live
from grader.live import PLAIN, QUIET, TTY, LiveLine, mode_for


def test_doctor_without_a_group_reports_versions_and_the_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    result = CliRunner().invoke(main, ["doctor", "--no-group"])
    assert result.exit_code == 0, result.output
    for name in ("python", "torch", "gloo", "nccl", "gpus", "state folder"):
        assert f"  {name}" in result.output
    assert str(tmp_path / "state") in result.output


def test_doctor_exits_1_when_the_state_folder_is_not_writable(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(blocker / "state"))
    result = CliRunner().invoke(main, ["doctor", "--no-group"])
    assert result.exit_code == 1
    assert "FAIL  state folder" in result.output and "set DDP_GRADE_STATE_DIR" in result.output


@pytest.mark.slow
def test_doctor_starts_a_real_two_rank_group(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "ok    process group  2 gloo ranks joined, all-reduced and left in" in result.output


def feed(line: LiveLine) -> None:
    line.event("run", driver="join_main", world_size=2)
    line.event("check", check_id="joins-group", status="pass")
    line.event("worker", driver="shard_worker")
    line.done()


def test_the_live_line_rewrites_itself_on_a_terminal_and_is_plain_elsewhere():
    clock = iter(range(100)).__next__
    tty, plain, quiet = io.StringIO(), io.StringIO(), io.StringIO()
    feed(LiveLine("exercise 01", TTY, tty, clock=clock))
    feed(LiveLine("exercise 01", PLAIN, plain, clock=clock))
    feed(LiveLine("exercise 01", QUIET, quiet, clock=clock))
    assert "\r\x1b[K" in tty.getvalue() and tty.getvalue().endswith("\r\x1b[K")
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("grading exercise 01: run 1: join_main on 2 ranks (0 checks decided")
    assert lines[1].startswith("grading exercise 01: run 2: shard_worker in one process (1 check decided")
    assert "\x1b" not in plain.getvalue() and "\r" not in plain.getvalue()
    assert quiet.getvalue() == ""


def test_mode_follows_the_stream():
    assert mode_for(io.StringIO(), quiet=False) == PLAIN
    assert mode_for(io.StringIO(), quiet=True) == QUIET


def test_on_a_terminal_the_clock_keeps_moving_while_a_run_waits(monkeypatch):
    monkeypatch.setattr(live, "TICK_S", 0.02)
    ticks = iter(range(1000)).__next__
    out = io.StringIO()
    line = LiveLine("exercise 04", TTY, out, clock=ticks)
    line.event("run", driver="main", world_size=3, label="two launches at once, then torchrun")
    time.sleep(0.3)  # no event arrives: the line is redrawn anyway, with a later time
    line.done()
    frames = [f for f in out.getvalue().split("\r\x1b[K") if f]
    assert len(frames) >= 3
    assert all("run 1: two launches at once, then torchrun" in f for f in frames)
    assert len({f.rsplit(", ", 1)[-1] for f in frames}) == len(frames)  # every redraw shows a new time
    before = out.getvalue()
    time.sleep(0.1)
    assert out.getvalue() == before  # done() stopped the clock
