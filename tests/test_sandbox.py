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
import time
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


def grade(path: Path, tool: str | None, *extra: str, **env) -> subprocess.CompletedProcess:
    """Grade ``path`` (sandboxed by ``tool`` unless None); the test's own variables in ``env`` are handed
    in on purpose (DDP_GRADE_SANDBOX_PASS), as course staff would hand one in."""
    args = [sys.executable, "-m", "grader", str(path), "-q", "--no-server", "--world-size", "2", "--timeout", "90",
            *extra]
    full_env = {**os.environ, **env, sandbox.PASS_ENV: ",".join(env)}
    if tool:
        args.append("--sandbox")
        full_env[sandbox.TOOL_ENV] = tool
    return subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandboxed_rank_sees_only_loopback(tool):
    done = grade(FILES / "01_lists_interfaces.py", tool)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]
    # Under --sandbox a claim counts for nothing: it passed on collective-works, the kernel's count of its bytes.
    assert "All 8 checks passed; 1 decided on evidence, 7 claimed (not counted)." in done.stdout, done.stdout[-2000:]


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
    monkeypatch.setenv(sandbox.PASS_ENV, "DDP_GRADE_TEST_TAG DDP_GRADE_TEST_OUTSIDE DDP_GRADE_TEST_SECRET")
    monkeypatch.setenv("DDP_GRADE_TEST_TAG", tag)
    monkeypatch.setenv("DDP_GRADE_TEST_OUTSIDE", str(alice))  # bob writes into a classmate's file
    monkeypatch.setenv("DDP_GRADE_TEST_SECRET", str(secret / "secret"))
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    secret.mkdir()
    try:
        (secret / "secret").write_text("hunter2")
        result = CliRunner().invoke(main, ["batch", str(learners), "--world-size", "2", "--timeout", "90",
                                           "--format", "json", "-q"])
    finally:
        shutil.rmtree(secret, ignore_errors=True)
    data = json.loads(result.output)
    assert {r["submission"]: r["status"] for r in data["reports"]} == {
        f"{name}/01_setup.py": "passed" for name in ("alice", "bob", "carol", "dave")}, result.output[-3000:]
    assert alice.read_bytes() == before, "a submission wrote into another submission's file"
    assert processes_carrying(tag) == []


def _kit_under(parent: Path, name: str) -> Path:
    """A kit as a learner keeps it, under ``parent``: the grader's package, and beside it what no submission may
    see (the solutions, the tests, the git history, the exercises folder); beside the kit, another one and a file."""
    kit = parent / name
    shutil.copytree(ROOT / "grader", kit / "grader", ignore=shutil.ignore_patterns("__pycache__"))
    for path in ("solutions/01_setup.py", "tests/conftest.py", "exercises/01_setup.py", ".git/HEAD",
                 "README.md", "../another-kit/solutions/01_setup.py", "../notes.txt"):
        (kit / path).parent.mkdir(parents=True, exist_ok=True)
        (kit / path).write_text("not for a submission's eyes\n")
    return kit


@pytest.mark.parametrize("tool", TOOLS)
def test_a_kit_kept_under_tmp_grades_in_the_sandbox(tool):
    """Inside, /tmp is an empty folder; the kit kept there, and the learner's file inside the kit,
    are bound back read-only (the file is seen through the kit's folder, not bound a second time).
    The file looks for the kit's solutions, tests and git history: none is there."""
    parent = Path(tempfile.mkdtemp(prefix="ddp-grade-kit-", dir="/tmp"))
    try:
        kit = _kit_under(parent, "kit")
        shutil.copy(FILES / "01_reads_kit.py", kit / "exercises" / "01_setup.py")
        env = {**os.environ, "PYTHONPATH": str(kit), sandbox.TOOL_ENV: tool, "DDP_GRADE_TEST_KIT": str(kit),
               sandbox.PASS_ENV: "DDP_GRADE_TEST_KIT"}
        # From the kit's own folder, so that `-m grader` is the copy under /tmp.
        done = subprocess.run([sys.executable, "-m", "grader", "exercises/01_setup.py", "-q", "--no-server",
                               "--world-size", "2", "--timeout", "90", "--sandbox"], cwd=kit, env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]
    assert "checks passed" in done.stdout, done.stdout[-2000:]


# --- what a sandboxed submission can reach (issue: the server, /dev/shm, /tmp, the environment) --------------


