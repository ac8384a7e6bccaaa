"""What runs inside each process the grader starts (one per rank).

The parent hands every child a *spec* (a plain dict) and one end of a pipe. The
child puts itself in a process group of its own (so the parent can kill it and
anything it started), sends its output to a file, arms ``faulthandler`` so the
parent can ask for its stack, imports the learner's file, runs the exercise's
driver and sends back one message: what it observed, or how it failed.

Messages to the parent are written by :mod:`grader.rank.wire`: plain data and tensors
only, read there with an allowlist, so nothing a submission puts in them can run
code in the parent.
"""

from __future__ import annotations

import contextlib

import faulthandler
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from grader.rank import wire
from grader.rank.sock_diag import TRAFFIC_ENV, ask_to_be_counted

# Variables a launcher may have left in the grader's own environment; a child
# must not inherit them, or a learner who forgets to pass rank and world size
# would still appear to work.
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
)

STACK_SIGNAL = signal.SIGUSR1
MAX_TRACEBACK_CHARS = 6000


class GraderAbort(Exception):
    """Raised by the grader's own code in a child to stop a run on purpose."""


@dataclass
class RankContext:
    """What a driver needs to know about the rank it runs as."""

    rank: int
    world_size: int
    backend: str
    learner_path: str
    run_dir: str
    timeout_s: float
    kwargs: dict = field(default_factory=dict)
    conn: object = None
    _learner: object = None

    def learner(self):
        """Import the learner's file (once) and return it as a module.

        Drivers call this after installing their probes, so that names the
        file imports from torch at its top are the observed ones.
        """
        if self._learner is None:
            try:
                self._learner = import_learner(self.learner_path)
            except BaseException as exc:
                raise LearnerImportError(exc) from exc
        return self._learner

    def function(self, name: str):
        """The learner's function or class called ``name``."""
        module = self.learner()
        if not hasattr(module, name):
            raise MissingName(name)
        return getattr(module, name)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", self.rank % torch.cuda.device_count())
        return torch.device("cpu")

    def init_group(self) -> None:
        """Join the default process group the grader prepared (exercises 05-10)."""
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            self.backend,
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            # Longer than the grader's own deadline, so a deadlock is reported by the grader (with
            # stacks) rather than by gloo's timeout racing it.
            timeout=timedelta(seconds=max(5.0, self.timeout_s) + 30),
        )

    def leave_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextlib.contextmanager
    def group(self):
        """``with ctx.group():`` the grader's own process group around a driver's work.

        Left only when the work returns: after an exception the process ends without tearing
        the group down (a peer may already be gone, and gloo's teardown can block on it).
        """
        self.init_group()
        yield
        self.leave_group()

    def serve(self, handlers: dict) -> None:
        """Answer the parent's calls until it says stop (used for pure functions)."""
        import pickle

        while True:
            try:
                request = pickle.loads(self.conn.recv_bytes())
            except EOFError:
                return
            if request is None:
                return
            name, kwargs = request
            try:
                reply = {"status": "ok", "result": handlers[name](self, **kwargs)}
            except BaseException as exc:  # the learner's error goes back as data
                reply = {"status": "error", "error": describe_exception(exc, self.learner_path)}
            send(self.conn, reply)


