"""A submission decides nothing: whatever its ranks send or do to the grader's processes, under
``--sandbox`` with each tool present and through ``batch``, it gets the verdict its code deserves,
within its deadline plus a margin, and every other submission keeps its own row.

The hostile files are in tests/hostile/ (graded plain by tests/test_hostile.py too); the sandboxed
ones that must not see something are in tests/sandboxed/."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT
from grader import catalog, sandbox
from grader.sandbox import confined

pytestmark = pytest.mark.slow

HOSTILE = ROOT / "tests" / "hostile"
SANDBOXED = ROOT / "tests" / "sandboxed"
SOLUTION = ROOT / "solutions" / "01_setup.py"
TOOLS = [pytest.param(name, marks=pytest.mark.skipif(sandbox._tool(name) is None, reason=f"{name} does not work here"))
         for name in (sandbox.BWRAP, sandbox.UNSHARE)]
ANY_TOOL = pytest.mark.skipif(sandbox.tool() is None, reason="no sandbox tool works here")


def one_tool(preferred: str) -> list:
    """One run, under ``preferred`` where it works here, else under the other tool. The attacks whose
    containment does not depend on how the sandbox was made (the grader's reading, polling and deadlines)
    run once, shared between the tools; what each tool builds itself (the files a rank sees, its PID
    namespace) and the forged verdict run under both."""
    order = [preferred] + [name for name in (sandbox.BWRAP, sandbox.UNSHARE) if name != preferred]
    name = next((name for name in order if sandbox._tool(name) is not None), None)
    if name is None:
        return [pytest.param(preferred, marks=pytest.mark.skip(reason="no sandbox tool works here"))]
    return [pytest.param(name, id=name)]
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def run(args: list[str], tool: str | None, state: Path, *, env: dict | None = None,
        watch_memory: bool = False) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``python -m grader ARGS`` (sandboxed by ``tool``), and the peak resident memory of that
    process itself (not of what it starts) when ``watch_memory``."""
    full_env = {**os.environ, "DDP_GRADE_STATE_DIR": str(state), "DDP_GRADE_SERVER": "0", **(env or {})}
    if tool:
        full_env[sandbox.TOOL_ENV] = tool
    proc = subprocess.Popen([sys.executable, "-m", "grader", *args], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = [0]

    def watch() -> None:
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except OSError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True) if watch_memory else None
    if watcher:
        watcher.start()
    out, err = proc.communicate(timeout=600)
    if watcher:
        watcher.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak[0]


def report_of(done: subprocess.CompletedProcess) -> dict:
    return json.loads(done.stdout)


# --- one grading under --sandbox ---------------------------------------------------------------------


@pytest.mark.parametrize("tool", TOOLS)
def test_a_forged_all_pass_report_fails(tool, tmp_path):
    """The rank writes a well-formed all-pass report into every pipe of the grader process in its
    sandbox: it opens none (the host is out of its reach), and the file gets its own verdict."""
    done, _ = run([str(HOSTILE / "01_forges_verdict.py"), "--sandbox", "--format", "json"], tool, tmp_path)
    report = report_of(done)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert report["status"] == "failed" and report["exit_code"] == 1 and report["run_problem"] is None
    assert {c["id"]: c["status"] for c in report["checks"]}["timeout-set"] == "fail"  # its own mistake


@pytest.mark.parametrize("tool", TOOLS)
def test_no_rank_can_speak_as_the_sandboxs_host(tool, tmp_path):
    """The rank tries every way to the host's pipes (/proc/PID/fd, its memory, ptrace, pidfd_getfd, what it
    inherited, with the host stopped meanwhile) and writes the host's 'failed' answer through each that
    opens: none opens, the grader never shows the forged words, and the file fails on the rank's own."""
    done, _ = run([str(SANDBOXED / "01_speaks_as_the_host.py"), "--sandbox", "--format", "json"], tool, tmp_path)
    report = report_of(done)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "FORGED_BY_A_RANK" not in done.stdout + done.stderr
    assert "reached nothing" in report["problem"], report["problem"]
    assert report["score"]["points"] == 0


def _alive(pid: int, started: bytes) -> bool:
    """Whether the process ``pid`` that started at ``started`` (its /proc stat field) is alive, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == started and fields[0] not in (b"Z", b"X")


def _tree(root: int) -> dict[int, bytes]:
    """{pid: start time} of ``root`` and every process under it."""
    from grader.rank.processes import descendants

    found = {}
    for pid in [root, *descendants(root)]:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                found[pid] = f.read().rsplit(b")", 1)[1].split()[19]
        except OSError:
            continue
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@pytest.mark.parametrize("tool", TOOLS)
def test_nothing_of_a_sandbox_outlives_a_killed_grader(tool, tmp_path):
    """The grader is killed (SIGKILL: nothing of it runs after) while its sandbox runs the ranks and a daemon
    they left: the sandbox ends with it (its host sees the grader's end of its pipe close, and is the first
    process of its PID namespace), daemon included."""
    env = {**os.environ, "DDP_GRADE_STATE_DIR": str(tmp_path), "DDP_GRADE_SERVER": "0", sandbox.TOOL_ENV: tool}
    proc = subprocess.Popen([sys.executable, "-m", "grader", str(SANDBOXED / "01_outlives_the_grader.py"), "--sandbox",
                             "--timeout", "300", "-q"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        tree: dict[int, bytes] = {}
        while proc.poll() is None and not any(_comm(pid) == "ddp-left-behind" for pid in tree):
            time.sleep(0.5)
            tree = _tree(proc.pid)
        assert proc.poll() is None, "the grading ended before its daemon was seen"
    finally:
        proc.kill()
        proc.wait()
    waited = 0.0
    while any(_alive(pid, started) for pid, started in tree.items()) and waited < 120:
        time.sleep(0.5)
        waited += 0.5
    left = [f"{pid} {_comm(pid)}" for pid, started in tree.items() if _alive(pid, started)]
    for pid in (pid for pid, started in tree.items() if _alive(pid, started)):  # not left to the rest of the suite
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"alive {waited:g} s after the grader was killed: {left}"


@pytest.mark.parametrize("tool", TOOLS)
def test_what_no_walk_or_resident_set_shows_is_stopped_by_a_limit(tool, tmp_path):
    """The file is right but for one process that tries to hold, in turn, what the grader's readings did not
    see: 2 GiB in a memfd, then in System V shared memory, over a 1,792 MiB limit; an unlinked file over the
    tmp limit; 30,000 nested folders; 5,000 threads. It passes if it keeps any. The kernel refuses each
    (ENOSYS; the ranks' tmpfs's size, then its number of files; RLIMIT_NPROC or a pids cgroup), each named in
    its own words, and the grader stays small. The output limit is raised above the tmp limit: at 64 MiB each,
    a tmpfs with room for the whole 64 MiB lets RLIMIT_FSIZE refuse the next write first (EFBIG, as CI saw)."""
    done, peak = run([str(SANDBOXED / "01_escapes_the_limits.py"), "--sandbox", "--format", "json",
                      "--memory-limit", "1792", "--tmp-limit", "64", "--output-limit", "256"], tool, tmp_path,
                     watch_memory=True)
    report = report_of(done)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    stopped = re.search(r"held nothing out of sight: (.*?) \(01_escapes", report["problem"])
    assert stopped, report["problem"]
    assert re.fullmatch(r"memfd_create: Function not implemented; shmget: Function not implemented; "
                        r"unlinked file: No space left on device after (\d+) MiB; "
                        r"folders: No space left on device after ([\d,]+); "
                        r"threads: can't start new thread after ([\d,]+)", stopped.group(1)), stopped.group(1)
    written, folders, threads = (int(n.replace(",", "")) for n in re.findall(r"after ([\d,]+)", stopped.group(1)))
    assert written <= 64 and folders < sandbox.RANKS_FILES and threads < confined.MAX_TASKS, stopped.group(1)
    assert "ranks' folder limit (64 MiB each" in report["problem"]
    assert 0 < peak < 2**30, f"the ddp-grade process reached {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("tool", one_tool(sandbox.UNSHARE))
def test_a_gigabyte_without_a_newline_keeps_the_grader_small(tool, tmp_path):
    """The rank looks for every pipe of the grader's processes it can reach, and reaches none in a sandbox
    (the host and its pool are out of its reach): the gigabyte goes into its own output, of which the grader
    reads only the end, and the file fails on its own words."""
    done, peak = run([str(HOSTILE / "01_floods_the_grader.py"), "--sandbox", "--timeout", "60", "--format", "json"],
                     tool, tmp_path, watch_memory=True)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "RuntimeError: flooded" in report_of(done)["problem"], report_of(done)["problem"]
    assert 0 < peak < 2**30, f"the ddp-grade process reached {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("tool", one_tool(sandbox.BWRAP))
def test_children_over_the_memory_limit_are_caught(tool, tmp_path):
    done, _ = run([str(HOSTILE / "01_forking_memory_hog.py"), "--sandbox", "--timeout", "60",
                   "--memory-limit", "512"], tool, tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "memory limit" in done.stdout


@pytest.mark.parametrize("tool", TOOLS)
def test_a_stopped_grader_process_ends_as_a_timeout_within_the_deadline(tool, tmp_path):
    done, _ = run([str(HOSTILE / "01_stops_the_grader.py"), "--sandbox", "--timeout", "10", "--format", "json"],
                  tool, tmp_path)
    report = report_of(done)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]  # not 2: the deadline held
    assert report["status"] == "timeout"


@pytest.mark.parametrize("tool", one_tool(sandbox.UNSHARE))
def test_fifos_and_links_in_what_the_ranks_leave_do_not_hang_the_grader(tool, tmp_path):
    """33's checkpoint folder holds a FIFO and a link (a right answer otherwise); 21's log is a FIFO."""
    done, _ = run([str(HOSTILE / "33_fifo_in_checkpoint.py"), "--sandbox", "-q"], tool, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    done, _ = run([str(HOSTILE / "21_log_is_a_fifo.py"), "--sandbox", "-q", "--format", "json"], tool, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert report_of(done)["status"] == "failed"  # the FIFO was refused, not waited on until the deadline


@pytest.mark.parametrize("tool", one_tool(sandbox.BWRAP))
def test_control_sequences_never_reach_the_terminal(tool, tmp_path):
    done, _ = run([str(HOSTILE / "01_prints_escapes.py"), "--sandbox", "-v"], tool, tmp_path)
    assert done.returncode == 1
    assert "clipboard set" in done.stdout
    assert CONTROL.findall(done.stdout) == [] and CONTROL.findall(done.stderr) == []
    as_json, _ = run([str(HOSTILE / "01_prints_escapes.py"), "--sandbox", "--format", "json"], tool, tmp_path)
    assert "\x1b" not in as_json.stdout and "clipboard set" in report_of(as_json)["problem"]


@pytest.mark.parametrize("tool", TOOLS)
def test_a_rank_sees_neither_the_kit_nor_another_submission(tool, tmp_path):
    other = tmp_path / "class" / "bob" / "01_setup.py"
    other.parent.mkdir(parents=True)
    shutil.copy(SOLUTION, other)
    env = {"DDP_GRADE_TEST_KIT": str(ROOT), "DDP_GRADE_TEST_OTHER": str(other),
           sandbox.PASS_ENV: "DDP_GRADE_TEST_KIT DDP_GRADE_TEST_OTHER"}
    inside = tmp_path / "class" / "eve" / "01_setup.py"
    inside.parent.mkdir(parents=True)
    shutil.copy(SANDBOXED / "01_reads_kit.py", inside)
    done, _ = run([str(inside), "--sandbox", "-q"], tool, tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    outside, _ = run([str(inside), "-q"], None, tmp_path, env=env)  # the file does look
    assert outside.returncode == 1 and "can read" in outside.stdout


@pytest.mark.parametrize("tool", one_tool(sandbox.BWRAP))
def test_a_state_folder_that_loops_is_no_traceback(tool, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    for args in ([str(SOLUTION), "--sandbox", "-q"], ["batch", str(SOLUTION), "--sandbox", "-q"]):
        done, _ = run(args, tool, loop)
        assert "Traceback" not in done.stderr + done.stdout, done.stderr[-2000:]
        assert done.returncode in (0, 2), done.stderr[-2000:]


@pytest.mark.parametrize("tool", one_tool(sandbox.BWRAP))
def test_bytes_and_sets_in_a_ranks_error_still_give_a_json_report_and_their_own_row(tool, tmp_path):
    done, _ = run([str(HOSTILE / "01_bytes_in_its_error.py"), "--sandbox", "--format", "json"], tool, tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert report_of(done)["status"] == "failed" and "Traceback" not in done.stderr
    learners = _class(tmp_path, {"a_bytes": HOSTILE / "01_bytes_in_its_error.py", "b_right": SOLUTION})
    data, done = _batch(learners, tmp_path, "--jobs", "1", "--sandbox", tool=tool)
    status = {r["submission"]: r["status"] for r in data["reports"]}
    assert status == {"a_bytes/01_setup.py": "failed", "b_right/01_setup.py": "passed"}, status
    assert done.returncode == 1  # not 2: the worker did not die on the first row


# --- no answer inside the sandbox: a submission that imports the grader's own ------------------------------

# 07's expected sum, 35's reference cast, 37's slicing, 41's cost model, 44's resilience model: each imported
# from the grader's side, which a sandbox does not hold (tests/test_rank_side.py).
ANSWER_IMPORTS = sorted(SANDBOXED.glob("[0-9][0-9]_imports_*.py"))


def _no_point(report: dict) -> list[str]:
    """The checks a report gives points for (passed, or skipped: Gradescope scores a skip as passed)."""
    return [c["id"] for c in report["checks"] if c["status"] in ("pass", "skip")]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("path", ANSWER_IMPORTS, ids=lambda p: p.name[:2])
def test_a_submission_that_imports_the_graders_answers_fails_without_a_point(tool, path, tmp_path):
    done, _ = run([str(path), "--sandbox", "--timeout", "300", "--format", "json"], tool, tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    report = report_of(done)
    assert report["status"] == "failed" and _no_point(report) == [], _no_point(report)
    if catalog.by_id(path.name[:2]).functions[0] in ("training_memory", "goodput"):  # a worker's call: the report
        # names the import that failed (`from grader import capacity` says "cannot import name", not "No module")
        assert re.search(r"No module named 'grader\.|cannot import name '\w+' from 'grader'", json.dumps(report)), \
            report["checks"]


def test_plain_the_learners_own_kit_gives_the_model_away(tmp_path):
    """What docs/guarantees.md says of plain gradings: the learner's own kit holds the grader's side (and its
    solutions/), so there the same import finds the model and 44 passes. The attack is real."""
    done, _ = run([str(ANSWER_IMPORTS[-1]), "--format", "json"], None, tmp_path)  # the resilience model's
    assert done.returncode == 0, done.stdout[-2000:]


@ANY_TOOL
def test_in_a_sandboxed_batch_each_import_of_an_answer_is_its_own_failed_row(tmp_path):
    learners = tmp_path / "class"
    for path in ANSWER_IMPORTS:
        (learners / f"eve_{path.name[:2]}").mkdir(parents=True)
        shutil.copy(path, learners / f"eve_{path.name[:2]}" / catalog.by_id(path.name[:2]).filename)
    (learners / "bob").mkdir()
    honest = catalog.by_id(ANSWER_IMPORTS[-1].name[:2]).filename  # a pure function's exercise: quick
    shutil.copy(ROOT / "solutions" / honest, learners / "bob" / honest)
    done, _ = run(["batch", str(learners), "--format", "json", "-q", "--timeout", "300", "--jobs", "1", "--sandbox"],
                  None, tmp_path)
    data = json.loads(done.stdout)
    rows = {r["submission"].split("/")[0]: r for r in data["reports"]}
    assert rows["bob"]["status"] == "passed", rows["bob"]
    for path in ANSWER_IMPORTS:
        row = rows[f"eve_{path.name[:2]}"]
        assert row["status"] == "failed" and _no_point(row) == [], (path.name, _no_point(row))
    assert done.returncode == 1


# --- batch: one submission, one row ----------------------------------------------------------------------


def _class(tmp_path: Path, files: dict[str, Path]) -> Path:
    learners = tmp_path / "class"
    for name, source in files.items():
        (learners / name).mkdir(parents=True)
        shutil.copy(source, learners / name / "01_setup.py")
    return learners


def _batch(folder: Path, tmp_path: Path, *args: str, tool: str | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    done, _ = run(["batch", str(folder), "--format", "json", "-q", "--timeout", "30", *args], tool, tmp_path)
    return json.loads(done.stdout), done


@ANY_TOOL
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_right_answer_between_hostile_ones_keeps_its_row(jobs, tmp_path):
    learners = _class(tmp_path, {"a_forger": HOSTILE / "01_forges_verdict.py", "b_right": SOLUTION,
                                 "c_flood": HOSTILE / "01_floods_the_grader.py", "d_right": SOLUTION})
    data, done = _batch(learners, tmp_path, "--jobs", jobs, "--sandbox")
    status = {r["submission"]: r["status"] for r in data["reports"]}
    assert status["b_right/01_setup.py"] == status["d_right/01_setup.py"] == "passed", status
    assert status["a_forger/01_setup.py"] == "failed" and status["c_flood/01_setup.py"] == "failed", status
    right = next(r for r in data["reports"] if r["submission"] == "b_right/01_setup.py")
    assert all(c["status"] in ("pass", "skip", "claimed") for c in right["checks"])  # a claim counts for nothing
    assert {c["id"]: c["status"] for c in right["checks"]}["collective-works"] == "pass"  # the kernel's count
    assert done.returncode == 1


@ANY_TOOL
def test_a_rank_that_speaks_as_the_host_fails_its_row_and_a_right_answer_beside_it_passes(tmp_path):
    learners = _class(tmp_path, {"a_speaker": SANDBOXED / "01_speaks_as_the_host.py", "b_right": SOLUTION})
    data, done = _batch(learners, tmp_path, "--jobs", "1", "--sandbox")
    status = {r["submission"]: r["status"] for r in data["reports"]}
    assert status == {"a_speaker/01_setup.py": "failed", "b_right/01_setup.py": "passed"}, status
    speaker = next(r for r in data["reports"] if r["submission"] == "a_speaker/01_setup.py")
    assert speaker["score"]["points"] == 0 and "reached nothing" in speaker["problem"]
    assert "FORGED_BY_A_RANK" not in done.stdout + done.stderr and done.returncode == 1


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_without_a_sandbox_a_forged_line_costs_only_its_own_row(jobs, tmp_path):
    """Unsandboxed, a rank can reach its worker's pipe: the forged line names no request of the batch,
    so that row fails (the submission's doing: exit 1, not 2), and a fresh worker grades the next one."""
    learners = _class(tmp_path, {"a_forger": HOSTILE / "01_forges_verdict.py", "b_right": SOLUTION,
                                 "c_right": SOLUTION})
    data, done = _batch(learners, tmp_path, "--jobs", jobs, "--no-sandbox")
    status = {r["submission"]: r["status"] for r in data["reports"]}
    assert status["b_right/01_setup.py"] == status["c_right/01_setup.py"] == "passed", status
    assert status["a_forger/01_setup.py"] == "failed", status
    assert "wrote into the grading worker's output" in next(
        r["problem"] for r in data["reports"] if r["submission"] == "a_forger/01_setup.py")
    assert done.returncode == 1


def test_links_among_submissions_are_refused_without_a_byte_of_their_target(tmp_path):
    secret = tmp_path / "outside" / "secret.py"
    secret.parent.mkdir()
    token = f"SECRET_TOKEN={uuid.uuid4().hex}"
    secret.write_text(f"# {token}\nraise SystemExit('{token}')\n")
    learners = _class(tmp_path, {"bob": SOLUTION})
    (learners / "alice").mkdir()
    (learners / "alice" / "01_setup.py").symlink_to(learners / "bob" / "01_setup.py")
    (learners / "carol").mkdir()
    (learners / "carol" / "01_setup.py").symlink_to(secret)
    (learners / "dave").symlink_to(learners / "bob")
    for mode in ("--sandbox", "--no-sandbox") if sandbox.tool() else ("--no-sandbox",):
        data, done = _batch(learners, tmp_path, mode)
        status = {r["submission"]: r["status"] for r in data["reports"]}
        assert status["bob/01_setup.py"] == "passed"
        for name in ("alice/01_setup.py", "carol/01_setup.py", "dave"):
            assert status[name] == "unusable", status
            assert "symbolic link" in next(r["problem"] for r in data["reports"] if r["submission"] == name)
        assert token not in done.stdout + done.stderr
        assert done.returncode == 2


@ANY_TOOL
def test_a_name_with_control_characters_stays_one_row(tmp_path):
    learners = tmp_path / "class"
    odd = learners / "ev\x1b]0;x\x07il\nname"
    odd.mkdir(parents=True)
    shutil.copy(SOLUTION, odd / "01_setup.py")
    done, _ = run(["batch", str(learners), "--sandbox"], None, tmp_path)
    assert CONTROL.findall(done.stdout + done.stderr) == []
    rows = [line for line in done.stdout.splitlines() if "evil name" in line]
    assert len(rows) == 1 and "passed" in rows[0], done.stdout


# --- what crosses is data: no frame or file a rank writes crashes the grader or grows it -----------------

# Each forges, in its ranks, what the grader reads: its ranks' reports (01), its worker's reply (02), the
# records its killed job leaves in a file (33), its checkpoint's pickle (03). Each file says at its top what
# the grader must answer; tests/test_hostile.py grades them plain in the tests' own process too.
DATA_ATTACKS = ["01_deep_key_report.py", "01_bytes_bomb_report.py", "02_lying_tensor_reply.py",
                "33_lying_observations.py", "03_checkpoint_bomb.py"]
DECIDER_MEMORY = 2**30  # the deciding process never grows past this because of what a submission sent


def _problems(name: str) -> list[str]:
    text = (HOSTILE / name).read_text()
    return re.findall(r"^# expect-problem: *(.+)$", text, re.M)


def _deciders(root: int) -> list[int]:
    """``root`` and the grader's own processes under it that decide (batch workers, a Gradescope run), not
    the ranks, nor the sandbox's host."""
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    commands[int(entry)] = f.read()
            except (OSError, ValueError, IndexError):
                continue
    found = [root]
    for pid, command in commands.items():
        if pid == root or b"grader" not in command or b"rank_host" in command:
            continue
        ancestor = parents.get(pid)
        while ancestor and ancestor != root:
            ancestor = parents.get(ancestor)
        if ancestor == root and (b"grader.worker" in command or b"-m\x00grader\x00" in command):
            found.append(pid)
    return found


def run_deciding(argv: list[str], tool: str | None, state: Path, *, env: dict | None = None
                 ) -> tuple[subprocess.CompletedProcess, int]:
    """``argv`` run to its end (a ddp-grade command, or a Gradescope bundle's run_autograder), and the
    peak resident memory (VmHWM) of the most grown of its deciding processes."""
    full_env = {**os.environ, "DDP_GRADE_STATE_DIR": str(state), "DDP_GRADE_SERVER": "0", **(env or {})}
    if tool:
        full_env[sandbox.TOOL_ENV] = tool
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}

    def watch() -> None:
        while proc.poll() is None:
            for pid in _deciders(proc.pid):
                try:
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmHWM:"):
                                peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]) * 1024)
                except OSError:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=1200)
    watcher.join()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), max(peaks.values(), default=0)


