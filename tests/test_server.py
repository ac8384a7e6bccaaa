"""The background grading server: reused while current, replaced when stale, gone when idle,
never needed (a dead one means grading in the command's own process), nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from grader import server
from grader.options import GradeOptions

pytestmark = pytest.mark.slow

SOLUTION_01 = ROOT / "solutions" / "01_setup.py"


@pytest.fixture
def server_env(tmp_path, monkeypatch):
    """Server on, a state folder of its own (its socket), a short idle time, and a tag every process inherits."""
    tag = uuid.uuid4().hex
    state = Path("/tmp") / f"ddp-srv-{tag[:8]}"  # short: a Unix socket path has a length limit
    env = {"DDP_GRADE_SERVER": "1", "DDP_GRADE_STATE_DIR": str(state), "DDP_GRADE_SERVER_IDLE_S": "60",
           "DDP_GRADE_TEST_TAG": tag}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield {**os.environ, **env}
    server.stop()
    wait_until(lambda: not alive(tag), 20)
    for pid in alive(tag):  # a test that failed half-way must not leave a server behind
        os.kill(pid, 9)
    subprocess.run(["rm", "-rf", str(state)], check=False)


def alive(tag: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"DDP_GRADE_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def ddp_grade(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grader", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def start_server(env: dict) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "grader.server"], env=env, start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_until(lambda: server.status()["running"], 60), "the server did not come up"
    assert server.status()["pid"] == process.pid
    return process


def test_the_first_grading_starts_a_server_and_the_next_ones_use_it(server_env):
    first = ddp_grade(server_env, str(SOLUTION_01), "-q")
    assert first.returncode == 0, first.stdout
    assert wait_until(lambda: server.status()["running"], 60), "no server was started"
    for _ in range(2):
        again = ddp_grade(server_env, str(SOLUTION_01), "-q")
        assert again.returncode == 0 and "All 8 checks passed;" in again.stdout, again.stdout
    found = server.status()
    assert found["current"] and found["gradings"] == 2


def test_the_server_reports_a_failure_as_the_command_would(server_env):
    start_server(server_env)
    broken = ddp_grade(server_env, str(ROOT / "tests" / "variants" / "01_hardcoded_port.py"), "--format", "json")
    assert broken.returncode == 1
    assert '"port-from-env"' in broken.stdout and '"schema": 4' in broken.stdout
    assert server.status()["gradings"] == 1


def test_a_server_running_other_code_answers_stale_and_exits(server_env, monkeypatch):
    process = start_server(server_env)
    monkeypatch.setattr(server, "code_version", lambda: "other-code")
    with pytest.raises(server.Unavailable, match="changed"):
        server.grade_remote(str(SOLUTION_01), None, GradeOptions())
    assert process.wait(timeout=20) == 0  # it exited on its own


def test_an_idle_server_exits_and_leaves_nothing(server_env):
    server_env = {**server_env, "DDP_GRADE_SERVER_IDLE_S": "1"}
    process = start_server(server_env)
    assert process.wait(timeout=30) == 0
    tag = server_env["DDP_GRADE_TEST_TAG"]
    assert wait_until(lambda: not alive(tag), 10), f"still alive: {alive(tag)}"
    assert not server.socket_path().exists()


def test_a_dead_server_means_grading_in_the_command(server_env):
    process = start_server(server_env)
    process.kill()  # its socket file stays behind, nobody answers it
    process.wait()
    assert wait_until(lambda: not server.status()["running"], 10)
    done = ddp_grade(server_env, str(SOLUTION_01), "-q")
    assert done.returncode == 0 and "All 8 checks passed;" in done.stdout, done.stdout + done.stderr


def test_no_server_turns_it_off(server_env):
    done = ddp_grade(server_env, str(SOLUTION_01), "-q", "--no-server")
    assert done.returncode == 0
    time.sleep(1)
    assert not server.status()["running"]
    assert alive(server_env["DDP_GRADE_TEST_TAG"]) == []


def _raw_request(request: dict) -> socket.socket:
    """A connection to the server with ``request`` sent on it, as a client would send it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    sock.connect(str(server.socket_path()))
    sock.sendall(json.dumps(request).encode() + b"\n")
    return sock


