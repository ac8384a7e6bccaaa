"""Start ranks, collect what happened, never hang.

A :class:`Session` owns a warm process pool (a ``multiprocessing`` forkserver
that has imported torch once) and a temporary folder. :meth:`Session.run`
starts one process per rank from that pool, gives each a fresh rendezvous (a
TCPStore that this process holds, so no port is ever picked and then lost to
another program), and waits for every rank under a deadline (:meth:`Session.run_many`
does the same for several worlds at once, each with its own rendezvous):

* a rank that returns sends its observations back as data;
* a rank that raises, exits early or crashes is recorded as such, and the
  others get a short grace period before they are stopped;
* at the deadline every rank still running is asked for its stack
  (``faulthandler``) and killed with everything it started;
* a rank over its memory limit is stopped (see :mod:`grader.limits`), and
  every process that still carries the run's marker afterwards is killed.

Nothing here waits without a deadline: messages from ranks are read with one
too, so a rank that sends half a message cannot stall the grader.

Nothing here decides whether an exercise passed: that is the checks' job, in
this process, from the :class:`WorldOutcome` returned.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
import uuid
from dataclasses import dataclass

from grader import limits as _limits

GRACE_AFTER_FAILURE_S = 3.0  # how long other ranks may run on after one failed
STACK_WAIT_S = 0.5  # how long a rank gets to write its stack before it is killed
OUTPUT_TAIL_CHARS = 3000
MAX_MESSAGE_BYTES = 256 * 2**20
RUN_MARKER = "DDP_GRADE_RUN"  # environment variable carried by every process of a run

DEFAULT_LIMITS = dict(_limits.DEFAULT_LIMITS)  # see grader.limits; a Session takes GradeOptions.limits
REAP_PASSES = 5  # a process forking in a loop is caught within a few passes
MAX_SPARES = 8  # rank processes a session with spares keeps forked ahead of its next run
# c10d names the peer of every store connection with a reverse DNS lookup (its log text), and for
# 127.0.0.1, which it reaches as ::ffff:127.0.0.1, /etc/hosts has no answer: the query goes to the
# DNS server. Where that server drops a query now and then, glibc waits 5 s before asking again
# and the rank stalls in init_process_group. Asking again after 1 s instead bounds the stall
# (a failed lookup would make c10d print a warning, so the second try is kept). A RES_OPTIONS of
# the user's own is kept.
RESOLVER_OPTIONS = "timeout:1 attempts:2"


@dataclass
class RankOutcome:
    """What one rank did."""

    rank: int
    status: str  # "ok", "error" (raised), "exited" (ended without a result), "killed" (stopped by us)
    result: object = None  # the driver's return value when status == "ok"
    error: dict | None = None  # type, message, traceback, where, phase when status == "error"
    exitcode: int | None = None
    stack: str = ""  # faulthandler's dump when the rank was stopped or crashed
    output: str = ""  # the end of what the rank printed
    seconds: float = 0.0
    limit: str = ""  # "memory", "cpu" or "output" when the rank hit that limit
    limit_detail: str = ""  # e.g. "the memory limit (2048 MiB resident; --memory-limit changes it)"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class WorldOutcome:
    """What a whole run (all ranks) did."""

    world_size: int
    ranks: list[RankOutcome]
    timed_out: bool = False
    seconds: float = 0.0
    run_dir: str = ""
    stray_processes: int = 0  # processes the submission left behind that had to be killed

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.ok for r in self.ranks)

    def results(self) -> list:
        return [r.result for r in self.ranks]

    def failures(self) -> list[RankOutcome]:
        """Ranks that raised or ended early (not those merely stopped after them)."""
        return [r for r in self.ranks if r.status in ("error", "exited")]

    def still_running(self) -> list[RankOutcome]:
        return [r for r in self.ranks if r.status == "killed"]


@dataclass
class World:
    """One run of :meth:`Session.run_many`: ``driver`` on ``world_size`` ranks."""

    driver: str
    world_size: int
    kwargs: dict | None = None
    env: dict | None = None


@dataclass
class _Rank:
    rank: int
    process: object
    conn: object
    started: float
    payload: dict | None = None
    ended: bool = False
    ended_at: float = 0.0
    conn_closed: bool = False
    limit: str = ""  # set when the grader stopped it for a limit
    peak_rss: int = 0
    stopped: bool = False  # killed and joined by _stop: never signalled again (its pid may be reused)


class Session:
    """A warm pool of processes with torch imported, and a place for temporary files.

    Use as a context manager; one session can grade many files.

    ``spares=True`` (for sessions that grade again and again: watch, the server, batches): after
    each run the session forks, in the background, as many rank processes as that run used,
    and the next run hands its specs to them instead of forking while the clock runs. A spare
    is a plain fork of the pool that has not yet received anything: it imports the learner's
    file, sets its environment and joins its group only once its spec arrives, as any rank does.
    """

    def __init__(self, limits: dict | None = None, start_method: str | None = None, spares: bool = False):
        bound_name_lookups()
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        self.ctx = _context(start_method)
        self.tmp = tempfile.mkdtemp(prefix="ddp-grade-")
        self.marker = uuid.uuid4().hex
        # Every rank holds this file open, and so does everything it starts (forks inherit the
        # descriptor): a process forked from the pool does not show the marker variable in
        # /proc/PID/environ, which holds the environment at exec, so the open file is what finds it.
        self.marker_file = os.path.join(self.tmp, "marker")
        open(self.marker_file, "w").close()
        self._runs = 0
        self._keep_spares = spares
        self._spares: list[tuple[object, object]] = []  # (process, pipe end), oldest first
        self._spares_wanted = 0
        self._spare_lock = threading.Lock()
        self._refill: threading.Thread | None = None
        self._closed = False

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._refill is not None:
            self._refill.join(timeout=30)
        with self._spare_lock:
            spares, self._spares = self._spares, []
        _retire(spares)
        reap_strays(self.marker, marker_file=self.marker_file)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def new_run_dir(self) -> str:
        self._runs += 1
        path = os.path.join(self.tmp, f"run{self._runs}")
        os.makedirs(path)
        return path

    def run(
        self,
        driver: str,
        world_size: int,
        *,
        learner_path: str,
        timeout_s: float,
        backend: str = "gloo",
        kwargs: dict | None = None,
        env: dict | None = None,
        grace_s: float = GRACE_AFTER_FAILURE_S,
    ) -> WorldOutcome:
        """Run ``driver`` (``"module:function"``) in ``world_size`` fresh rank processes."""
        return self.run_many([World(driver, world_size, kwargs, env)], learner_path=learner_path,
                             timeout_s=timeout_s, backend=backend, grace_s=grace_s)[0]

    def run_many(self, worlds: list[World], *, learner_path: str, timeout_s: float, backend: str = "gloo",
                 grace_s: float = GRACE_AFTER_FAILURE_S, last_read_on_failure: list[bool] | None = None
                 ) -> list[WorldOutcome]:
        """Run several independent worlds at the same time, under one deadline; outcomes in order.

        Each world has its own store, folder and grace period after a failure: one world's
        failure stops none of the others; each outcome's ``seconds`` and ``stray_processes`` are
        those of the whole call. ``last_read_on_failure[k]``: when world k ends with a failed
        rank, the caller reads no outcome after it, so the worlds after it are stopped at once
        (their ranks show as ``killed``) instead of running on to their end or the deadline.
        """
        from torch.distributed import TCPStore

        started = time.monotonic()
        stores, run_dirs, groups = [], [], []
        try:
            for world in worlds:
                run_dir = self.new_run_dir()
                # This process holds the rendezvous port for the whole run; every rank,
                # rank 0 included, connects to it as a client.
                store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                stores.append(store)
                run_dirs.append(run_dir)
                ranks: list[_Rank] = []
                groups.append(ranks)
                for rank in range(world.world_size):
                    spec = self._spec(world.driver, rank, world.world_size, learner_path, run_dir, timeout_s,
                                      backend, world.kwargs, _rendezvous_env(store.port, world.env))
                    ranks.append(self._start(spec))
            timed_out = _wait_all(groups, started + timeout_s, grace_s, self.limits, last_read_on_failure)
        finally:
            _stop([r for ranks in groups for r in ranks])
            stores.clear()
        strays = reap_strays(self.marker, marker_file=self.marker_file)
        seconds = time.monotonic() - started
        self._fork_spares(sum(world.world_size for world in worlds))
        return [WorldOutcome(world.world_size, _blame([_outcome(r, run_dir, self.limits) for r in ranks]),
                             late, seconds, run_dir, strays)
                for world, ranks, run_dir, late in zip(worlds, groups, run_dirs, timed_out)]

    def worker(self, driver: str, *, learner_path: str, timeout_s: float, kwargs: dict | None = None,
               backend: str = "gloo") -> "Worker":
        """One process that answers calls (for exercises without a process group)."""
        run_dir = self.new_run_dir()
        spec = self._spec(driver, 0, 1, learner_path, run_dir, timeout_s, backend, kwargs, {})
        return Worker(self, self._start(spec), run_dir, time.monotonic() + timeout_s)

    def _spec(self, driver, rank, world_size, learner_path, run_dir, timeout_s, backend, kwargs, env) -> dict:
        return {
            "driver": driver,
            "rank": rank,
            "world_size": world_size,
            "learner_path": os.path.abspath(learner_path),
            "run_dir": run_dir,
            "timeout_s": timeout_s,
            "backend": backend,
            "kwargs": kwargs or {},
            "env": {**_platform_env(), **(env or {}), RUN_MARKER: self.marker},
            "marker_file": self.marker_file,
            "limits": self.limits,
        }

    def spare_pids(self) -> list[int]:
        """The processes forked ahead of need that are waiting now (none unless ``spares=True``)."""
        with self._spare_lock:
            return [process.pid for process, _ in self._spares]

    def _start(self, spec: dict) -> _Rank:
        """A rank running ``spec``: a spare when one is left, else a process forked now."""
        message = pickle.dumps(spec)
        while True:
            spare = self._take_spare()
            process, conn = spare or self._fork()
            try:
                conn.send_bytes(message)
                return _Rank(spec["rank"], process, conn, time.monotonic())
            except OSError:  # a spare that died while it waited: retire it and take another
                if spare is None:
                    raise
                _retire([spare])

    def _fork(self) -> tuple[object, object]:
        """A new process from the pool, waiting for its spec on the pipe returned with it."""
        from grader import child

        parent_end, child_end = self.ctx.Pipe(duplex=True)
        # Not a daemon: a rank may start processes of its own (exercise 04 spawns);
        # every rank is killed with its process group at the end of the run anyway.
        process = self.ctx.Process(target=child.serve, args=(child_end,), daemon=False, name="ddp-grade-rank")
        with _hidden_main():
            process.start()
        child_end.close()
        return process, parent_end

    def _take_spare(self) -> tuple[object, object] | None:
        with self._spare_lock:
            while self._spares:
                spare = self._spares.pop(0)
                if spare[0].is_alive():
                    return spare
                _retire([spare])
        return None

    def _fork_spares(self, count: int) -> None:
        """In the background, fork spares until ``count`` (at most MAX_SPARES) are waiting."""
        if not self._keep_spares or self._closed:
            return
        with self._spare_lock:
            self._spares_wanted = min(MAX_SPARES, max(self._spares_wanted, count))
            if self._refill is not None and self._refill.is_alive():
                return  # the running refill reads the new count
            self._refill = threading.Thread(target=self._refill_spares, name="ddp-grade spares", daemon=True)
            self._refill.start()

    def _refill_spares(self) -> None:
        while True:
            with self._spare_lock:
                if self._closed or len(self._spares) >= self._spares_wanted:
                    return
            try:
                spare = self._fork()
            except Exception:  # no spares then: runs fork their ranks as they start
                return
            with self._spare_lock:
                if not self._closed:
                    self._spares.append(spare)
                    continue
            _retire([spare])
            return


class Worker:
    """A single child that runs the learner's pure functions on request, under a deadline."""

    def __init__(self, session: Session, rank: _Rank, run_dir: str, deadline: float):
        self.session = session
        self._rank = rank
        self.run_dir = run_dir
        self.deadline = deadline
        self.calls = 0

    def __enter__(self) -> "Worker":
        return self

    @property
    def alive(self) -> bool:
        """False once the child was stopped or ended: a new worker is needed then."""
        return not self._rank.ended

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, name: str, within_s: float | None = None, **kwargs) -> dict:
        """Ask the child to run handler ``name``; returns its reply ``{"status", "result"|"error"}``.

        Raises :class:`WorkerTimeout` past the deadline (or ``within_s`` from now, if sooner;
        either way the child is stopped) and :class:`WorkerDied` when the child ends without
        answering.
        """
        self.calls += 1
        r = self._rank
        conn = r.conn
        deadline = self.deadline if within_s is None else min(self.deadline, time.monotonic() + within_s)
        try:
            conn.send_bytes(pickle.dumps((name, kwargs)))
        except (BrokenPipeError, OSError):
            raise WorkerDied(self._finish())
        memory = self.session.limits.get("memory_bytes") or 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(self._finish(kill=True))
            step = min(remaining, _limits.MEMORY_POLL_S) if memory else remaining
            ready = multiprocessing.connection.wait([conn, r.process.sentinel], timeout=step)
            if conn in ready:
                try:
                    return _load(_recv(conn, deadline))
                except TimeoutError:
                    raise WorkerTimeout(self._finish(kill=True)) from None
                except (EOFError, OSError):
                    raise WorkerDied(self._finish()) from None
            if ready:
                raise WorkerDied(self._finish())
            if memory and _over_memory(r, memory):
                raise WorkerDied(self._finish())

    def close(self) -> None:
        if not self._rank.ended:
            try:
                self._rank.conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
            self._rank.process.join(timeout=2)
            self._finish(kill=True)
        self.session._fork_spares(1)

    def _finish(self, kill: bool = False) -> RankOutcome:
        if kill and self._rank.process.is_alive():
            _dump_stacks([self._rank])
            _kill(self._rank.process)
        self._rank.process.join(timeout=5)
        self._rank.ended = True
        reap_strays(self.session.marker, marker_file=self.session.marker_file)
        return _outcome(self._rank, self.run_dir, self.session.limits)