@pytest.fixture
def outside_state():
    """A state folder outside the home folder and /tmp (where nothing hides it by chance), short enough
    for a Unix socket's path, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-esc-", dir="/var/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def running_server(outside_state, tmp_path):
    """A grading server on ``outside_state``, started as the grader's own command would start it, whose
    rank processes would write ``escaped`` if they ever graded the escaping file."""
    from grader import server

    tag = uuid.uuid4().hex
    escaped = tmp_path / "escaped"
    env = {**os.environ, "DDP_GRADE_STATE_DIR": str(outside_state), "DDP_GRADE_SERVER": "1",
           "DDP_GRADE_TEST_ESCAPED": str(escaped), "DDP_GRADE_TEST_TAG": tag}
    process = subprocess.Popen([sys.executable, "-m", "grader.server"], env=env, start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    old = os.environ.get("DDP_GRADE_STATE_DIR")
    os.environ["DDP_GRADE_STATE_DIR"] = str(outside_state)
    try:
        deadline = time.monotonic() + 60
        while not server.status()["running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.status()["running"], "the server did not come up"
        yield {"escaped": escaped, "state": outside_state, "process": process}
        assert server.status()["gradings"] == 0, "the server graded something"
    finally:
        server.stop()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        for pid in processes_carrying(tag):
            os.kill(pid, 9)
        if old is None:
            os.environ.pop("DDP_GRADE_STATE_DIR", None)
        else:
            os.environ["DDP_GRADE_STATE_DIR"] = old


@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandboxed_submission_cannot_have_the_grading_server_run_it(tool, running_server, tmp_path):
    """The submission looks for every Unix socket it can see (and is told where the server's is) and asks
    each to grade it: nothing it finds may run it outside the sandbox."""
    reached = tmp_path / "reached.json"
    done = grade(FILES / "01_asks_the_server.py", tool, DDP_GRADE_STATE_DIR=str(running_server["state"]),
                 DDP_GRADE_TEST_STATE=str(running_server["state"]), DDP_GRADE_TEST_REACHED=str(reached))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]
    assert not running_server["escaped"].exists(), running_server["escaped"].read_text()
    assert not reached.exists(), "the submission wrote outside its sandbox"


@pytest.mark.parametrize("tool", TOOLS)
def test_a_batch_submission_cannot_have_the_grading_server_run_it(tool, running_server, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from grader.cli import main

    (tmp_path / "class" / "eve").mkdir(parents=True)
    shutil.copy(FILES / "01_asks_the_server.py", tmp_path / "class" / "eve" / "01_setup.py")
    monkeypatch.setenv(sandbox.TOOL_ENV, tool)
    monkeypatch.setenv(sandbox.PASS_ENV, "DDP_GRADE_TEST_STATE")
    monkeypatch.setenv("DDP_GRADE_TEST_STATE", str(running_server["state"]))
    result = CliRunner().invoke(main, ["batch", str(tmp_path / "class"), "--world-size", "2", "--timeout", "90",
                                       "--format", "json", "-q"])
    data = json.loads(result.output)
    assert [r["status"] for r in data["reports"]] == ["passed"], result.output[-3000:]
    assert not running_server["escaped"].exists(), running_server["escaped"].read_text()


@pytest.mark.parametrize("tool", TOOLS)
def test_dev_shm_in_the_sandbox_is_its_own(tool):
    name = f"ddp-grade-test-{uuid.uuid4().hex[:8]}"
    planted, left = Path("/dev/shm") / f"{name}-host", Path("/dev/shm") / f"{name}-inside"
    planted.write_text("hunter2")
    try:
        outside = grade(FILES / "01_uses_dev_shm.py", None, DDP_GRADE_TEST_SHM_READ=str(planted))
        assert outside.returncode == 1 and "read the machine's /dev/shm: hunter2" in outside.stdout
        done = grade(FILES / "01_uses_dev_shm.py", tool, DDP_GRADE_TEST_SHM_READ=str(planted),
                     DDP_GRADE_TEST_SHM_WRITE=str(left))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-1000:]
        assert not left.exists(), "a write to /dev/shm inside the sandbox reached the machine's /dev/shm"
    finally:
        planted.unlink(missing_ok=True)
        left.unlink(missing_ok=True)


@pytest.mark.parametrize("tool", TOOLS)
def test_tmp_in_the_sandbox_has_a_size_and_a_full_one_is_reported_as_such(tool):
    """The file writes 3,000 MB into /tmp; the sandbox's holds 64 MiB here, and the report names the limit."""
    done = grade(FILES / "01_fills_tmp.py", tool, "--tmp-limit", "64")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-1000:]
    assert "No space left on device" in done.stdout
    assert "the sandbox's /tmp, /dev/shm and ranks' folder limit (64 MiB each; --tmp-limit changes it)" in done.stdout