class LearnerImportError(Exception):
    """Importing the learner's file failed; ``original`` is what it raised."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


class MissingName(Exception):
    """The learner's file does not define a name the exercise needs."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def import_learner(path: str):
    """Import the learner's file as a module named after its file (``03_train``).

    The file's folder goes first on ``sys.path`` so that processes the learner
    spawns can import it again by that name.
    """
    path = os.path.abspath(path)
    name = Path(path).stem
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def resolve(ref: str):
    """``"package.module:function"`` -> the function."""
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def describe_exception(exc: BaseException, learner_path: str | None = None, phase: str = "run") -> dict:
    """A plain-data account of an exception: type, message, traceback, learner's frame."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = None
    raised_here = False  # the innermost frame is the learner's: raised by its own line (a stub's TODO, an assert)
    if learner_path:
        target = os.path.abspath(learner_path)
        link = exc.__traceback__
        while link is not None:
            code = link.tb_frame.f_code
            raised_here = os.path.abspath(code.co_filename) == target
            if raised_here:
                # co_qualname (3.11+) names methods with their class: "SimpleDDP.__init__"
                name = getattr(code, "co_qualname", code.co_name)
                where = {"line": link.tb_lineno, "function": name,
                         "code": _source_line(code.co_filename, link.tb_lineno)}
            link = link.tb_next
    if isinstance(exc, SyntaxError) and learner_path and exc.filename and \
            os.path.abspath(exc.filename) == os.path.abspath(learner_path):
        where = {"line": exc.lineno or 0, "function": "<module>", "code": (exc.text or "").strip()}
    info = {
        "at": time.monotonic(),  # the parent's clock too (CLOCK_MONOTONIC): which rank failed first
        "type": type(exc).__name__,
        "message": str(exc)[:2000],
        "traceback": tb[-MAX_TRACEBACK_CHARS:],
        "where": where,
        "raised_in_learner": raised_here,
        "phase": phase,
    }
    if isinstance(exc, MissingName):
        info["missing"] = exc.name
    return info


def _source_line(path: str, lineno: int) -> str:
    import linecache

    return linecache.getline(path, lineno).strip()


def send(conn, payload: dict) -> None:
    conn.send_bytes(wire.dumps(payload))


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (also from C code) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _arm_faulthandler(path: str):
    """Dump every thread's stack to ``path`` on a crash or when the parent asks."""
    stack_file = open(path, "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    return stack_file


def _apply_limits(limits: dict) -> None:
    """Memory, CPU-time and file-size limits for this process (and what it starts).

    ``memory_bytes`` is a limit on resident memory that the parent enforces; here
    the address space gets a backstop above it (see :mod:`grader.rank.limits`).
    """
    from grader.rank.limits import address_space_bytes

    try:
        import resource
    except ImportError:  # not on this platform
        return

    def lower(kind, value):
        soft, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            if kind == resource.RLIMIT_CPU:  # SIGXCPU at the soft limit, SIGKILL a little later
                top = value + 5 if hard == resource.RLIM_INFINITY else min(hard, value + 5)
                resource.setrlimit(kind, (value, top))
            else:
                resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass

    memory = address_space_bytes(limits.get("memory_bytes") or 0)
    if memory and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        # Not with a GPU build of torch: the GPU driver reserves far more address space
        # than any cap could allow. There the resident-memory watch is the limit.
        lower(resource.RLIMIT_AS, memory)
    cpu = limits.get("cpu_seconds")
    if cpu:
        lower(resource.RLIMIT_CPU, int(cpu))  # SIGXCPU at the soft limit
    output = limits.get("output_bytes")
    if output:
        lower(resource.RLIMIT_FSIZE, int(output))


_KEEP_ALIVE: list = []
_CONN = None  # this rank's line to the grader, for a report from a watchdog thread
_LEARNER_PATH = ""  # the learner's file, absolute
_STACK_FILE = None  # where faulthandler writes this rank's stacks

GRADER_PORT_VARIABLE = "DDP_GRADE_RENDEZVOUS_PORT"  # the port of the store the grader holds for this run
RENDEZVOUS_GRACE_S = 5.0  # a rank waiting this long to meet anywhere else is reported as stuck


def rendezvous_target(init_method=None, store=None) -> tuple[str | None, str | None]:
    """Where a call to init_process_group would meet its peers: (address, port), None when unknown."""
    if store is not None:
        return None, None
    if init_method and not str(init_method).startswith("env://"):
        from urllib.parse import urlparse

        parsed = urlparse(str(init_method))
        if parsed.scheme != "tcp":
            return None, None
        return parsed.hostname, None if parsed.port is None else str(parsed.port)
    return os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")


def _watch_process_groups() -> None:
    """Wrap init_process_group and new_group in every rank, for two reasons.

    Keep every group referenced until this process ends with os._exit. Dropping
    the last reference to a gloo group runs its C++ destructor, which joins the
    group's worker thread while holding the GIL; if that thread is just then
    releasing a finished work item that needs the GIL, both wait for ever. It
    happens rarely, on a busy machine, after correct code.

    Report a rendezvous that cannot complete: a call that would meet at another
    port than the one the grader holds, still waiting after RENDEZVOUS_GRACE_S,
    ends the rank with a report naming both (rather than a wait until the deadline).

    Where the grader counts the run's traffic (TRAFFIC_ENV), ask it to read this process's sockets as each
    group is made, and before one is destroyed: a peer's teardown may close a connection first.
    """
    original_init = c10d.init_process_group
    original_new_group = c10d.new_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           *args, **kwargs):
        watchdog = _rendezvous_watchdog(init_method, store)
        try:
            result = original_init(backend, init_method, timeout, world_size, rank, store, *args, **kwargs)
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if c10d.is_initialized():
            _KEEP_ALIVE.append(c10d._get_default_group())
            ask_to_be_counted(wait=False)  # its connections are open now, and stay so until it is destroyed
        return result

    def new_group(*args, **kwargs):
        group = original_new_group(*args, **kwargs)
        _KEEP_ALIVE.append(group)
        ask_to_be_counted(wait=False)
        return group

    for owner in (c10d, dist):
        owner.init_process_group = init_process_group
        owner.new_group = new_group
    if os.environ.get(TRAFFIC_ENV):  # destroying a group closes its connections: let the grader read them first
        original_destroy = c10d.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            ask_to_be_counted()
            return original_destroy(*args, **kwargs)

        for owner in (c10d, dist):
            owner.destroy_process_group = destroy_process_group