class WorkerTimeout(Exception):
    def __init__(self, outcome: RankOutcome):
        super().__init__("the worker ran past its deadline")
        self.outcome = outcome


class WorkerDied(Exception):
    def __init__(self, outcome: RankOutcome):
        super().__init__("the worker ended without answering")
        self.outcome = outcome


# --- waiting and stopping ---------------------------------------------------------


def _wait_all(groups: list[list[_Rank]], deadline: float, grace_s: float,
              limits: dict | None = None, last_read_on_failure: list[bool] | None = None) -> list[bool]:
    """Collect messages and exits until every rank of every group is done.

    A group is one world: once one of its ranks has failed, the others get ``grace_s`` more
    (the other groups are not affected, except the groups after one that
    ``last_read_on_failure`` marks: they are stopped when it ends with a failure). A group
    that is done is stopped at once, so what is left of it uses no CPU or memory while the
    others run. Returns, per group, True if the deadline hit first.
    """
    last_read = last_read_on_failure or [False] * len(groups)
    memory = (limits or {}).get("memory_bytes") or 0
    grace_until: list[float | None] = [None] * len(groups)  # per group, set once a rank has failed
    timed_out = [False] * len(groups)
    done = [False] * len(groups)
    while True:
        now = time.monotonic()
        finished = []
        for k, ranks in enumerate(groups):
            if done[k]:
                continue
            if all(r.ended for r in ranks):
                done[k] = True
            elif grace_until[k] is not None and now >= grace_until[k] and grace_until[k] < deadline:
                done[k] = True
                finished.append(k)
            elif now >= deadline:
                done[k] = timed_out[k] = True
                finished.append(k)
        for k, ranks in enumerate(groups):  # nobody reads the worlds after a failed one that is read last
            if done[k] and last_read[k] and not timed_out[k] and any(_failed(r) for r in ranks):
                for j in range(k + 1, len(groups)):
                    if not done[j]:
                        done[j] = True
                        finished.append(j)
        if finished:  # together: one wait for the stacks, however many groups ended here
            _stop([r for k in finished for r in groups[k]])
        if all(done):
            return timed_out
        stop_at = min([deadline] + [g for k, g in enumerate(grace_until) if g is not None and not done[k]])
        waitables = {}
        for k, ranks in enumerate(groups):
            if done[k]:
                continue
            for r in ranks:
                if r.ended:
                    continue
                if r.payload is None and not r.conn_closed:
                    waitables[r.conn] = r
                waitables[r.process.sentinel] = r
        step = max(0.0, stop_at - now)
        if memory:
            step = min(step, _limits.MEMORY_POLL_S)
        ready = multiprocessing.connection.wait(list(waitables), timeout=step)
        for handle in ready:
            r = waitables[handle]
            if handle is r.conn:
                r.payload = _receive(r.conn, deadline)
                r.conn_closed = r.payload is None  # closed without a message
            else:
                if r.payload is None and not r.conn_closed:  # it may have arrived with the exit
                    r.payload = _receive(r.conn, min(deadline, time.monotonic() + 5), block=False)
                r.ended = True
                r.ended_at = time.monotonic()
        for k, ranks in enumerate(groups):
            if done[k]:
                continue
            if memory:
                for r in ranks:
                    if not r.ended and _over_memory(r, memory):
                        r.ended, r.ended_at = True, time.monotonic()
            if grace_until[k] is None and any(_failed(r) for r in ranks):
                grace_until[k] = time.monotonic() + grace_s