@pytest.mark.parametrize("tool", TOOLS)
def test_the_graders_environment_does_not_reach_a_sandboxed_submission(tool):
    env = {**os.environ, "SECRET_ENV": "hunter2", "DDP_GRADE_API_SECRET": "hunter2"}
    args = [sys.executable, "-m", "grader", str(FILES / "01_reads_environment.py"), "-q", "--no-server",
            "--world-size", "2", "--timeout", "90"]
    outside = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert outside.returncode == 1 and "hunter2" in outside.stdout  # the file does look
    inside = subprocess.run(args + ["--sandbox"], env={**env, sandbox.TOOL_ENV: tool}, capture_output=True,
                            text=True, timeout=300)
    assert inside.returncode == 0, inside.stdout[-2000:] + inside.stderr[-1000:]


def test_the_sandbox_environment_is_an_allowlist(monkeypatch):
    monkeypatch.setenv("SECRET_ENV", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", "/somewhere")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("HANDED_IN", "yes")
    monkeypatch.setenv(sandbox.PASS_ENV, "HANDED_IN")
    env = sandbox.environment({"DDP_GRADE_STATE_DIR": "/tmp/state"}, 2**20)
    assert "SECRET_ENV" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["DDP_GRADE_STATE_DIR"] == "/tmp/state" and env["TMPDIR"] == "/tmp"
    assert env["LC_ALL"] == "C.UTF-8" and env["NCCL_DEBUG"] == "INFO" and env["HANDED_IN"] == "yes"


# --- what the sandbox shows of the machine and of the kit, wherever the kit is (issue 46) ----------------------

# Run inside: the entries of every folder from argv[1] up to /, whether each of argv[2:] can be written, the
# capabilities left, and whether DDP_GRADE_TEST_STATE (the state folder outside) exists.
VIEW_PROBE = (
    "import errno, json, os, sys\n"
    "path, seen, writes = sys.argv[1], {}, {}\n"
    "while True:\n"
    "    try:\n"
    "        seen[path] = sorted(os.listdir(path))\n"
    "    except OSError as exc:\n"
    "        seen[path] = errno.errorcode[exc.errno]\n"
    "    if path == '/':\n"
    "        break\n"
    "    path = os.path.dirname(path)\n"
    "for folder in sys.argv[2:]:\n"
    "    try:\n"
    "        open(os.path.join(folder, 'written-from-the-sandbox'), 'x').close()\n"
    "        writes[folder] = 'written'\n"
    "    except OSError as exc:\n"
    "        writes[folder] = errno.errorcode[exc.errno]\n"
    "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm', 'CapBnd'))]\n"
    "state = os.environ.get('DDP_GRADE_TEST_STATE')\n"
    "state_seen = bool(state) and os.path.exists(state)\n"
    "print(json.dumps({'seen': seen, 'writes': writes, 'caps': caps, 'state_seen': state_seen}))\n"
)
# What the sandbox's root holds besides the folders on the way to what it binds: the machine's system folders
# (or their links), its own /etc, /dev, /proc and /tmp, and /sys where GPUs are bound.
ROOT_OWN = {os.path.basename(p) for p in sandbox.SYSTEM} | {"etc", "dev", "proc", "tmp", "sys"}


def _next_names(folder: str, paths: list[str]) -> set[str]:
    """The next name on the way from ``folder`` to each of ``paths`` below it."""
    return {os.path.relpath(p, folder).split(os.sep)[0] for p in paths if sandbox._under(p, folder) and p != folder}


def _needed(kit: str, home: str, search_path: list[str]) -> list[str]:
    """What a grading needs to see, in this test's own words: the kit's package, the Python that runs it (its
    environment and its base installation), the folders it imports from that are not the kit's, and the home
    folder and /tmp (both made empty)."""
    needed = [os.path.join(kit, "grader"), sys.prefix, sys.base_prefix, home, "/tmp"]
    for entry in search_path:
        if entry and os.path.isdir(entry):
            needed += [p for p in {os.path.abspath(entry), os.path.realpath(entry)}
                       if not sandbox._under(p, kit) and not sandbox._under(kit, p)]
    return needed + [os.path.realpath(p) for p in needed]


def _check_the_view(view: dict, kit: str, package_entries: list[str], needed: list[str]) -> None:
    """Of the kit, only its package (and its environment, where the kit holds it), read-only, and of the package
    only its rank side (``__init__.py`` and ``rank/``: tests/test_rank_side.py); of each folder on the way from /
    to the kit, only the names on the way to what the grading needs; of /, nothing else of the machine's."""
    seen = view["seen"]
    assert set(seen[kit]) == {"grader"} | _next_names(kit, [sys.prefix, os.path.realpath(sys.prefix)]), seen[kit]
    package = seen[os.path.join(kit, "grader")]
    assert package == ["__init__.py", "rank"] and set(package) <= set(package_entries), package
    folder = os.path.dirname(kit)
    while folder != "/":
        assert set(seen[folder]) == _next_names(folder, needed), (folder, seen[folder])
        folder = os.path.dirname(folder)
    assert set(seen["/"]) - _next_names("/", needed) <= ROOT_OWN, seen["/"]
    assert set(view["writes"].values()) == {"EROFS"}, view["writes"]


@pytest.mark.parametrize("tool", TOOLS)
def test_the_sandbox_has_a_root_of_its_own_and_no_capabilities(tool, outside_state):
    """Nothing of the machine but what the grading needs: of this kit only its package and, where the kit holds
    it, its environment (both read-only); not the state folder (under /var/tmp here); no capability left to mount,
    unmount or remount anything."""
    package = str(ROOT / "grader")
    argv = [sys.executable, "-c", VIEW_PROBE, package, package, sys.prefix]
    env = {**sandbox.environment({}, 2**24), "DDP_GRADE_TEST_STATE": str(outside_state)}
    fd = sandbox.filter_descriptor()
    try:
        done = subprocess.run(sandbox.wrap(argv, [], tool, filter_fd=fd), env=env, capture_output=True, text=True,
                              timeout=60, pass_fds=(fd,))
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr[-2000:]
    view = json.loads(done.stdout)
    _check_the_view(view, str(ROOT), sorted(os.listdir(package)), _needed(str(ROOT), str(Path.home()), sys.path[1:]))
    assert view["caps"] == ["0000000000000000"] * 3
    assert view["state_seen"] is False


# Run with the kit's copy as its working folder and on PYTHONPATH, so that `grader` is the copy: what the copy's
# sandbox binds, and what a probe sees inside it.
COPY_DRIVER = (
    "import json, os, subprocess, sys\n"
    "import grader\n"
    "from grader import sandbox\n"
    "tool, kit, probe = sys.argv[1:4]\n"
    "fd = sandbox.filter_descriptor()\n"
    "argv = sandbox.wrap([sys.executable, '-c', probe, kit + '/grader', kit + '/grader'], [], tool, filter_fd=fd)\n"
    "done = subprocess.run(argv, env=sandbox.environment({}, 2**24), capture_output=True, text=True, timeout=60,\n"
    "                      pass_fds=(fd,))\n"
    "print(json.dumps({'package': grader.__file__, 'path': sys.path[1:], 'rc': done.returncode,\n"
    "                  'view': done.stdout, 'err': done.stderr[-2000:]}))\n"
)


@pytest.fixture(params=["home", "var-tmp", "opt", "space"])
def kit_place(request):
    """(the folder a kit is kept in, its home folder): in a home folder under /home (made for the test where
    /home can be written, else this user's own), under /var/tmp, under /opt (where it can be written) and in a
    folder whose name has a space."""
    made = None
    home = Path.home()
    if request.param == "home":
        if os.access("/home", os.W_OK):
            made = home = Path(tempfile.mkdtemp(prefix="ddp-grade-learner-", dir="/home"))
            parent = home / "code"
            parent.mkdir()
        else:
            made = parent = Path(tempfile.mkdtemp(prefix="ddp-grade-view-", dir=home))
    elif request.param == "opt":
        if not os.access("/opt", os.W_OK):
            pytest.skip("/opt cannot be written here")
        made = parent = Path(tempfile.mkdtemp(prefix="ddp-grade-view-", dir="/opt"))
    else:
        made = parent = Path(tempfile.mkdtemp(prefix="ddp grade view " if request.param == "space" else
                                              "ddp-grade-view-", dir="/var/tmp"))
    yield parent, home
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.parametrize("tool", TOOLS)
def test_of_a_kit_anywhere_the_sandbox_shows_only_the_graders_package(tool, kit_place):
    parent, home = kit_place
    kit = _kit_under(parent, "my kit" if " " in str(parent) else "ddp-grade")
    env = {**os.environ, "PYTHONPATH": str(kit), "HOME": str(home)}
    done = subprocess.run([sys.executable, "-c", COPY_DRIVER, tool, str(kit), VIEW_PROBE], cwd=kit, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ran = json.loads(done.stdout)
    assert ran["package"] == str(kit / "grader" / "__init__.py")  # the copy's sandbox, binding the copy
    assert ran["rc"] == 0, ran["err"]
    view = json.loads(ran["view"])
    assert view["seen"][str(parent)] == [kit.name]  # nothing beside the kit: not another kit, not a file
    _check_the_view(view, str(kit), sorted(os.listdir(kit / "grader")), _needed(str(kit), str(home), ran["path"]))
