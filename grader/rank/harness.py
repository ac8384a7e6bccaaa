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
* a rank over its memory limit is stopped (see :mod:`grader.rank.limits`), and
  every process that still carries the run's marker afterwards is killed.

Nothing here waits without a deadline: messages from ranks are read with one
too, so a rank that sends half a message cannot stall the grader.

Nothing here decides whether an exercise passed: that is the checks' job, in
this process, from the :class:`WorldOutcome` returned.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import contextlib
import pickle
import signal
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

from grader.rank import limits as _limits
from grader.rank.outcomes import PEER_LOST, RankOutcome, WorldOutcome, _blame  # noqa: F401
from grader.rank.processes import (MAX_MESSAGE_BYTES, OUTPUT_TAIL_CHARS, REAP_PASSES, RESOLVER_OPTIONS,  # noqa: F401
                              RUN_MARKER, _context, _hidden_main, _kill, _load, _platform_env, _read, _receive,
                              _recv, _rendezvous_env, _tail, bound_name_lookups, descendants, marked_processes,
                              reap_strays, remove_folder, resident_bytes, start_in_pool, stop_pool, unreadable, warm_up)

TREE_POLL_EVERY = 2  # every second memory reading also reads the processes a rank started
GRACE_AFTER_FAILURE_S = 3.0  # how long other ranks may run on after one failed
STACK_WAIT_S = 0.5  # how long a rank gets to write its stack before it is killed

DEFAULT_LIMITS = dict(_limits.DEFAULT_LIMITS)  # see grader.rank.limits; a Session takes GradeOptions.limits
MAX_SPARES = 8  # rank processes a session with spares keeps forked ahead of its next run


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
    polls: int = 0  # memory readings so far
    limit_by: int = 0  # the pid of a process under the rank that went over the memory limit


class Session:
    """A warm pool of processes with torch imported, and a place for temporary files.

    Use as a context manager; one session can grade many files.

    ``spares=True`` (for sessions that grade again and again: watch, the server, batches): after
    each run the session forks, in the background, as many rank processes as that run used,
    and the next run hands its specs to them instead of forking while the clock runs. A spare
    is a plain fork of the pool that has not yet received anything: it imports the learner's
    file, sets its environment and joins its group only once its spec arrives, as any rank does.
    """

    def __init__(self, limits: dict | None = None, start_method: str | None = None, spares: bool = False,
                 tmp: str | None = None):
        from grader.rank import untrusted

        bound_name_lookups()
        self.limits = {**DEFAULT_LIMITS, **(limits or {})}
        self.ctx = _context(start_method)
        # ``tmp``: a folder made for this session by whoever starts it (the rank host in a sandbox is
        # given the folder the grader outside reads); removed on close either way.
        self.tmp = tmp or tempfile.mkdtemp(prefix="ddp-grade-")
        untrusted.trust_folder(self.tmp)
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
        remove_folder(self.tmp)

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
                 grace_s: float = GRACE_AFTER_FAILURE_S, last_read_on_failure: list[bool] | None = None,
                 on_started=None) -> list[WorldOutcome]:
        """Run several independent worlds at the same time, under one deadline; outcomes in order.

        Each world has its own store, folder and grace period after a failure: one world's
        failure stops none of the others; each outcome's ``seconds`` and ``stray_processes`` are
        those of the whole call. ``last_read_on_failure[k]``: when world k ends with a failed
        rank, the caller reads no outcome after it, so the worlds after it are stopped at once
        (their ranks show as ``killed``) instead of running on to their end or the deadline.
        ``on_started()`` is called once every rank has been handed its spec (the deadline starts then).
        """
        started = time.monotonic()
        start_s = 0.0
        stores, run_dirs, groups = [], [], []
        try:
            with _interrupt_deferred():  # every rank handed its spec is in ``groups``, for _stop below
                self._hand_out(worlds, groups, stores, run_dirs, learner_path, timeout_s, backend)
            # The deadline counts from here: starting the ranks (on a cold pool, waiting for it to
            # import torch and the checks) is the grader's time, not the submission's.
            start_s = time.monotonic() - started
            if on_started is not None:
                on_started()
            timed_out = _wait_all(groups, started + start_s + timeout_s, grace_s, self.limits,
                                  last_read_on_failure)
        finally:
            _stop([r for ranks in groups for r in ranks])
            stores.clear()
        strays = reap_strays(self.marker, marker_file=self.marker_file)
        seconds = time.monotonic() - started
        self._fork_spares(sum(world.world_size for world in worlds))
        return [WorldOutcome(world.world_size, _blame([_outcome(r, run_dir, self.limits) for r in ranks]),
                             late, seconds, run_dir, strays, start_s)
                for world, ranks, run_dir, late in zip(worlds, groups, run_dirs, timed_out)]

    def _hand_out(self, worlds, groups, stores, run_dirs, learner_path, timeout_s, backend) -> None:
        """Start every rank of ``worlds``, each registered in ``groups`` as soon as it has its spec."""
        from torch.distributed import TCPStore

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
        from grader.rank import child

        parent_end, child_end = self.ctx.Pipe(duplex=True)
        # Not a daemon: a rank may start processes of its own (exercise 04 spawns);
        # every rank is killed with its process group at the end of the run anyway.
        process = start_in_pool(lambda: self.ctx.Process(target=child.serve, args=(child_end,), daemon=False,
                                                         name="ddp-grade-rank"))
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


