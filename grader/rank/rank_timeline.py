"""In a rank: what it did over time, on its own clock, for the report's timeline.

:func:`recording` (or the :func:`traced` decorator on a driver) wraps, for the length of a
driver's work, the calls whose time a timeline shows:

* every collective and point-to-point call of ``torch.distributed`` and of its functional
  collectives, with its bytes and peer (only the outermost: torch's ``send`` is built on
  ``isend``), and each wait on an asynchronous one (``Work.wait``);
* the phases where they can be seen from Python: each outermost module forward (torch's global
  module hooks), each call of ``backward`` (``Tensor.backward``, ``torch.autograd.backward`` and
  ``.grad``), each optimizer step (torch's global optimizer hooks) and each ``torch.save``;
* what a driver marks itself: :meth:`Recorder.region` (e.g. one schedule of a run),
  :func:`label` (e.g. "F3", the micro-batch the forward now running belongs to) and
  :func:`by_grader` (the driver's own collectives, e.g. its checks' agreement between ranks).

With ``flush_to`` (:func:`traced` gives ``rank{r}.timeline`` in the run's folder) each event is also
written to a file as it ends, and each blocking call as it starts, so that the grader can draw a run
it had to stop (a timeout, a crash) up to that moment, each rank's call still under way marked.

Each becomes a plain dict, its start and end read from ``time.monotonic()``: one clock for every
process of the machine, so that the grader can lay the ranks side by side. A driver returns
:meth:`Recorder.snapshot` in its result, under ``"timeline"``. The learner's code runs in this
process and may change anything here: the grader reads the snapshot as untrusted data
(:mod:`grader.timeline`), never as evidence for a verdict. Nothing here holds a tensor.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import threading
import time

MAX_EVENTS = 3000  # per rank and run; later events are counted, not kept
FLUSH_BYTES = 1 << 20  # of the file a rank's events also go to (its lines end where the zeros begin)
_LOCK = threading.Lock()
_ACTIVE: list["Recorder"] = []


class Recorder:
    """The events of one rank, in the order they ended."""

    def __init__(self, path: str | None = None):
        self.events: list[dict] = []
        self.dropped = 0
        # The file each event also goes to as it ends, and each blocking call as it starts (see flush_to): mapped
        # into memory (MAP_SHARED), so that a line costs a copy, no system call, and what was copied is in the
        # file even when the process is killed the next moment.
        self._map = None
        self._at = 0
        self._calls = 0
        if path is not None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    # Its blocks taken now (never a SIGBUS on a page a full /tmp could not give later); where
                    # they cannot be, there is no file and the events stay in memory only.
                    os.posix_fallocate(fd, 0, FLUSH_BYTES)
                    self._map = mmap.mmap(fd, FLUSH_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                self._path = path
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._local = threading.local()
        self._threads: dict[int, int] = {}
        self._issued: dict[int, str] = {}  # id(Work) -> the op that returned it (ids may be reused: a name only)

    # --- per thread -------------------------------------------------------------------------------------

    def _state(self):
        local = self._local
        if not hasattr(local, "comm"):
            local.comm = 0  # communication calls open on this thread
            local.phases = []  # open phase spans on this thread (None: a nested one, not recorded)
            local.grader = 0  # blocks of the grader's own calls open on this thread (see by_grader)
        return local

    def _thread(self) -> int:
        ident = threading.get_ident()
        with _LOCK:
            return self._threads.setdefault(ident, len(self._threads))

    def add(self, kind: str, op: str, t0: float, t1: float, **info) -> None:
        event = {"kind": kind, "op": op, "t0": t0, "t1": t1, "thread": self._thread(), **info}
        if self._state().grader:
            event["by"] = "grader"
        with _LOCK:
            if len(self.events) >= MAX_EVENTS:
                self.dropped += 1
            else:
                self.events.append(event)
        self._write(event)

    def _write(self, entry: dict) -> None:
        """One line in the file (when there is one): what the grader reads of a run it had to stop."""
        if self._map is None:
            return
        try:
            line = (json.dumps(entry) + "\n").encode()
        except (TypeError, ValueError):
            return
        with _LOCK:
            end = self._at + len(line)
            if end > FLUSH_BYTES:  # full: later events stay in memory only
                return
            self._map[self._at:end] = line
            self._at = end

    def _opened(self, kind: str, op: str, t0: float, **info) -> int:
        """A blocking call starting: noted in the file at once, so that a run stopped inside it shows where each
        rank waited. Returns the call's number, which the event that ends it carries as ``call``."""
        self._calls += 1
        if self._map is not None:
            entry = {"kind": kind, "op": op, "t0": t0, "t1": t0, "open": True, "call": self._calls,
                     "thread": self._thread(), **{k: v for k, v in info.items() if v is not None}}
            if self._state().grader:
                entry["by"] = "grader"
            self._write(entry)
        return self._calls

    def close(self) -> None:
        """The file cut to what was written, the mapping released."""
        if self._map is not None:
            with contextlib.suppress(OSError, ValueError):
                self._map.close()
            with contextlib.suppress(OSError):
                os.truncate(self._path, self._at)
            self._map = None

    # --- what drivers mark --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, name: str):
        """Mark the block as one region of the run (a schedule, a scenario): drawn as its own part."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add("region", "region", t0, time.monotonic(), label=str(name))

    def label(self, text: str) -> None:
        """Name the outermost phase open on this thread (e.g. the forward now running is micro-batch 3's)."""
        phases = self._state().phases
        if phases and phases[0] is not None:
            phases[0]["label"] = str(text)

    # --- phases ---------------------------------------------------------------------------------------------

    def _open_phase(self, kind: str, op: str, label: str = "") -> None:
        phases = self._state().phases
        phases.append({"kind": kind, "op": op, "t0": time.monotonic(), "label": label} if not phases else None)

    def _close_phase(self) -> None:
        phases = self._state().phases
        if not phases:
            return
        span = phases.pop()
        if span is not None:
            self.add(span["kind"], span["op"], span["t0"], time.monotonic(), label=span["label"])

    @contextlib.contextmanager
    def _phase(self, kind: str, op: str, label: str = ""):
        self._open_phase(kind, op, label)
        try:
            yield
        finally:
            self._close_phase()

    # --- the snapshot a driver returns ---------------------------------------------------------------

    def snapshot(self) -> dict:
        with _LOCK:
            return {"events": [dict(e) for e in self.events], "dropped": self.dropped}


def label(text: str) -> None:
    """Name the outermost phase open on this thread, in every recording now on (nothing when none is)."""
    for recorder in list(_ACTIVE):
        recorder.label(text)


def current() -> Recorder | None:
    return _ACTIVE[-1] if _ACTIVE else None


def phase(kind: str, label: str = ""):
    """``with phase("forward", "F3"):`` records the block as one phase (when it is the outermost one open on
    this thread), in the recording now on (if any); a driver uses it where no module call marks the phase."""
    recorder = current()
    return recorder._phase(kind, kind, label) if recorder is not None else contextlib.nullcontext()


def by_grader():
    """``with by_grader():`` the calls in the block are the grader's own, not the learner's (its checks'
    agreement between ranks, its barriers): marked ``"by": "grader"``, drawn apart and left out of the
    learner's counts. Only a drawing reads the mark; no verdict does."""
    recorders = list(_ACTIVE)
    return _grader_block(recorders) if recorders else contextlib.nullcontext()


@contextlib.contextmanager
def _grader_block(recorders: list[Recorder]):
    states = [r._state() for r in recorders]
    for state in states:
        state.grader += 1
    try:
        yield
    finally:
        for state in states:
            state.grader -= 1


def region(name: str):
    """``with region("gpipe"):`` marks the block as one region of the run in the recording now on (if any)."""
    recorder = current()
    return recorder.region(name) if recorder is not None else contextlib.nullcontext()


def flush_name(rank: int) -> str:
    """The file in the run's folder where rank ``rank``'s events also go as they happen (one JSON line each, a
    blocking call noted as it starts with ``"open": true``): the grader reads it when it had to stop the run."""
    return f"rank{rank}.timeline"


@contextlib.contextmanager
def recording(flush_to: str | None = None):
    """Record this rank's calls (see the module's docstring) until the block ends; yields the Recorder.
    ``flush_to``: a file each event is also written to as it ends, each blocking call as it starts."""
    recorder = Recorder(flush_to)
    with contextlib.ExitStack() as stack:
        stack.callback(recorder.close)
        _install_communication(recorder, stack)
        _install_phases(recorder, stack)
        _ACTIVE.append(recorder)
        stack.callback(_ACTIVE.remove, recorder)
        yield recorder


def traced(driver):
    """A driver recorded whole: its dict result gains ``"timeline"`` (:meth:`Recorder.snapshot`)."""

    @functools.wraps(driver)
    def run(ctx):
        run_dir, rank = getattr(ctx, "run_dir", None), getattr(ctx, "rank", None)
        path = os.path.join(run_dir, flush_name(rank)) if isinstance(run_dir, str) and isinstance(rank, int) else None
        with recording(path) as recorder:
            result = driver(ctx)
        if isinstance(result, dict) and "timeline" not in result:
            result = {**result, "timeline": recorder.snapshot()}
        return result

    return run


# --- communication ------------------------------------------------------------------------------------


def _install_communication(recorder: Recorder, stack: contextlib.ExitStack) -> None:
    import inspect

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    from grader.rank import probes

    def wrap(name: str, original):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None
        kind = ("send" if name in ("send", "isend") else "recv") if name in probes.POINT_TO_POINT else "collective"

        def observed(*args, **kwargs):
            state = recorder._state()
            if state.comm:
                return original(*args, **kwargs)
            try:
                info = probes._describe_call(name, signature, args, kwargs)
            except Exception:
                info = {"bytes": None, "peer": None, "async_op": False}
            state.comm += 1
            t0 = time.monotonic()
            call = recorder._opened(kind, name, t0, bytes=info.get("bytes"), peer=info.get("peer"))
            try:
                result = original(*args, **kwargs)
            finally:
                state.comm -= 1
                recorder.add(kind, name, t0, time.monotonic(), bytes=info.get("bytes"), peer=info.get("peer"),
                             dtype=info.get("dtype"), call=call, **{"async": bool(info.get("async_op"))})
            if result is not None and not isinstance(result, (list, tuple)):
                recorder._issued[id(result)] = name
            return result

        observed.__name__ = name
        observed.__wrapped__ = original
        return observed

    for name in probes.COLLECTIVES + probes.POINT_TO_POINT:
        if hasattr(c10d, name):
            replacement = wrap(name, getattr(c10d, name))
            stack.enter_context(_patched(c10d, name, replacement))
            if hasattr(dist, name):
                stack.enter_context(_patched(dist, name, replacement))
    for name, op in probes.FUNCTIONAL_COLLECTIVES.items():
        if hasattr(funcol, name):
            stack.enter_context(_patched(funcol, name, wrap(op, getattr(funcol, name))))
    work = getattr(dist, "Work", None)
    if work is not None and hasattr(work, "wait"):
        original_wait = work.wait

        def wait(self, *args, **kwargs):
            state = recorder._state()
            if state.comm:  # a blocking collective waiting on its own work: part of that call
                return original_wait(self, *args, **kwargs)
            state.comm += 1
            t0 = time.monotonic()
            issued = recorder._issued.get(id(self), "")
            call = recorder._opened("wait", "wait", t0, label=issued)
            try:
                return original_wait(self, *args, **kwargs)
            finally:
                state.comm -= 1
                recorder.add("wait", "wait", t0, time.monotonic(), label=issued, call=call)

        stack.enter_context(_patched(work, "wait", wait))


# --- phases --------------------------------------------------------------------------------------------


def _install_phases(recorder: Recorder, stack: contextlib.ExitStack) -> None:
    import torch
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    def before_forward(module, args):
        recorder._open_phase("forward", "forward", type(module).__name__)

    def after_forward(module, args, output):
        recorder._close_phase()

    stack.callback(module_hooks.register_module_forward_pre_hook(before_forward).remove)
    stack.callback(module_hooks.register_module_forward_hook(after_forward, always_call=True).remove)

    steps = threading.local()

    def before_step(optimizer, args, kwargs):
        steps.started = time.monotonic()

    def after_step(optimizer, args, kwargs):
        t0 = getattr(steps, "started", None)
        if t0 is not None:
            recorder.add("step", "step", t0, time.monotonic(), label=type(optimizer).__name__)
            steps.started = None

    stack.callback(optimizer_hooks.register_optimizer_step_pre_hook(before_step).remove)
    stack.callback(optimizer_hooks.register_optimizer_step_post_hook(after_step).remove)

    def phase_of(kind: str, op: str, original, what=None):
        @functools.wraps(original)
        def observed(*args, **kwargs):
            with recorder._phase(kind, op, what(args, kwargs) if what else ""):
                return original(*args, **kwargs)
        return observed

    stack.enter_context(_patched(torch.Tensor, "backward", phase_of("backward", "backward", torch.Tensor.backward)))
    stack.enter_context(_patched(torch.autograd, "backward",
                                 phase_of("backward", "backward", torch.autograd.backward)))
    stack.enter_context(_patched(torch.autograd, "grad", phase_of("backward", "grad", torch.autograd.grad)))

    def saved_to(args, kwargs) -> str:
        import os

        target = args[1] if len(args) > 1 else kwargs.get("f")
        return os.path.basename(os.fspath(target)) if isinstance(target, (str, os.PathLike)) else ""

    save = phase_of("save", "torch.save", torch.save, saved_to)
    stack.enter_context(_patched(torch, "save", save))
    stack.enter_context(_patched(torch.serialization, "save", save))


@contextlib.contextmanager
def _patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, original)
