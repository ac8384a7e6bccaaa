"""`--sandbox`: untrusted code sees loopback only, not the home folder, cannot write outside its
run, and leaves no process behind; with bwrap and with unshare alone. No test sends traffic
anywhere: the network check only lists interfaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from background import processes_carrying
from conftest import ROOT
from grader import sandbox

pytestmark = pytest.mark.slow

FILES = ROOT / "tests" / "sandboxed"
TOOLS = [pytest.param(name, marks=pytest.mark.skipif(sandbox._tool(name) is None, reason=f"{name} does not work here"))
         for name in (sandbox.BWRAP, sandbox.UNSHARE)]


def grade(path: Path, tool: str | None, **env) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "grader", str(path), "-q", "--no-server", "--world-size", "2", "--timeout", "30"]
    full_env = {**os.environ, **env}
    if tool:
        args.append("--sandbox")
        full_env[sandbox.TOOL_ENV] = tool
    return subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandboxed_rank_sees_only_loopback(tool):
    done = grade(FILES / "01_lists_interfaces.py", tool)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]


@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandboxed_rank_cannot_read_the_home_folder(tool):
    folder = Path.home() / f".ddp-grade-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        (folder / "secret").write_text("hunter2")
        outside = grade(FILES / "01_reads_home.py", None, DDP_GRADE_TEST_SECRET=str(folder / "secret"))
        assert outside.returncode == 1 and "read the secret: hunter2" in outside.stdout  # the file does try
        inside = grade(FILES / "01_reads_home.py", tool, DDP_GRADE_TEST_SECRET=str(folder / "secret"))
        assert inside.returncode == 0, inside.stdout[-2000:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandboxed_rank_cannot_write_outside_its_run(tool, tmp_path):
    for target in (tmp_path / "written.txt", ROOT / f".written-{uuid.uuid4().hex[:8]}"):
        done = grade(FILES / "01_writes_outside.py", tool, DDP_GRADE_TEST_OUTSIDE=str(target))
        assert done.returncode == 0, done.stdout[-2000:]
        assert not target.exists(), f"a rank wrote {target}"
        target.unlink(missing_ok=True)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_daemon_started_in_the_sandbox_does_not_outlive_it(tool):
    tag = uuid.uuid4().hex
    done = grade(ROOT / "tests" / "hostile" / "01_daemon.py", tool, DDP_GRADE_TEST_TAG=tag)
    assert done.returncode == 0, done.stdout[-2000:]
    assert processes_carrying(tag) == []


def test_without_a_tool_sandbox_is_refused_with_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    done = subprocess.run([sys.executable, "-m", "grader", str(ROOT / "solutions" / "01_setup.py"), "--sandbox",
                           "--no-server"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": "/nonexistent"})
    assert done.returncode == 2
    assert "--sandbox needs bwrap" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandboxed_rank_cannot_change_the_file_it_was_given_in_home_or_tmp(tool, tmp_path):
    home = Path.home() / f".ddp-grade-test-{uuid.uuid4().hex[:8]}"
    try:
        for folder in (home, tmp_path):  # both are hidden and the file is bound back in: read-only
            folder.mkdir(exist_ok=True)
            target = folder / "01_setup.py"
            shutil.copy(FILES / "01_writes_outside.py", target)
            before = target.read_bytes()
            done = grade(target, tool, DDP_GRADE_TEST_OUTSIDE=str(target))
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]
            assert target.read_bytes() == before, f"a rank rewrote {target}"
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("tool", TOOLS)
def test_batch_grades_each_submission_in_a_sandbox_of_its_own(tool, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from grader.cli import main

    tag = uuid.uuid4().hex
    secret = Path.home() / f".ddp-grade-test-{uuid.uuid4().hex[:8]}"
    learners = tmp_path / "class"
    for name, source in [("alice", FILES / "01_lists_interfaces.py"), ("bob", FILES / "01_writes_outside.py"),
                         ("carol", FILES / "01_reads_home.py"), ("dave", ROOT / "tests" / "hostile" / "01_daemon.py")]:
        (learners / name).mkdir(parents=True)
        shutil.copy(source, learners / name / "01_setup.py")
    alice = learners / "alice" / "01_setup.py"
    before = alice.read_bytes()
    monkeypatch.setenv(sandbox.TOOL_ENV, tool)
    monkeypatch.setenv("DDP_GRADE_TEST_TAG", tag)
    monkeypatch.setenv("DDP_GRADE_TEST_OUTSIDE", str(alice))  # bob writes into a classmate's file
    monkeypatch.setenv("DDP_GRADE_TEST_SECRET", str(secret / "secret"))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    secret.mkdir()
    try:
        (secret / "secret").write_text("hunter2")
        result = CliRunner().invoke(main, ["batch", str(learners), "--world-size", "2", "--timeout", "30",
                                           "--format", "json", "-q"])
    finally:
        shutil.rmtree(secret, ignore_errors=True)
    data = json.loads(result.output)
    assert {r["submission"]: r["status"] for r in data["reports"]} == {
        f"{name}/01_setup.py": "passed" for name in ("alice", "bob", "carol", "dave")}, result.output[-3000:]
    assert alice.read_bytes() == before, "a submission wrote into another submission's file"
    assert processes_carrying(tag) == []


@pytest.mark.parametrize("tool", TOOLS)
def test_a_kit_kept_under_tmp_grades_in_the_sandbox(tool):
    """Inside, /tmp is an empty folder; the kit kept there, and the learner's file inside the kit,
    are bound back read-only (the file is seen through the kit's folder, not bound a second time)."""
    kit = Path(tempfile.mkdtemp(prefix="ddp-grade-kit-", dir="/tmp"))
    try:
        shutil.copytree(ROOT / "grader", kit / "grader", ignore=shutil.ignore_patterns("__pycache__"))
        (kit / "solutions").mkdir()
        shutil.copy(ROOT / "solutions" / "01_setup.py", kit / "solutions")
        env = {**os.environ, "PYTHONPATH": str(kit), sandbox.TOOL_ENV: tool}
        # From the kit's own folder, so that `-m grader` is the copy under /tmp.
        done = subprocess.run([sys.executable, "-m", "grader", "solutions/01_setup.py", "-q", "--no-server",
                               "--world-size", "2", "--timeout", "30", "--sandbox"], cwd=kit, env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(kit, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]
    assert "checks passed" in done.stdout, done.stdout[-2000:]
