"""A per-user grading server: keeps a warm pool between command-line gradings.

A cold ``ddp-grade FILE`` pays for importing torch and starting the pool (2-4 s); ``watch``
shows that a warm grading takes a fraction of that. So the first ``ddp-grade`` of a session of
work grades as always and, beside it, starts this server in the background. The next ones send
their grading to it over a Unix socket in the state folder and only render the answer; the
command itself never imports torch then.

What it keeps, and what it never shares:

* one :class:`~grader.harness.Session` per set of limits, its forkserver with torch, the
  drivers and torch._dynamo imported: nothing else lives from one grading to the next (each
  run gets fresh rank processes, a fresh rendezvous and its own temp folder);
* every grading checks the grader's code version (a digest of its files' names, sizes and
  modification times, and the Python that runs it): a server started by other code answers
  "stale" and exits, and the command grades in its own process;
* it exits after ``DDP_GRADE_SERVER_IDLE_S`` seconds without a grading (default 600), and
  stops its pool on the way out.

The harness's guarantees hold inside the server as in the command: each grading has its
deadline, and every process a run started is stopped and reaped. ``--no-server`` (or
``DDP_GRADE_SERVER=0``) turns it off. When the server cannot be reached, or fails mid-way, the
command grades in its own process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from grader import catalog
from grader.state import state_dir

SERVER_ENV = "DDP_GRADE_SERVER"  # "0": never use or start a server
IDLE_ENV = "DDP_GRADE_SERVER_IDLE_S"
DEFAULT_IDLE_S = 600.0
SOCKET_NAME = "server.sock"
CONNECT_TIMEOUT_S = 1.0
MARGIN_S = 30.0  # beyond a grading's own timeout before the command stops waiting for the server
MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 108 bytes on Linux


class Unavailable(Exception):
    """No server answered, or it could not finish: grade in this process instead."""


def enabled() -> bool:
    return os.environ.get(SERVER_ENV, "1") != "0" and hasattr(socket, "AF_UNIX") and sys.platform != "win32"


def socket_path() -> Path:
    return state_dir() / SOCKET_NAME


def code_version() -> str:
    """A digest of the grader's files (name, size, modification time) and of the Python running it."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256(f"{sys.executable}\n{sys.version}\n{package}\n".encode())
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".toml") and "__pycache__" not in path.parts:
            st = path.stat()
            digest.update(f"{path.relative_to(package)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


# --- the command's side -------------------------------------------------------------------------


def grade_remote(path: str, exercise_id: str | None, options, on_event=None) -> dict:
    """Send one grading to the server and return the report as a dict; Unavailable when it cannot."""
    sock = _connect()
    if sock is None:
        raise Unavailable("no server")
    request = {"version": code_version(), "path": os.path.abspath(path), "shown_as": path,
               "exercise_id": exercise_id, "options": options.to_dict()}
    try:
        with sock, sock.makefile("rwb") as stream:
            sock.settimeout(catalog.longest_timeout(options.timeout_s) + MARGIN_S)
            stream.write(json.dumps(request).encode() + b"\n")
            stream.flush()
            for line in stream:
                message = json.loads(line)
                if message["type"] == "event" and on_event is not None:
                    on_event(message.pop("kind"), **{k: v for k, v in message.items() if k != "type"})
                elif message["type"] == "report":
                    return message["report"]
                elif message["type"] in ("stale", "error"):
                    raise Unavailable(message.get("why", message["type"]))
    except (OSError, ValueError, KeyError) as exc:
        raise Unavailable(f"the server stopped answering: {exc}") from None
    raise Unavailable("the server closed the connection")


def _connect() -> socket.socket | None:
    path = socket_path()
    if len(str(path)) > MAX_SOCKET_PATH or not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def start_in_background() -> None:
    """Start a server for the next gradings, detached from this command (never waited for)."""
    path = socket_path()
    if len(str(path)) > MAX_SOCKET_PATH:
        return
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path.parent / "server.log", "ab")
        subprocess.Popen([sys.executable, "-m", "grader.server"], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=log, start_new_session=True, close_fds=True, cwd=str(path.parent))
        log.close()


def status() -> dict:
    """What ``doctor`` shows: whether a server answers, its pid and whether its code is current."""
    sock = _connect()
    if sock is None:
        return {"running": False, "socket": str(socket_path())}
    try:
        with sock, sock.makefile("rwb") as stream:
            stream.write(json.dumps({"ping": True}).encode() + b"\n")
            stream.flush()
            answer = json.loads(stream.readline())
    except (OSError, ValueError):
        return {"running": False, "socket": str(socket_path())}
    return {"running": True, "socket": str(socket_path()), "pid": answer.get("pid"),
            "current": answer.get("version") == code_version(), "gradings": answer.get("gradings", 0)}


def stop() -> bool:
    """Ask a running server to exit now; True when one answered."""
    sock = _connect()
    if sock is None:
        return False
    with contextlib.suppress(OSError, ValueError), sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps({"stop": True}).encode() + b"\n")
        stream.flush()
        stream.readline()
    return True


# --- the server's side --------------------------------------------------------------------------


def serve() -> None:
    """Accept gradings one at a time until idle for the idle time, or told to stop."""
    from grader import grading, harness
    from grader.options import GradeOptions

    version = code_version()
    path = socket_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    if _connect() is not None:
        return  # another server already answers there
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
    except OSError:
        return  # another server bound it first
    os.chmod(path, 0o600)
    listener.listen(8)
    idle_s = float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    grading.warm_up(dynamo=True)
    sessions: dict = {}
    served = {"gradings": 0}
    try:
        while True:
            listener.settimeout(idle_s)
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                return
            with conn, conn.makefile("rwb") as stream:
                if not _answer(stream, version, sessions, GradeOptions, served):
                    return
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        for session in sessions.values():
            session.close()
        harness.stop_pool()


def _answer(stream, version: str, sessions: dict, GradeOptions, served: dict) -> bool:
    """Serve one request; False when the server must exit (stale code, or asked to stop)."""
    from grader import harness
    from grader.grading import grade_file

    def send(message: dict) -> None:
        stream.write(json.dumps(message).encode() + b"\n")
        stream.flush()

    try:
        request = json.loads(stream.readline())
    except ValueError:
        return True
    if request.get("ping"):
        send({"pid": os.getpid(), "version": version, **served})
        return True
    if request.get("stop"):
        send({"stopping": True})
        return False
    if request.get("version") != version:
        send({"type": "stale", "why": "the grader's code changed since this server started"})
        return False
    options = GradeOptions.from_dict(request["options"])
    key = json.dumps(options.limits, sort_keys=True)
    if key not in sessions:
        sessions[key] = harness.Session(limits=options.limits, spares=True)

    def on_event(kind: str, **info) -> None:
        with contextlib.suppress(OSError):
            send({"type": "event", "kind": kind, **info})

    try:
        report = grade_file(request["path"], sessions[key], options, request.get("exercise_id"), on_event=on_event)
    except Exception as exc:  # the grader's own failure: the command grades in its own process instead
        send({"type": "error", "why": f"{type(exc).__name__}: {exc}"})
        return True
    report.path = request.get("shown_as") or report.path
    served["gradings"] += 1
    with contextlib.suppress(OSError):
        send({"type": "report", "report": report.to_dict()})
    return True


if __name__ == "__main__":
    serve()
