"""A per-user grading server: keeps a warm pool between command-line gradings.

A cold ``ddp-grade FILE`` pays for importing torch and starting the pool (2-4 s); ``watch``
shows that a warm grading takes a fraction of that. So the first ``ddp-grade`` of a session of
work grades as always and, beside it, starts this server in the background. The next ones send
their grading to it over a Unix socket in the state folder and only render the answer; the
command itself never imports torch then.

What it keeps, and what it never shares:

* one :class:`~grader.rank.harness.Session` per set of limits, its forkserver with torch, the
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
command grades in its own process. A client that goes away mid-grading costs the server that
grading and nothing more.

Who it answers: the server runs code (a learner's file, unsandboxed), so it answers only a
``ddp-grade`` command of its own user running outside any sandbox:

* the socket and the key file beside it are the user's alone (mode 0600, in the state folder);
* every request carries the key, 32 random bytes the server writes when it starts, which only a
  process that can read the state folder can send (a sandbox never shows the state folder);
* the kernel names the peer of each connection (``SO_PEERCRED``): it must be a process of the
  same user, in the same user, mount, network and PID namespaces as the server; anything in a
  sandbox (bwrap, unshare, a container) is refused before its request is read. Sandboxed
  gradings never use the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

from grader.state import state_dir

SERVER_ENV = "DDP_GRADE_SERVER"  # "0": never use or start a server
IDLE_ENV = "DDP_GRADE_SERVER_IDLE_S"
DEFAULT_IDLE_S = 600.0
SOCKET_NAME = "server.sock"
KEY_NAME = "server.key"
NAMESPACES = ("user", "mnt", "net", "pid")  # a client must share all of them with the server
CONNECT_TIMEOUT_S = 1.0
MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 108 bytes on Linux


class Unavailable(Exception):
    """No server answered, or it could not finish: grade in this process instead."""


def enabled() -> bool:
    return os.environ.get(SERVER_ENV, "1") != "0" and hasattr(socket, "AF_UNIX") and sys.platform != "win32"


def socket_path() -> Path:
    return state_dir() / SOCKET_NAME


def key_path() -> Path:
    return state_dir() / KEY_NAME


def _read_key() -> str:
    try:
        return key_path().read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


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


def grade_remote(path: str, exercise_id: str | None, options, on_event=None):
    """Send one grading to the server (:mod:`grader.protocol`) and return its Report; Unavailable when it cannot."""
    from grader import protocol

    sock = _connect()
    if sock is None:
        raise Unavailable("no server")
    request = {"key": _read_key(), "version": code_version(), **protocol.request(path, exercise_id, options)}
    try:
        with sock, sock.makefile("rwb") as stream:
            sock.settimeout(protocol.wait_s(path, exercise_id, options))
            stream.write(protocol.encode(request))
            stream.flush()
            return protocol.read_answer(stream, on_event)
    except protocol.Failed as exc:
        raise Unavailable(str(exc)) from None
    except OSError as exc:
        raise Unavailable(f"the server stopped answering: {exc}") from None


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


def _answering() -> bool:
    """Something listens on the socket."""
    sock = _connect()
    if sock is None:
        return False
    sock.close()
    return True


def start_in_background() -> bool:
    """Start a server for the next gradings, detached from this command (never waited for).

    True when one was started; False when the state folder cannot hold its socket (too long a
    path, not writable) or one already answers there.
    """
    path = socket_path()
    if len(str(path)) > MAX_SOCKET_PATH or _answering():
        return False
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            return False
        with open(path.parent / "server.log", "ab") as log:
            subprocess.Popen([sys.executable, "-m", "grader.server"], stdin=subprocess.DEVNULL, stdout=log,
                             stderr=log, start_new_session=True, close_fds=True, cwd=str(path.parent))
    except OSError:
        return False
    return True


def status() -> dict:
    """What ``doctor`` shows: whether a server answers, its pid and whether its code is current."""
    sock = _connect()
    if sock is None:
        return {"running": False, "socket": str(socket_path())}
    try:
        with sock, sock.makefile("rwb") as stream:
            stream.write(json.dumps({"key": _read_key(), "ping": True}).encode() + b"\n")
            stream.flush()
            answer = json.loads(stream.readline())
    except (OSError, ValueError):
        return {"running": False, "socket": str(socket_path())}
    if not isinstance(answer, dict) or answer.get("type") == "refused":
        why = answer.get("why") if isinstance(answer, dict) else "an unreadable answer"
        return {"running": True, "socket": str(socket_path()), "pid": None, "current": False, "gradings": 0,
                "refused": why}
    return {"running": True, "socket": str(socket_path()), "pid": answer.get("pid"),
            "current": answer.get("version") == code_version(), "gradings": answer.get("gradings", 0)}


def stop() -> bool:
    """Ask a running server to exit now; True when one answered."""
    sock = _connect()
    if sock is None:
        return False
    with contextlib.suppress(OSError, ValueError), sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps({"key": _read_key(), "stop": True}).encode() + b"\n")
        stream.flush()
        stream.readline()
    return True


# --- the server's side --------------------------------------------------------------------------


def serve() -> None:
    """Accept gradings one at a time until idle for the idle time, or told to stop."""
    from grader import grading, protocol
    from grader.rank import harness
    from grader.options import GradeOptions

    version = code_version()
    path = socket_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if _answering():
        return  # another server already answers there
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # the socket is the user's alone from the moment it exists
    try:
        listener.bind(str(path))
    except OSError:
        return  # another server bound it first
    finally:
        os.umask(old_mask)
    key = _write_key()
    listener.listen(8)
    idle_s = float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    grading.warm_up(dynamo=True)
    sessions = protocol.Sessions()
    served = {"gradings": 0}
    try:
        while True:
            listener.settimeout(idle_s)
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                return
            if not _serve_connection(conn, key, version, sessions, GradeOptions, served):
                return
    finally:
        listener.close()
        for stale in (path, key_path()):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        sessions.close()
        harness.stop_pool()


def _write_key() -> str:
    """A fresh key in ``server.key`` (0600, written whole before the first request can come)."""
    key = secrets.token_hex(32)
    target = key_path()
    tmp = target.with_name(f"{KEY_NAME}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key + "\n")
    os.replace(tmp, target)
    return key


def peer_refusal(conn: socket.socket) -> str | None:
    """Why this connection's peer may not use the server, or None when it may.

    The peer must be a process of this user in this user, mount, network and PID namespaces:
    a process in a sandbox (or any other container) is refused.
    """
    if not hasattr(socket, "SO_PEERCRED"):
        return "the peer of the connection cannot be checked on this system"
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError as exc:
        return f"the peer of the connection cannot be checked: {exc}"
    if uid != os.getuid():
        return f"the client runs as user {uid}, not as the server's user {os.getuid()}"
    if pid <= 0:
        return "the client runs in a PID namespace the server cannot see (a sandbox or a container)"
    for ns in NAMESPACES:
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/{ns}")
            mine = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            return f"the client's {ns} namespace cannot be read"
        if theirs != mine:
            return f"the client runs in another {ns} namespace (a sandbox or a container)"
    return None


def _serve_connection(conn: socket.socket, key: str, version: str, sessions, GradeOptions,
                      served: dict) -> bool:
    """Serve one connection; False when the server must exit. A client gone away is never the server's end."""
    try:
        with conn:
            conn.settimeout(CONNECT_TIMEOUT_S * 10)  # reading the request; a grading sets no timeout on sends
            why = peer_refusal(conn)
            stream = conn.makefile("rwb")
            try:
                if why is not None:
                    _log(f"refused a connection: {why}")
                    # read the request first (never used): a peer closed with the request unread can
                    # leave the client unable to send it, and it would never see why it was refused
                    with contextlib.suppress(OSError, ValueError):
                        stream.readline(1 << 16)
                    _send(stream, {"type": "refused", "why": why})
                    return True
                return _answer(stream, conn, key, version, sessions, GradeOptions, served)
            finally:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()
    except (OSError, ValueError) as exc:  # the client went away, or sent something unreadable
        _log(f"a connection ended early: {type(exc).__name__}: {exc}")
        return True


