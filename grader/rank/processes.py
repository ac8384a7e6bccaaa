"""Processes under the harness: the warm pool (a forkserver with torch preloaded), messages read
from ranks under a deadline, a rank's files, and the processes a run leaves behind (found by the
marker in their environment, and killed). :mod:`grader.rank.harness` starts and waits for runs with these.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import types

OUTPUT_TAIL_CHARS = 3000
MAX_MESSAGE_BYTES = 64 * 2**20  # one rank's message (grader.rank.wire.MAX_BYTES: what a whole run's may hold)
RUN_MARKER = "DDP_GRADE_RUN"  # environment variable carried by every process of a run
REAP_PASSES = 5  # a process forking in a loop is caught within a few passes
# c10d names the peer of every store connection with a reverse DNS lookup (its log text), and for
# 127.0.0.1, which it reaches as ::ffff:127.0.0.1, /etc/hosts has no answer: the query goes to the
# DNS server. Where that server drops a query now and then, glibc waits 5 s before asking again
# and the rank stalls in init_process_group. Asking again after 1 s instead bounds the stall
# (a failed lookup would make c10d print a warning, so the second try is kept). A RES_OPTIONS of
# the user's own is kept.
RESOLVER_OPTIONS = "timeout:1 attempts:2"


def resident_bytes(pid: int | None) -> int:
    """Resident memory of a process (VmRSS), 0 when unknown. Linux only."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def descendants(pid: int, limit: int = 4096) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), from /proc/PID/task/TID/children; at most
    ``limit`` of them. Linux only ([] elsewhere, or when ``pid`` is gone)."""
    found: list[int] = []
    pending = [pid]
    seen = {pid}
    while pending and len(found) < limit:
        current = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{current}/task/{tid}/children", "rb") as f:
                    children = f.read().split()
            except OSError:
                continue
            for child in children:
                try:
                    child_pid = int(child)
                except ValueError:
                    continue
                if child_pid not in seen:
                    seen.add(child_pid)
                    found.append(child_pid)
                    pending.append(child_pid)
    return found


def remove_folder(path: str) -> None:
    """Remove a folder ranks wrote in, whatever they did to its permissions (links are not followed)."""
    import shutil
    import stat

    def unlock(function, failed, _exc):
        with contextlib.suppress(OSError):
            parent = os.path.dirname(failed)
            os.chmod(parent, os.stat(parent, follow_symlinks=False).st_mode | stat.S_IRWXU)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, stat.S_IRWXU)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    shutil.rmtree(path, onerror=unlock)
    shutil.rmtree(path, ignore_errors=True)


def _recv(conn, deadline: float, maxsize: int = MAX_MESSAGE_BYTES) -> bytes:
    """One message from ``conn`` (multiprocessing's framing), or TimeoutError past ``deadline``.

    ``Connection.recv_bytes`` would block for ever on a message cut off half-way
    by a sender that then stalls; this reads with a deadline instead.
    """
    import struct

    fd = conn.fileno()
    header = _read_exactly(fd, 4, deadline)
    (size,) = struct.unpack("!i", header)
    if size == -1:
        (size,) = struct.unpack("!Q", _read_exactly(fd, 8, deadline))
    if size < 0 or size > maxsize:
        raise ValueError(f"a message of {size} bytes (at most {maxsize} are read)")
    return _read_exactly(fd, size, deadline)


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("message not complete by the deadline")
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _receive(conn, deadline: float, block: bool = True, budget=None) -> dict | None:
    """One rank's message, read within ``budget`` (a :class:`grader.rank.wire.Budget`, shared by the ranks of
    a run); None when the pipe closed without one, an error of that rank when it cannot be read."""
    try:
        if not block and not conn.poll(0.2):
            return None
        return _load(_recv(conn, deadline, _most(budget)), budget)
    except (EOFError, OSError):
        return None
    except Exception as exc:  # an unreadable message counts as an error of that rank
        return unreadable(exc)


def unreadable(exc: Exception) -> dict:
    """A rank's report that could not be read, as the report of that rank's error."""
    return {"status": "error", "error": {"type": type(exc).__name__, "message":
            f"the grader could not read this rank's report: {exc}", "traceback": "", "where": None, "phase": "run"}}


def _most(budget) -> int:
    return MAX_MESSAGE_BYTES if budget is None else min(MAX_MESSAGE_BYTES, budget.bytes)


def _load(data: bytes, budget=None) -> dict:
    """A rank's message as data (:func:`grader.rank.wire.loads`, within ``budget``); ValueError when it is not
    a mapping."""
    from grader.rank import wire

    payload = wire.loads(data, budget)
    if not isinstance(payload, dict):
        raise ValueError("a report that is not a mapping")
    return payload


def _kill(process) -> None:
    pid = process.pid
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)  # the rank and everything it started
    except (OSError, AttributeError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def reap_strays(marker: str, variable: str = RUN_MARKER, marker_file: str | None = None) -> int:
    """Kill processes that carry this session's marker but escaped their group. Linux only.

    Passes repeat (up to REAP_PASSES) until one finds nothing, so a process that
    forks while it is being killed is caught too. Returns how many were killed.
    """
    killed = 0
    for _ in range(REAP_PASSES):
        found = marked_processes(marker, variable, marker_file)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        if not found:
            break
    return killed


def marked_processes(marker: str, variable: str = RUN_MARKER, marker_file: str | None = None) -> list[int]:
    """Live processes (not zombies) whose environment holds ``variable=marker``, or that hold
    ``marker_file`` open. Linux only."""
    if not os.path.isdir("/proc"):
        return []
    needle = f"{variable}={marker}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                marked = needle in f.read().split(b"\0")
            if not marked and marker_file:
                marked = _holds_open(int(entry), marker_file)
            if not marked:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[-1].split()[0]
            if state in (b"Z", b"X"):  # already dead, waiting for its parent to collect it
                continue
            found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def _holds_open(pid: int, path: str) -> bool:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in (path, path + " (deleted)"):
                    return True
    except OSError:
        pass
    return False


def _read(path: str, limit: int = 20000) -> str:
    """The start of a file a rank wrote (a link, a FIFO or a missing file: "")."""
    from grader.rank import untrusted

    try:
        fd = untrusted.open_regular(path)
    except untrusted.Unreadable:
        return ""
    with os.fdopen(fd, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _tail(path: str, chars: int = OUTPUT_TAIL_CHARS) -> str:
    """The end of a file a rank wrote (a link, a FIFO or a missing file: "")."""
    from grader.rank import untrusted

    try:
        fd = untrusted.open_regular(path)
    except untrusted.Unreadable:
        return ""
    try:
        with os.fdopen(fd, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            text = f.read(chars).decode("utf-8", errors="replace")
    except OSError:
        return ""
    if size > chars:
        text = f"[... {size - chars} earlier bytes not shown]\n" + text.split("\n", 1)[-1]
    return text


def _default_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# The pool's own setting (Ctrl-C ignored, before anything it forks), the rank side of this layer, and a
# module it imports when it sets limits; warm_up(modules=...) adds the caller's.
PRELOAD = ["grader.rank.pool_ctrl_c", "grader.rank.child", "resource"]


# DistributedDataParallel's constructor imports torch._dynamo (1-2 s); preloading it
# once in the forkserver saves that in every rank of the exercises that build a DDP. Its
# forward's first record_function imports the CUPTI monitor (20 ms of CPU per rank), and
# torch.save its serialization config.
PRELOAD_DYNAMO = ["torch._dynamo", "torch.profiler._cupti_monitor", "torch.utils.serialization"]


_preload_extra: list[str] = []  # what warm_up was asked to preload besides PRELOAD


def _context(start_method: str | None, dynamo: bool = True):
    """A forkserver with the grader (and so torch) preloaded, where the platform has one."""
    method = start_method or _default_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD + _preload_extra + (PRELOAD_DYNAMO if dynamo else []))
    return ctx


def parents_of(pid: int, limit: int = 64) -> list[int]:
    """``pid``'s parent, its parent's, ... (nearest first, up to pid 1)."""
    chain = []
    while len(chain) < limit:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        if pid <= 1 or pid in chain:
            break
        chain.append(pid)
    return chain


def namespace_pids(pid: int) -> list[int]:
    """``pid`` as each PID namespace it is in sees it, outermost first (/proc/PID/status's NSpid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return [pid]


_MAIN_LOCK = threading.RLock()


@contextlib.contextmanager
def _hidden_main():
    """Start children without making them re-run this program's ``__main__``.

    multiprocessing re-imports the parent's main script in every child (to find
    functions defined there). Ours are all in the grader package, and the
    caller's script may be anything: pytest, a console script, stdin. The lock
    keeps sessions used from several threads from restoring each other's stand-in.
    """
    with _MAIN_LOCK:
        real = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if real is not None:
                sys.modules["__main__"] = real


# A pool whose server a rank ended is started again: at most this many times for one process, this long apart.
POOL_RESTARTS = 10
POOL_RESTART_WAIT_S = 0.2


def start_in_pool(make) -> multiprocessing.Process:
    """``make()``, a process of the pool, started. Outside a sandbox a rank can reach the pool's server and end
    it (tests/hostile/01_floods_the_grader writes into its pipes); multiprocessing starts a new one at the next
    start once the dead one can be reaped, so a start it refuses is tried again, with a new process object."""
    for attempt in range(POOL_RESTARTS + 1):
        process = make()
        try:
            with _hidden_main():
                process.start()
            return process
        except (ConnectionError, FileNotFoundError, EOFError):
            if attempt == POOL_RESTARTS:
                raise
            time.sleep(POOL_RESTART_WAIT_S)


def warm_up(dynamo: bool = True, modules: list[str] | tuple[str, ...] = ()) -> None:
    """Start the forkserver now so it imports torch while this process does other work.

    ``dynamo=False`` skips torch._dynamo, which only ranks that build a
    DistributedDataParallel or a torch.optim optimizer import. ``modules``: more to import
    once in the pool (the layer above names its drivers' modules).
    """
    _preload_extra[:] = [m for m in modules if m not in PRELOAD]
    bound_name_lookups()  # before the pool starts: it and every rank inherit the setting
    ctx = _context(None, dynamo)
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        with _hidden_main():
            forkserver.ensure_running()
        atexit.register(stop_pool)


def stop_pool() -> None:
    """Stop the warm pool (the forkserver) this process started, and wait until it has exited.

    Registered at exit by :func:`warm_up`, so a command returns only after its pool is gone: left
    to itself, the forkserver notices its parent is gone only when it next looks, which on a busy
    machine is seconds later. Every rank it started has been stopped by then (``Session.close``).
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    address = server._forkserver_address
    server._forkserver_pid = server._forkserver_address = None
    if address and not address.startswith("\0"):
        with contextlib.suppress(OSError):
            os.unlink(address)
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):  # the tracker the forkserver started: it exits on end of input
        resource_tracker._resource_tracker._stop()


def _rendezvous_env(port: int, extra: dict | None) -> dict:
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DDP_GRADE_RENDEZVOUS_PORT": str(port),  # what MASTER_PORT was, whatever the learner does to it
        # Every rank connects to the store this process holds (as under torchrun).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    env.update(extra or {})
    return env


def bound_name_lookups() -> None:
    """Give this process (and what it starts) RESOLVER_OPTIONS unless RES_OPTIONS is set already.

    The grader's own store connects to itself once per run, so the lookup stall hits this process
    too, not only the ranks.
    """
    os.environ.setdefault("RES_OPTIONS", RESOLVER_OPTIONS)


def _platform_env() -> dict:
    """Keep gloo on the loopback interface, where every rank of a run lives, and bound the ranks'
    name lookups (RESOLVER_OPTIONS)."""
    env = {"RES_OPTIONS": os.environ.get("RES_OPTIONS", RESOLVER_OPTIONS)}
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return env
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    elif sys.platform == "darwin":
        env["GLOO_SOCKET_IFNAME"] = "lo0"
    return env
