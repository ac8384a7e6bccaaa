"""The state folder under stress: gradings at once keep every record, and a folder that cannot be
written, a file of the wrong shape or a path that leads nowhere each get a clear line, never a traceback."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from grader import catalog, kit
from grader.progress import Progress
from grader.state import StateFile


def _record_many(state_dir: str, worker: int, rounds: int, start) -> None:
    os.environ["DDP_GRADE_STATE_DIR"] = state_dir
    start.wait()
    for k in range(rounds):
        Progress().record_grading(f"w{worker}-{k}", "passed")
        Progress().next_hint(catalog.by_id("01"))


def test_eight_processes_recording_at_once_lose_nothing(tmp_path):
    """Eight processes, each a Progress of its own read at its start (as eight commands would), record
    twenty gradings each at the same time: all 160 are in the file."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(8)
    workers = [ctx.Process(target=_record_many, args=(str(tmp_path), w, 20, start)) for w in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    data = json.loads((tmp_path / "progress.json").read_text())
    recorded = {k for k, v in data["exercises"].items() if v.get("passed")}
    assert recorded == {f"w{w}-{k}" for w in range(8) for k in range(20)}
    assert data["exercises"]["01"]["hints_shown"] == len(catalog.by_id("01").hints)


def test_a_stale_progress_object_does_not_undo_another_commands_record(tmp_path):
    state = StateFile("progress.json", tmp_path)
    watch, grading = Progress(StateFile("progress.json", tmp_path)), Progress(StateFile("progress.json", tmp_path))
    grading.record_grading("03", "passed")  # another command, while watch holds what it read at its start
    watch.record_grading("01", "failed")
    after = Progress(state)
    assert after.passed("03") and after.entry("01")["last_status"] == "failed"


# --- through the command line --------------------------------------------------------------------


@pytest.fixture
def kit_with_state(tmp_path):
    """A kit copy (stubs in exercises/, 01 solved) and a state folder: (kit, state, env)."""
    root = tmp_path / "kit"
    (root / "exercises").mkdir(parents=True)
    for ex in catalog.exercises():
        stub = kit.stub_text(ex)
        if stub is not None:
            (root / "exercises" / ex.filename).parent.mkdir(exist_ok=True)
            (root / "exercises" / ex.filename).write_text(stub, encoding="utf-8")
    shutil.copy(ROOT / "solutions" / "01_setup.py", root / "exercises" / "01_setup.py")
    state = tmp_path / "state"
    state.mkdir()
    env = {**os.environ, "DDP_GRADE_ROOT": str(root), "DDP_GRADE_STATE_DIR": str(state), "DDP_GRADE_SERVER": "0"}
    return root, state, env


def _read_only(folder: Path, argv: list[str]) -> list[str]:
    """``argv`` run where ``folder`` is read-only: a read-only bind mount in a mount namespace of its own
    (root writes through a folder's permissions), or the folder's permissions for anyone else."""
    if os.geteuid() != 0:
        folder.chmod(0o500)
        return argv
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare: no way to make a folder read-only here")
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(folder), *argv]


def _ddp_grade(args: list[str], env: dict, cwd: Path, read_only: Path | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "grader", *args]
    if read_only is not None:
        argv = _read_only(read_only, argv)
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    if read_only is not None and "unshare failed" in done.stderr:
        pytest.skip(f"unshare does not work here: {done.stderr.strip()}")
    return done


@pytest.mark.slow
def test_a_read_only_state_folder_still_gives_the_verdict_and_says_progress_was_not_saved(kit_with_state):
    root, state, env = kit_with_state
    done = _ddp_grade(["exercises/01_setup.py", "-q"], env, root, read_only=state)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "All 8 checks passed;" in done.stdout
    why = "Read-only file system" if os.geteuid() == 0 else "Permission denied"  # as _read_only made it
    assert "progress was not saved" in done.stderr and why in done.stderr, done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_reset_hint_and_list_with_a_read_only_state_folder(kit_with_state):
    root, state, env = kit_with_state
    mine = (root / "exercises" / "01_setup.py").read_bytes()
    reset = _ddp_grade(["reset", "01"], env, root, read_only=state)
    assert reset.returncode == 2, reset.stdout + reset.stderr
    assert "cannot keep a copy" in reset.stderr and "nothing was changed" in reset.stderr
    assert (root / "exercises" / "01_setup.py").read_bytes() == mine  # the learner's file is untouched
    hint = _ddp_grade(["hint", "02"], env, root, read_only=state)
    assert hint.returncode == 0 and "progress was not saved" in hint.stderr, hint.stdout + hint.stderr
    listing = _ddp_grade(["list"], env, root, read_only=state)
    assert listing.returncode == 0 and "01" in listing.stdout
    for done in (reset, hint, listing):
        assert "Traceback" not in done.stdout + done.stderr


def test_a_progress_file_of_the_wrong_shape_is_kept_aside_with_a_message(kit_with_state):
    root, state, env = kit_with_state
    (state / "progress.json").write_text(json.dumps({"exercises": ["01", "02"]}))
    done = _ddp_grade(["list"], env, root)
    assert done.returncode == 0
    assert "could not be read" in done.stderr
    kept = list(state.glob("progress.json.corrupt-*"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == {"exercises": ["01", "02"]}


@pytest.mark.parametrize("how", [[], ["--sandbox"], ["watch"], ["batch"]])
def test_a_symlink_loop_is_named_with_exit_2(kit_with_state, tmp_path, how):
    root, _, env = kit_with_state
    loop = tmp_path / "01_loop.py"
    loop.symlink_to(loop)
    if how == ["--sandbox"]:
        from grader import sandbox

        if sandbox.tool() is None:
            pytest.skip("no sandbox tool here")
    args = [*how, str(loop)] if how in (["watch"], ["batch"]) else [str(loop), *how]
    done = _ddp_grade(args + ["-q"] + (["--format", "json"] if how == ["batch"] else []), env, root)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    # batch grades only a submission's own files: any link is refused as one, a loop included
    assert str(loop) in said and ("symbolic link" if how == ["batch"] else "Too many levels of symbolic links") in said
    assert "Traceback" not in said


@pytest.mark.slow
def test_eight_kit_files_graded_at_once_leave_eight_records(kit_with_state):
    root, state, env = kit_with_state
    chosen = [ex for ex in catalog.exercises() if (root / "exercises" / ex.filename).exists()][:8]
    assert len(chosen) == 8
    commands = [subprocess.Popen([sys.executable, "-m", "grader", f"exercises/{ex.filename}", "-q", "--no-server"],
                                 env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for ex in chosen]
    for c in commands:
        _, err = c.communicate(timeout=300)
        assert "Traceback" not in err, err
    data = json.loads((state / "progress.json").read_text())
    assert sorted(data["exercises"]) == sorted(ex.id for ex in chosen)
    assert data["exercises"]["01"].get("passed")  # the solved one passed, the stubs were graded
    assert all(data["exercises"][ex.id].get("last_status") for ex in chosen)