def _failed(r: _Rank) -> bool:
    if r.payload is not None:
        return r.payload.get("status") != "ok"
    return r.ended


def _over_memory(r: _Rank, limit: int) -> bool:
    """Stop rank ``r`` (and its process group) when its resident memory is over ``limit``."""
    rss = resident_bytes(r.process.pid)
    r.peak_rss = max(r.peak_rss, rss)
    if rss <= limit:
        return False
    r.limit = "memory"
    _kill(r.process)
    r.process.join(timeout=5)
    return True


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


def _receive(conn, deadline: float, block: bool = True) -> dict | None:
    try:
        if not block and not conn.poll(0.2):
            return None
        return _load(_recv(conn, deadline))
    except (EOFError, OSError):
        return None
    except Exception as exc:  # an unreadable message counts as an error of that rank
        return {"status": "error", "error": {"type": type(exc).__name__, "message":
                f"the grader could not read this rank's report: {exc}", "traceback": "", "where": None,
                "phase": "run"}}


def _load(data: bytes) -> dict:
    from grader import wire

    payload = wire.loads(data)
    if not isinstance(payload, dict):
        raise ValueError("malformed report")
    return payload


def _stop(ranks: list[_Rank]) -> None:
    """Ask every live rank for its stack, then kill it and everything it started (once per rank)."""
    ranks = [r for r in ranks if not r.stopped]
    live = [r for r in ranks if r.process.is_alive()]
    if live:
        _dump_stacks(live)
    for r in ranks:
        _kill(r.process)
    for r in ranks:
        r.process.join(timeout=5)
        r.conn.close()
        r.stopped = True