def _send(stream, message: dict) -> None:
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def _log(line: str) -> None:
    import time

    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _answer(stream, conn, key: str, version: str, sessions, GradeOptions, served: dict) -> bool:
    """Serve one request; False when the server must exit (stale code, or asked to stop)."""
    from grader import protocol

    try:
        request = json.loads(stream.readline())
    except ValueError:
        return True
    if not isinstance(request, dict) or not hmac.compare_digest(str(request.get("key", "")), key):
        _log("refused a request without the server's key")
        _send(stream, {"type": "refused", "why": "the request does not carry this server's key"})
        return True
    if request.get("ping"):
        _send(stream, {"pid": os.getpid(), "version": version, **served})
        return True
    if request.get("stop"):
        _send(stream, {"stopping": True})
        return False
    if request.get("version") != version:
        _send(stream, {"type": "stale", "why": "the grader's code changed since this server started"})
        return False
    conn.settimeout(None)
    gone = []

    def send_quietly(message: dict) -> None:
        if gone:
            return
        try:
            _send(stream, message)
        except (OSError, ValueError):
            gone.append(True)  # the client went away: finish the grading (its ranks are reaped), send nothing

    if protocol.answer(request, sessions.get(GradeOptions.from_dict(request.get("options") or {})),
                       send_quietly) is not None:
        served["gradings"] += 1
    if gone:
        _log("a client went away before its grading ended; the grading finished and its processes were reaped")
    return True


if __name__ == "__main__":
    serve()