@contextlib.contextmanager
def _interrupt_deferred():
    """Ctrl-C (SIGINT as KeyboardInterrupt) held back until the block ends, then raised: a rank handed its
    spec but not yet registered, or a fork from the warm pool cut half-way, would be left running. Only in
    the main thread, and only where SIGINT raises KeyboardInterrupt (Python's own handler)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


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
                    return _load(_recv(conn, deadline))  # within a budget of its own
                except TimeoutError:
                    raise WorkerTimeout(self._finish(kill=True)) from None
                except (EOFError, OSError):
                    raise WorkerDied(self._finish()) from None
                except ValueError as exc:  # too large, not data, over the budget: that process's error
                    return unreadable(exc)
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
    from grader.rank import wire

    last_read = last_read_on_failure or [False] * len(groups)
    memory = (limits or {}).get("memory_bytes") or 0
    budget = wire.Budget()  # what the ranks of all these groups may send together
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
                r.payload = _receive(r.conn, deadline, budget=budget)
                r.conn_closed = r.payload is None  # closed without a message
            else:
                if r.payload is None and not r.conn_closed:  # it may have arrived with the exit
                    r.payload = _receive(r.conn, min(deadline, time.monotonic() + 5), block=False, budget=budget)
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
    """Stop rank ``r`` (and its process group) when its resident memory, or that of any process it
    started (the processes under it, read every TREE_POLL_EVERY polls), is over ``limit``."""
    rss = resident_bytes(r.process.pid)
    r.peak_rss = max(r.peak_rss, rss)
    over = rss > limit
    r.polls += 1
    if not over and r.polls % TREE_POLL_EVERY == 0:
        for pid in descendants(r.process.pid):
            if resident_bytes(pid) > limit:
                over = True
                r.limit_by = pid
                break
    if not over:
        return False
    r.limit = "memory"
    if r.limit_by:
        with contextlib.suppress(OSError):
            os.kill(r.limit_by, signal.SIGKILL)
    _kill(r.process)
    r.process.join(timeout=5)
    return True


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


def _outcome(r: _Rank, run_dir: str, limits: dict | None = None) -> RankOutcome:
    payload = r.payload
    ended_at = r.ended_at or time.monotonic()
    limits = limits or {}
    common = dict(
        rank=r.rank, pid=r.process.pid, exitcode=r.process.exitcode,
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


# --- environment ---------------------------------------------------------------------