def _retire(spares: list[tuple[object, object]]) -> None:
    """End spares that were never used: each ends when its pipe closes, or is killed."""
    for _, conn in spares:
        conn.close()
    for process, _ in spares:
        process.join(timeout=2)
        if process.is_alive():
            _kill(process)
            process.join(timeout=5)


def _dump_stacks(ranks: list[_Rank]) -> None:
    for r in ranks:
        try:
            os.kill(r.process.pid, signal.SIGUSR1)
        except (OSError, TypeError):
            pass
    time.sleep(STACK_WAIT_S)


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


def _outcome(r: _Rank, run_dir: str, limits: dict | None = None) -> RankOutcome:
    payload = r.payload
    ended_at = r.ended_at or time.monotonic()
    limits = limits or {}
    common = dict(
        rank=r.rank,
        exitcode=r.process.exitcode,
        stack=_read(os.path.join(run_dir, f"rank{r.rank}.stack")),
        output=_tail(os.path.join(run_dir, f"rank{r.rank}.out")),
        seconds=ended_at - r.started,
    )
    if payload is not None and payload.get("status") == "ok":
        return RankOutcome(status="ok", result=payload.get("result"), **common)
    failed_at = ((payload or {}).get("error") or {}).get("at")
    if isinstance(failed_at, float) and r.started <= failed_at <= ended_at:
        common["seconds"] = failed_at - r.started  # when it raised, not when we noticed
    limit = _which_limit(r, payload, limits)
    if limit:
        common.update(limit=limit, limit_detail=_limits.describe(limit, limits))
    if payload is not None:
        return RankOutcome(status="error", error=payload.get("error") or {}, **common)
    if r.ended or limit:
        return RankOutcome(status="exited", **common)
    return RankOutcome(status="killed", **common)


