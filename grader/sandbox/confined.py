"""The grader's side of the sandbox: a session whose ranks run in a sandbox while everything that
decides runs here.

:class:`ConfinedSession` stands where a :class:`grader.rank.harness.Session` stands for
:class:`grader.grading.Grading` (``run``, ``run_many``, ``worker``, ``tmp``), but its pool and its
ranks live in a fresh sandbox (:mod:`grader.sandbox`), started for one submission and ended with
it: inside runs ``python -m grader.rank.rank_host`` (:mod:`grader.rank.rank_host`), which starts what it is
asked and sends back what the ranks did. Out here stay the checks, the report, progress and
results: a submission can at most make its ranks claim what a correct solution's ranks would
send, never write a verdict.

What crosses is bounded and checked:

* every answer is one frame of at most :data:`grader.sandbox.boundary.MAX_ANSWER_BYTES`, read under a
  deadline and decoded as data by :func:`grader.rank.wire.loads` (its nesting, values and tensor elements
  bounded before anything is built); then each outcome is checked field by field (types, sizes, the
  ranks it names) before any check sees it (:mod:`grader.sandbox.boundary`); requests go in the same
  form, never a pickle;
* a run gets its deadline plus :data:`STOP_MARGIN_S` to be answered, however the host was
  treated (stopped, killed, flooded): past it the sandbox is ended and the run is a timeout;
* while the grader waits it reads, every :data:`POLL_S`, every process of the sandbox: each one's
  resident memory (at most the memory limit, with :data:`PROCESS_SLACK`), all of them together
  (proportional set sizes, at most :func:`grader.rank.limits.sandbox_memory_bytes`), how many there are
  (:data:`MAX_PROCESSES`, :data:`MAX_TASKS`); one over ends the sandbox and the grading fails, naming
  the limit (the sizes and numbers of files of ``/tmp``, ``/dev/shm`` and the ranks' folder are the
  kernel's to hold: each is a tmpfs of the tmp limit); where this process can make one (root), the
  sandbox runs in a pids cgroup of its own (:mod:`.tasks`);
* files the ranks leave are read from their folder with :mod:`grader.rank.untrusted` (no links, no
  FIFOs, sizes capped), through a descriptor of that folder opened from here (a tmpfs of the
  sandbox's, named in every path by the name it has inside).

The learner's file is read once here and handed in as a copy, in a folder of its own, read-only;
nothing else of this machine's but what the grader's code needs is visible inside.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from grader.rank import limits as _limits
from grader import traffic
from grader.rank import sock_diag, untrusted, wire
from grader.sandbox import tasks as _tasks
from grader.sandbox.boundary import MAX_ANSWER_BYTES, Unreadable, error_from, rank_from, text, world_from
from grader.rank.outcomes import RankOutcome, SessionBroken, WorldOutcome
from grader.rank.wire import HEADER, frame

START_S = 60.0  # for the sandbox to start and its host to import torch and start its pool
RUN_START_S = 30.0  # for the host to take up a request (no code of the submission's runs before it answers)
HAND_OUT_S = 3.0  # for the host to hand a run's ranks their specs (the run's deadline starts after)
COUNTERS_S = 5.0  # for the kernel's counters, which the host sends before it answers "ready"
STOP_MARGIN_S = 6.0  # beyond a run's deadline: for the host to stop its ranks and answer
POLL_S = 0.5  # how often the sandbox's processes are read while the grader waits
MAX_PROCESSES = 512  # processes in the sandbox at once (threads are bounded inside: MAX_TASKS)
MAX_TASKS = 4096  # processes and threads in the sandbox: RLIMIT_NPROC inside (or a pids cgroup, .tasks), and read
TOOL_TASKS = 4  # with the rest, beside the tool's own processes outside it (bwrap's, unshare's), which that limit
# does not count: the grader's reading ends the sandbox only where the kernel's limit did not hold
PROCESS_SLACK = 1.25  # one process may hold this times the memory limit before the sandbox is ended


class Broken(SessionBroken):
    """The sandbox cannot answer any more: its host ended or sent what cannot be read, or the
    submission went over a limit of the whole sandbox. ``limit`` names the limit ("" otherwise)."""

    def __init__(self, message: str, limit: str = ""):
        super().__init__(message)
        self.limit = limit


# --- the sandbox's processes ---------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, resident bytes, threads) of a process, from /proc/PID/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        return int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE"), int(fields[17])
    except (ValueError, IndexError):
        return None


def _proportional(pid: int) -> int:
    """Proportional set size (shared pages split among the processes that share them), or RSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    info = _stat(pid)
    return info[1] if info else 0