def _rendezvous_watchdog(init_method, store):
    import threading

    grader_port = os.environ.get(GRADER_PORT_VARIABLE)
    addr, port = rendezvous_target(init_method, store)
    if not grader_port or port is None or port == grader_port:
        return None
    where = _caller_in_learner_file()
    started = time.monotonic()
    info = {"addr": addr, "port": port, "grader_addr": "127.0.0.1", "grader_port": grader_port,
            "source": "init_method" if init_method and not str(init_method).startswith("env://") else "environment",
            "master_port_variable": os.environ.get("MASTER_PORT")}

    def report() -> None:
        info["waited_s"] = round(time.monotonic() - started, 1)
        error = {"type": "RendezvousStuck", "phase": "rendezvous", "where": where, "rendezvous": info,
                 "message": f"init_process_group waited {info['waited_s']:g} s for its peers at {addr}:{port}",
                 "traceback": "", "at": time.monotonic()}
        try:
            if _STACK_FILE is not None:
                faulthandler.dump_traceback(file=_STACK_FILE, all_threads=True)
            send(_CONN, {"status": "error", "error": error})
        finally:
            os._exit(1)

    timer = threading.Timer(RENDEZVOUS_GRACE_S, report)
    timer.daemon = True
    timer.start()
    return timer


def _caller_in_learner_file() -> dict | None:
    """The innermost frame of the learner's file on this thread's stack, as describe_exception's 'where'."""
    frame = sys._getframe(1)
    while frame is not None:
        if _LEARNER_PATH and os.path.abspath(frame.f_code.co_filename) == _LEARNER_PATH:
            code = frame.f_code
            return {"line": frame.f_lineno, "function": getattr(code, "co_qualname", code.co_name),
                    "code": _source_line(code.co_filename, frame.f_lineno)}
        frame = frame.f_back
    return None


def serve(conn) -> None:
    """Entry point of every rank process: wait for the spec on ``conn``, then run it.

    A spare (see harness.Session) waits here until a run needs it; its pipe closing ends it. While it
    waits it is in the process group of the command that started the pool, so Ctrl-C at the terminal
    reaches it too: it ignores that, as the command stops what it started (its spares included).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _dumpable()
    try:
        spec = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError, KeyboardInterrupt):
        os._exit(0)
    main(spec, conn)


def _dumpable() -> None:
    """Dumpable, as any process of its user: a sandbox's pool is not (:mod:`grader.rank.pool`), and the
    host that started this rank reads its /proc files (its environment, its descriptors)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE


def main(spec: dict, conn) -> None:
    """Run one rank of ``spec``, send the parent one report, and exit."""
    global _CONN, _LEARNER_PATH, _STACK_FILE
    try:
        os.setpgrp()
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.default_int_handler)  # in a group of its own now: as in any process
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    for name, value in spec["env"].items():
        if value is None:
            os.environ.pop(name, None)  # the run asked for this variable to be unset
        else:
            os.environ[name] = value
    if spec.get("marker_file"):  # held open for life, and inherited by whatever this rank starts
        with contextlib.suppress(OSError):
            os.set_inheritable(os.open(spec["marker_file"], os.O_RDONLY), True)
    rank = spec["rank"]
    _redirect_output(os.path.join(spec["run_dir"], f"rank{rank}.out"))
    _STACK_FILE = _arm_faulthandler(os.path.join(spec["run_dir"], f"rank{rank}.stack"))
    _apply_limits(spec.get("limits", {}))
    _CONN, _LEARNER_PATH = conn, os.path.abspath(spec["learner_path"])
    _watch_process_groups()
    # Several ranks share few cores: one compute thread each avoids them spinning against each other.
    torch.set_num_threads(1)
    ctx = RankContext(
        rank=rank,
        world_size=spec["world_size"],
        backend=spec["backend"],
        learner_path=spec["learner_path"],
        run_dir=spec["run_dir"],
        timeout_s=spec["timeout_s"],
        kwargs=spec.get("kwargs", {}),
        conn=conn,
    )
    try:
        try:
            payload = run_driver(spec["driver"], ctx)
        except BaseException as exc:  # the grader's own code failed: still one message back
            payload = {"status": "error", "error": {"type": type(exc).__name__, "message": str(exc)[:2000],
                                                    "traceback": "", "where": None, "phase": "run"}}
        ask_to_be_counted()  # every group made is still open (_KEEP_ALIVE): the grader reads its sockets now
        try:
            send(conn, payload)
        except BaseException as exc:  # e.g. a result that cannot be saved
            send(conn, {"status": "error", "error": describe_exception(exc)})
    finally:
        # Never the interpreter's own shutdown: it would destroy the gloo groups (see
        # _watch_process_groups). A flush may fail (over the output limit): ignored.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(0)


def run_driver(driver_ref: str, ctx: RankContext) -> dict:
    """Run one driver and turn what happened into a message for the parent."""
    driver = resolve(driver_ref)
    try:
        result = driver(ctx)
    except LearnerImportError as exc:
        return {"status": "error", "error": describe_exception(exc.original, ctx.learner_path, phase="import")}
    except MissingName as exc:
        return {"status": "error", "error": describe_exception(exc, ctx.learner_path, phase="import")}
    except BaseException as exc:
        return {"status": "error", "error": describe_exception(exc, ctx.learner_path)}
    return {"status": "ok", "result": result}