# What a rank raises when a peer it talks to has died: a consequence, not a cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _blame(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """A rank that only lost a failed peer is marked stopped (``killed``), so the cause is named.

    When rank 1 crashes, rank 0's next collective raises "Connection closed by
    peer"; that error stays in ``error`` (and its details), but the rank that
    crashed, exited or raised something else is the failure to report.
    """
    def peer_lost(o: RankOutcome) -> bool:
        message = str((o.error or {}).get("message", ""))
        return o.status == "error" and any(p in message for p in PEER_LOST)

    causes = [o for o in outcomes if o.status in ("error", "exited") and not peer_lost(o)]
    if causes:
        for o in outcomes:
            if peer_lost(o):
                o.status = "killed"
    return outcomes


def _which_limit(r: _Rank, payload: dict | None, limits: dict) -> str:
    """"memory", "cpu", "output", "tmp" or "": the limit this failed rank ran into, from what was seen."""
    if r.limit:
        return r.limit
    if r.process.exitcode == -getattr(signal, "SIGXCPU", -1000) and limits.get("cpu_seconds"):
        return "cpu"
    err = (payload or {}).get("error") or {}
    text = f"{err.get('type')}: {err.get('message')}"
    if limits.get("memory_bytes") and (err.get("type") == "MemoryError" or "can't allocate memory" in text
                                        or "std::bad_alloc" in text):
        return "memory"
    if limits.get("output_bytes") and ("File too large" in text or
                                       r.process.exitcode == -getattr(signal, "SIGXFSZ", -1000)):
        return "output"
    if "No space left on device" in text and _limits.in_sandbox():
        return "tmp"
    return ""


def _read(path: str, limit: int = 20000) -> str:
    try:
        with open(path, "r", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""


def _tail(path: str, chars: int = OUTPUT_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    if size > chars:
        text = f"[... {size - chars} earlier bytes not shown]\n" + text.split("\n", 1)[-1]
    return text


# --- environment ---------------------------------------------------------------------


def _default_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


# The rank side of this layer, and a module it imports when it sets limits; warm_up(modules=...)
# adds the caller's.
PRELOAD = ["grader.child", "resource"]
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
