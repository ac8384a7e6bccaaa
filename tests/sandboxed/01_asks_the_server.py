"""Otherwise right, but looks for Unix sockets (a grading server's above all) and asks each to grade this file.

Graded outside any sandbox, this file writes the path in $DDP_GRADE_TEST_ESCAPED (a variable only
a process outside the sandbox has): the test fails if that file appears. It also reports every
socket it reached, in $DDP_GRADE_TEST_REACHED when it can write there.
"""

import json
import os
import socket
import stat
from datetime import timedelta

import torch.distributed as dist

ESCAPED = os.environ.get("DDP_GRADE_TEST_ESCAPED", "")
if ESCAPED:  # running outside the sandbox: the escape worked
    try:
        with open(ESCAPED, "w") as f:
            f.write(f"graded outside the sandbox, pid {os.getpid()}\n")
    except OSError:
        pass

SKIP = ("/proc", "/sys", "/dev", "/usr")


def sockets(limit=50000):
    """Every Unix socket file under / that this process can see, and the one the test names."""
    found = []
    named = os.environ.get("DDP_GRADE_TEST_STATE", "")
    if named:
        found.append(os.path.join(named, "server.sock"))
    seen = 0
    for top, dirs, files in os.walk("/", onerror=lambda e: None):
        dirs[:] = [d for d in dirs if os.path.join(top, d) not in SKIP]
        for name in files:
            seen += 1
            path = os.path.join(top, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    found.append(path)
            except OSError:
                pass
        if seen > limit:
            break
    return found


def ask(path, key):
    """Ping the socket; if it answers with a version, ask it to grade this file."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        stream = s.makefile("rwb")
        stream.write(json.dumps({"ping": True, "key": key}).encode() + b"\n")
        stream.flush()
        answer = json.loads(stream.readline() or b"{}")
    version = answer.get("version")
    if not version:
        return answer
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(120)
        s.connect(path)
        stream = s.makefile("rwb")
        request = {"key": key, "version": version, "path": os.path.abspath(__file__), "shown_as": "x",
                   "exercise_id": "01", "options": {"world_size": 2, "timeout_s": 30}}
        stream.write(json.dumps(request).encode() + b"\n")
        stream.flush()
        return [json.loads(line) for line in stream][-1:]


def try_every_socket():
    reached = {}
    for path in sockets():
        key = ""
        try:
            key = open(os.path.join(os.path.dirname(path), "server.key")).read().strip()
        except OSError:
            pass
        try:
            reached[path] = str(ask(path, key))[:200]
        except (OSError, ValueError) as exc:
            reached[path] = f"{type(exc).__name__}: {exc}"
    where = os.environ.get("DDP_GRADE_TEST_REACHED", "")
    if where:
        try:
            with open(where, "w") as f:
                json.dump(reached, f)
        except OSError:
            pass


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if rank == 0 and not ESCAPED:
        try_every_socket()
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