def sandbox_processes(root: int) -> dict[int, tuple[int, int]]:
    """{pid: (resident bytes, threads)} of ``root`` and every process under it (a process whose parent
    ended is adopted by the sandbox's first process, itself under ``root``)."""
    parents: dict[int, int] = {}
    info: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        got = _stat(int(entry))
        if got is not None:
            parents[int(entry)] = got[0]
            info[int(entry)] = (got[1], got[2])
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, pending = {}, [root]
    while pending:
        pid = pending.pop()
        if pid in found or pid not in info:
            continue
        found[pid] = info[pid]
        pending.extend(children.get(pid, ()))
    return found


# --- the session -------------------------------------------------------------------------------


class ConfinedSession:
    """A session whose pool and ranks run in a sandbox started for one submission (see the module).

    ``source`` is the submission's bytes (read once by the caller with
    :func:`grader.rank.untrusted.read_submission`), written here as ``name`` in a folder of its own:
    :attr:`learner_path` is the path to grade. ``processes``: how many of the limit's worth of
    memory the whole sandbox may hold (:func:`grader.rank.limits.sandbox_memory_bytes`).
    """

    def __init__(self, source: bytes, name: str, limits: dict, *, tool: str | None = None, modules=(),
                 dynamo: bool = True, ranks: int = 4, env: dict | None = None):
        from grader import sandbox

        self.limits = {**_limits.DEFAULT_LIMITS, **(limits or {})}
        self.tmp = tempfile.mkdtemp(prefix="ddp-grade-out-")  # this process's alone (Hypothesis' files)
        self.submission_dir = tempfile.mkdtemp(prefix="ddp-grade-sub-", dir=_short_temp_root())
        self.learner_path = os.path.join(self.submission_dir, os.path.basename(name))
        fd = os.open(self.learner_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        os.chmod(self.submission_dir, 0o555)
        self.memory_total = _limits.sandbox_memory_bytes(self.limits, ranks)
        self.broken: Broken | None = None
        self._closed = False
        self._workers = 0
        self._errors: list[bytes] = []
        self._ranks_fd: int | None = None  # the ranks' folder, held open from here (see _hold_folder)
        # The ranks' folder: a tmpfs inside, named so in every path the host and the checks use; read from here
        # through a descriptor of it. Its own name in each sandbox, as one process may hold several.
        self.ranks_folder = f"{sandbox.RANKS_FOLDER}-{uuid.uuid4().hex[:12]}"
        size = self.limits["tmp_bytes"]
        tool = tool or sandbox.tool()
        # The host's two pipes are descriptors of its own, never its standard input and output.
        requests_in, requests_out = os.pipe()
        answers_in, answers_out = os.pipe()
        given = [requests_in, answers_out]
        if tool == sandbox.BWRAP:
            given.append(sandbox.filter_descriptor())
        argv = sandbox.wrap(sandbox.host_command(requests_in, answers_out), [self.submission_dir], tool,
                            tmp_bytes=size, ranks_folder=self.ranks_folder,
                            filter_fd=given[2] if len(given) > 2 else None)
        # The host sends the kernel's TCP counters of its network namespace back over it first (sock_diag.send_pair)
        self._counters_channel, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        given.append(inside.fileno())
        sandbox_env = sandbox.environment({"DDP_GRADE_SERVER": "0", "DDP_GRADE_STATE_DIR": "/tmp/ddp-grade-state",
                                           sock_diag.PAIR_ENV: str(inside.fileno()), **(env or {})}, size)
        self._tasks = _tasks.TaskGroup.make(MAX_TASKS)  # a pids cgroup where this process can make one
        try:
            self.proc = subprocess.Popen(self._tasks.command(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, env=sandbox_env, start_new_session=True,
                                         pass_fds=given)
        except BaseException:
            for fd in (requests_out, answers_in):
                os.close(fd)
            self._tasks.remove()
            raise
        finally:
            for fd in given[:-1]:
                os.close(fd)
            inside.close()
        self._requests = os.fdopen(requests_out, "wb")
        self._answers = os.fdopen(answers_in, "rb", buffering=0)
        self._out = answers_in
        self.diag = None  # the counters, once the host has sent them (None where the kernel refused them)
        self._host_pid: int | None = None  # the host as its PID namespace sees it (its "ready")
        os.set_blocking(self._out, False)
        threading.Thread(target=self._pump_errors, daemon=True).start()
        self._started_at = time.monotonic()
        self._ready = False
        try:
            self._send({"tmp": self.ranks_folder, "limits": self.limits, "dynamo": dynamo, "modules": list(modules),
                        "max_tasks": MAX_TASKS})
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> None:
        """Wait until the host has started its pool (Broken when it cannot). The sandbox starts as the
        session is made: whatever the caller does meanwhile (importing the checks) overlaps with it."""
        if self._ready:
            return
        ready = self._answer(self._started_at + START_S, "the sandbox to start")
        if ready.get("type") != "ready":
            self._break(f"the sandbox's host answered {_what(ready)} instead of starting")
        self._hold_folder()
        self._ready = True
        self._host_pid = ready.get("pid") if type(ready.get("pid")) is int else None
        try:  # sent before the host's first answer, before any rank existed
            self.diag = traffic.Diag(traffic.receive_pair(self._counters_channel, COUNTERS_S))
        except (traffic.Unavailable, OSError):
            self.diag = None
        finally:
            self._counters_channel.close()

    def counters(self) -> tuple | None:
        """What grader.traffic counts this sandbox's runs with: (the kernel's counters of its network namespace,
        the ranks' folder as reached from here and as named inside, the depth of its PID namespace, the host's pid
        as this process sees it); None where the kernel refused them."""
        self._usable()
        if self.diag is None:
            return None
        host = [p for p in sandbox_processes(self.proc.pid) if traffic.namespace_pids(p)[1:2] == [self._host_pid]]
        return self.diag, (f"/proc/self/fd/{self._ranks_fd}", self.ranks_folder), 1, host[:1]  # via our hold on it

    def _hold_folder(self) -> None:
        """Open the ranks' folder from here, through the sandbox's first process (the host, in whose mount
        namespace it is a tmpfs): it is read through that descriptor
        (:func:`grader.rank.untrusted.trust_folder` ``through``) by the path it has inside, whatever becomes of
        the sandbox or of that process's number."""
        first = _first_process(self.proc.pid)
        if first is None:
            self._break(f"the sandbox's first process cannot be found{self._exit_words()}")
        try:
            self._ranks_fd = os.open(f"/proc/{first}/root{self.ranks_folder}", os.O_RDONLY | os.O_DIRECTORY |
                                     os.O_CLOEXEC)
        except OSError as exc:
            self._break(f"the sandbox's {self.ranks_folder} cannot be read from outside: {exc.strerror or exc}")
        untrusted.trust_folder(self.ranks_folder, through=self._ranks_fd)

    # --- the Session interface -------------------------------------------------------------

    def run(self, driver: str, world_size: int, *, learner_path: str, timeout_s: float, backend: str = "gloo",
            kwargs: dict | None = None, env: dict | None = None, grace_s: float = 3.0) -> WorldOutcome:
        from grader.rank.harness import World

        return self.run_many([World(driver, world_size, kwargs, env)], learner_path=learner_path,
                             timeout_s=timeout_s, backend=backend, grace_s=grace_s)[0]

    def run_many(self, worlds, *, learner_path: str, timeout_s: float, backend: str = "gloo", grace_s: float = 3.0,
                 last_read_on_failure: list[bool] | None = None) -> list[WorldOutcome]:
        self._usable()
        asked = time.monotonic()
        self._send({"op": "run_many", "worlds": [(w.driver, w.world_size, w.kwargs, w.env) for w in worlds],
                    "learner_path": learner_path, "timeout_s": timeout_s, "backend": backend, "grace_s": grace_s,
                    "last_read_on_failure": last_read_on_failure})
        try:
            # Until the host says it starts the ranks, none of this run's code runs: the grader's time.
            self._expect(self._answer(asked + RUN_START_S, "the run to start"), "starting")
            starting = time.monotonic()
            # From here the ranks may run: the run's deadline, and the few seconds the ranks take to get
            # their specs, and the margin for the host to stop them and answer; whatever the ranks do.
            until = starting + HAND_OUT_S + timeout_s + STOP_MARGIN_S
            self._expect(self._answer(until, "the ranks to start"), "started")
            start_s = (starting - asked) + min(time.monotonic() - starting, HAND_OUT_S)
            answer = self._answer(until, "the run to end")
        except _Late:
            return [self._timed_out(w.world_size, time.monotonic() - asked) for w in worlds]
        if answer.get("type") != "outcomes" or not isinstance(answer.get("outcomes"), list) \
                or len(answer["outcomes"]) != len(worlds):
            self._break(f"the sandbox answered a run with {_what(answer)}")
        try:
            outcomes = [world_from(data, w.world_size) for data, w in zip(answer["outcomes"], worlds)]
        except Unreadable as exc:
            self._break(f"the submission's ranks sent something the grader cannot read: {exc}")
        for outcome in outcomes:
            outcome.start_s = start_s
            outcome.seconds = time.monotonic() - asked
        return outcomes

    def _expect(self, answer: dict, kind: str) -> None:
        if answer.get("type") != kind:
            self._break(f"the submission's ranks sent something the grader cannot read: {_what(answer)} where "
                        f"{kind!r} was expected")

    def worker(self, driver: str, *, learner_path: str, timeout_s: float, kwargs: dict | None = None,
               backend: str = "gloo") -> "ConfinedWorker":
        self._usable()
        self._send({"op": "worker", "driver": driver, "learner_path": learner_path, "timeout_s": timeout_s,
                    "kwargs": kwargs, "backend": backend})
        try:
            answer = self._answer(time.monotonic() + RUN_START_S, "a worker to start")
        except _Late:
            self._break("the sandbox did not start a worker in time")
        if answer.get("type") != "worker" or type(answer.get("id")) is not int:
            self._break(f"the sandbox answered a worker's start with {_what(answer)}")
        return ConfinedWorker(self, answer["id"], text(answer.get("run_dir"), 4096), time.monotonic() + timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.diag is not None:
            self.diag.close()
        with contextlib.suppress(OSError):
            self._counters_channel.close()
        # Nothing of the sandbox is kept: ending it (its first process, and with it every process in
        # its PID namespace) is quicker than asking the host to stop its pool and ranks one by one.
        self._end()
        from grader.rank.processes import remove_folder

        untrusted.forget_folder(self.ranks_folder)
        if self._ranks_fd is not None:  # the last hold on the ranks' tmpfs: its memory is freed
            os.close(self._ranks_fd)
            self._ranks_fd = None
        self._tasks.remove()
        for folder in (self.submission_dir, self.tmp):
            remove_folder(folder)

    def __enter__(self) -> "ConfinedSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the wire ----------------------------------------------------------------------------

    def _usable(self) -> None:
        if self.broken is not None:
            raise self.broken
        if self._closed:
            raise Broken("the sandbox was closed")
        if not self._ready:
            try:
                self.wait_ready()
            except _Late:
                self._break(f"the sandbox did not start within {START_S:g} s")

    def _send(self, message: dict) -> None:
        try:
            self._requests.write(frame(wire.dumps(message)))
            self._requests.flush()
        except (OSError, ValueError):
            self._break(f"the sandbox's host ended{self._exit_words()}")

    def _answer(self, until: float, waiting_for: str) -> dict:
        """The next answer, read under ``until`` while the sandbox's limits are watched. _Late past
        ``until`` (the sandbox is ended then); Broken when the host ends, or sends what cannot be read."""
        try:
            header = self._read(HEADER.size, until)
            (size,) = HEADER.unpack(header)
            if size > MAX_ANSWER_BYTES:
                self._break(f"the submission's ranks sent something the grader cannot read: an answer of {size:,} "
                            f"bytes (at most {MAX_ANSWER_BYTES:,} are read)")
            data = self._read(size, until)
        except _Late:
            self._end()
            raise
        except EOFError:
            self._break(f"the sandbox's host ended while the grader waited for {waiting_for}{self._exit_words()}")
        try:
            message = wire.loads(data, wire.Budget(bytes=MAX_ANSWER_BYTES))
        except Exception as exc:
            self._break(f"the submission's ranks sent something the grader cannot read: {type(exc).__name__}: "
                        f"{str(exc)[:200]}")
        if not isinstance(message, dict):
            self._break("the submission's ranks sent something the grader cannot read: an answer that is not a "
                        "mapping")
        if message.get("type") == "failed":
            self._break(f"the sandbox's host failed: {text(message.get('why') if isinstance(message.get('why'), str) else '', 500)}")
        return message

    def _read(self, n: int, until: float) -> bytes:
        chunks, got = [], 0
        next_poll = time.monotonic()
        while got < n:
            now = time.monotonic()
            if now >= next_poll:
                self._watch()
                next_poll = now + POLL_S
            if now >= until:
                raise _Late()
            ready, _, _ = select.select([self._out], [], [], max(0.0, min(until, next_poll) - now))
            if not ready:
                continue
            try:
                chunk = os.read(self._out, min(n - got, 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _watch(self) -> None:
        """End the sandbox when its processes or its folder are over a limit (Broken, naming it)."""
        memory = self.limits.get("memory_bytes") or 0
        found = sandbox_processes(self.proc.pid)
        if len(found) > MAX_PROCESSES:
            self._break(f"the submission started more than {MAX_PROCESSES} processes at once", limit="processes")
        if sum(threads for _, threads in found.values()) > MAX_TASKS + TOOL_TASKS:
            self._break(f"the submission ran more than {MAX_TASKS} processes and threads at once", limit="processes")
        if memory:
            for pid, (rss, _) in found.items():
                if rss > memory * PROCESS_SLACK:
                    self._break(f"a process of the submission went over the memory limit "
                                f"({memory / 2**20:g} MiB resident; --memory-limit changes it)", limit="memory")
            if sum(rss for rss, _ in found.values()) > self.memory_total:
                total = sum(_proportional(pid) for pid in found)
                if total > self.memory_total:
                    self._break(f"the submission's processes together went over {self.memory_total / 2**20:g} MiB "
                                f"({_limits.SANDBOX_MEMORY_WORDS}; --memory-limit changes it)", limit="memory")
    def _break(self, message: str, limit: str = ""):
        self._end()
        self.broken = Broken(message, limit)
        raise self.broken

    def _end(self) -> None:
        """End the sandbox and everything in it (its first process takes the rest with it)."""
        if self.proc.poll() is None:
            for sig in (signal.SIGKILL,):
                try:
                    os.killpg(self.proc.pid, sig)
                except OSError:
                    pass
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self._requests, self._answers):
            try:
                stream.close()
            except (OSError, ValueError):
                pass

    def _timed_out(self, world_size: int, seconds: float) -> WorldOutcome:
        self.broken = Broken("the sandbox was ended when a run passed its deadline")
        return WorldOutcome(world_size, [RankOutcome(rank, "killed") for rank in range(world_size)], timed_out=True,
                            seconds=seconds)

    def _pump_errors(self) -> None:
        """Keep the last few KiB of what the host printed (for a message when it ends), read in
        chunks: a line without end costs nothing here."""
        fd = self.proc.stderr.fileno()
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return
                self._errors.append(chunk[-4096:])
                kept = b"".join(self._errors)[-4096:]
                self._errors[:] = [kept]
        except (OSError, ValueError):
            pass

    def _exit_words(self) -> str:
        code = self.proc.poll()
        if code is None:
            try:
                code = self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return ""
        said = untrusted.clean_text(b"".join(self._errors).decode(errors="replace")).strip()[-300:]
        return f" (exit code {code})" + (f": {said}" if said else "")


class _Late(Exception):
    """No answer by the deadline."""


def _what(answer: dict) -> str:
    kind = answer.get("type")
    return f"{str(kind)[:40]!r}" if isinstance(kind, str) else "an answer of no known kind"


class ConfinedWorker:
    """A worker process in the sandbox (see :meth:`grader.rank.harness.Session.worker`)."""

    def __init__(self, session: ConfinedSession, number: int, run_dir: str, deadline: float):
        self.session = session
        self.number = number
        self.run_dir = run_dir
        self.deadline = deadline
        self.calls = 0
        self._ended = False

    @property
    def alive(self) -> bool:
        return not self._ended and self.session.broken is None

    def __enter__(self) -> "ConfinedWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, name: str, within_s: float | None = None, **kwargs) -> dict:
        from grader.rank.harness import WorkerDied, WorkerTimeout

        self.calls += 1
        session = self.session
        if not self.alive:
            raise WorkerDied(RankOutcome(0, "exited"))
        deadline = self.deadline if within_s is None else min(self.deadline, time.monotonic() + within_s)
        session._send({"op": "call", "id": self.number, "name": name, "within_s": max(0.0, deadline - time.monotonic()),
                       "kwargs": kwargs})
        try:
            answer = session._answer(deadline + STOP_MARGIN_S, f"{name} to answer")
        except _Late:
            self._ended = True
            session.broken = Broken("the sandbox was ended when a worker passed its deadline")
            raise WorkerTimeout(RankOutcome(0, "killed")) from None
        kind = answer.get("type")
        if kind == "reply":
            reply = answer.get("reply")
            if not isinstance(reply, dict) or reply.get("status") not in ("ok", "error"):
                session._break("the submission's process sent a reply the grader cannot read")
            try:
                if reply.get("status") == "error":
                    reply = {"status": "error", "error": error_from(reply.get("error"))}
            except Unreadable as exc:
                session._break(f"the submission's process sent something the grader cannot read: {exc}")
            return reply
        if kind == "raised" and answer.get("kind") in ("timeout", "died"):
            try:
                outcome = rank_from(answer.get("outcome"))
            except Unreadable as exc:
                session._break(f"the submission's process sent something the grader cannot read: {exc}")
            self._ended = True
            raise (WorkerTimeout if answer["kind"] == "timeout" else WorkerDied)(outcome)
        session._break(f"the sandbox answered a call with {_what(answer)}")

    def close(self) -> None:
        if self._ended:
            return
        self._ended = True
        session = self.session
        if session.broken is not None or session._closed:
            return
        try:
            session._send({"op": "close_worker", "id": self.number})
            session._answer(time.monotonic() + 15, "a worker to close")
        except (Broken, _Late):
            pass


def _first_process(pid: int) -> int | None:
    """The sandbox's first process (the host, PID 1 of its namespace) as this process numbers it: the one
    child of the tool's process ``pid`` that is PID 1 where it lives."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/status") as f:
                    spaces = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
            except OSError:
                continue
            if len(spaces) > 1 and spaces[-1] == "1":
                return child
    return None


def _short_temp_root() -> str:
    """The temp folder, or /tmp when its path is too long for a pool's socket (108 bytes on Linux)."""
    root = tempfile.gettempdir()
    if len(root) > 48 and os.path.isdir("/tmp") and os.access("/tmp", os.W_OK):
        return "/tmp"
    return root