def test_a_client_that_goes_away_mid_grading_costs_the_server_that_grading_only(server_env):
    process = start_server(server_env)
    request = {"key": server.key_path().read_text().strip(), "version": server.code_version(),
               "path": str(ROOT / "solutions" / "03_train.py"), "shown_as": "03", "exercise_id": None,
               "options": GradeOptions(timeout_s=60).to_dict()}
    sock = _raw_request(request)
    first = sock.makefile("rb").readline()  # the grading has started (its first event)
    assert json.loads(first)["type"] == "event"
    sock.close()  # the client goes away while the ranks run
    again = ddp_grade(server_env, str(SOLUTION_01), "-q")
    assert again.returncode == 0 and "All 8 checks passed;" in again.stdout, again.stdout + again.stderr
    assert process.poll() is None, "the server died"
    found = server.status()
    assert found["pid"] == process.pid and found["gradings"] == 2
    log = (server.socket_path().parent / "server.log")
    assert "Traceback" not in (log.read_text() if log.exists() else "")


def test_a_request_without_the_servers_key_is_refused(server_env):
    start_server(server_env)
    request = {"key": "0" * 64, "version": server.code_version(), "path": str(SOLUTION_01), "shown_as": "x",
               "exercise_id": None, "options": GradeOptions().to_dict()}
    with _raw_request(request) as sock:
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["type"] == "refused" and "key" in answer["why"]
    with _raw_request({"ping": True}) as sock:  # not even its version without the key
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["type"] == "refused" and "version" not in answer
    assert server.status()["gradings"] == 0


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare here")
def test_a_client_in_another_namespace_is_refused_even_with_the_key(server_env):
    """The socket in plain sight and the key in hand (as if the state folder were visible): a process in
    a sandbox's namespaces is still refused, because the kernel says where the peer runs."""
    start_server(server_env)
    key = server.key_path().read_text().strip()
    client = ("import json, socket, sys\n"
              "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
              "s.sendall(json.dumps({'key': sys.argv[2], 'ping': True}).encode() + b'\\n')\n"
              "print(s.makefile('rb').readline().decode())\n")
    inside = subprocess.run(["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c", client,
                             str(server.socket_path()), key], capture_output=True, text=True, timeout=60)
    if inside.returncode != 0 and "unshare failed" in inside.stderr:
        pytest.skip(f"unshare does not work here: {inside.stderr.strip()}")
    assert inside.returncode == 0, inside.stderr
    answer = json.loads(inside.stdout)
    assert answer["type"] == "refused" and "namespace" in answer["why"], answer
    outside = subprocess.run([sys.executable, "-c", client, str(server.socket_path()), key],
                             capture_output=True, text=True, timeout=60)
    assert json.loads(outside.stdout)["pid"]  # the same client, outside, is answered


def test_server_status_and_stop_commands(server_env):
    process = start_server(server_env)
    status = ddp_grade(server_env, "server", "status")
    assert status.returncode == 0 and f"pid {process.pid}" in status.stdout
    stop = ddp_grade(server_env, "server", "stop")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    assert process.wait(timeout=30) == 0
    status = ddp_grade(server_env, "server", "status")
    assert status.returncode == 0 and "no grading server is running" in status.stdout


def test_the_first_grading_says_it_started_a_server(server_env):
    first = ddp_grade(server_env, str(SOLUTION_01))
    assert first.returncode == 0
    assert "started a grading server in the background" in first.stderr and "ddp-grade server stop" in first.stderr
    assert wait_until(lambda: server.status()["running"], 60)
    second = ddp_grade(server_env, str(SOLUTION_01))
    assert "started a grading server" not in second.stderr