@pytest.mark.parametrize("tool", [pytest.param(None, id="plain")] + TOOLS)
def test_forged_data_fails_beside_a_right_answer_and_keeps_the_grader_small(tool, tmp_path):
    """Each attack one learner's row of a batch, plain and under each tool, beside a right answer: each
    fails with what it must answer, the right answer passes, the batch exits 1 (not 2: no row is the
    grader's failure), and no deciding process grows past DECIDER_MEMORY."""
    learners = tmp_path / "class"
    for k, name in enumerate(DATA_ATTACKS + ["01_setup.py"]):
        folder = learners / f"learner{k}"
        folder.mkdir(parents=True)
        shutil.copy(SOLUTION if name == "01_setup.py" else HOSTILE / name, folder / name)
    done, peak = run_deciding([sys.executable, "-m", "grader", "batch", str(learners), "--format", "json", "-q",
                               "--sandbox" if tool else "--no-sandbox"], tool, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    rows = {r["submission"].split("/")[0]: r for r in json.loads(done.stdout)["reports"]}
    assert rows[f"learner{len(DATA_ATTACKS)}"]["status"] == "passed", rows
    for k, name in enumerate(DATA_ATTACKS):
        row = rows[f"learner{k}"]
        assert row["status"] == "failed", (name, row)
        shown = json.dumps(row)
        for text in _problems(name):
            assert text in shown, (name, text, shown[-2000:])
    assert 0 < peak < DECIDER_MEMORY, f"a deciding process of the batch reached {peak / 2**20:.0f} MiB"


@ANY_TOOL
def test_forged_data_scores_nothing_through_the_gradescope_bundle(tmp_path):
    from click.testing import CliRunner

    from grader import catalog
    from grader.cli import main

    bundle = tmp_path / "autograder.zip"
    built = CliRunner().invoke(main, ["gradescope", "build", "-o", str(bundle), "--exercises", "01,02,03,33"])
    assert built.exit_code == 0, built.output
    root = tmp_path / "autograder"  # laid out as Gradescope lays out /autograder
    (root / "submission").mkdir(parents=True)
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "run_autograder").chmod(0o755)
    for name, as_name in (("01_deep_key_report.py", "01_setup.py"), ("02_lying_tensor_reply.py", "02_shard.py"),
                          ("03_checkpoint_bomb.py", "03_train.py"), ("33_lying_observations.py", "33_dcp.py")):
        shutil.copy(HOSTILE / name, root / "submission" / as_name)
    env = {"AUTOGRADER_ROOT": str(root), "DDP_GRADE_PYTHON": sys.executable,
           "PYTHONPATH": str(root / "source" / "kit")}  # the kit as packed, not this checkout
    done, peak = run_deciding([str(root / "run_autograder")], None, tmp_path / "state", env=env)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    tests = json.loads((root / "results" / "results.json").read_text())["tests"]
    scored = {}
    for test in tests:
        exercise = test["name"][:2]
        scored[exercise] = scored.get(exercise, 0) + test["score"]
    assert scored["01"] == scored["02"] == scored["33"] == 0, scored
    checkpoint = [t for t in tests if t["name"].startswith(("03 checkpoint-loads", "03 checkpoint-no-module"))]
    assert len(checkpoint) == 2 and all(t["score"] == 0 for t in checkpoint), checkpoint
    assert scored["03"] < sum(c.points for c in catalog.by_id("03").checks)
    assert 0 < peak < DECIDER_MEMORY, f"a deciding process of the bundle's run reached {peak / 2**20:.0f} MiB"
