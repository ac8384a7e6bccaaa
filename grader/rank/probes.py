"""Instruments installed in a rank process before the learner's file is imported.

Each probe wraps a torch function so that a call is recorded as plain data
(then passed through unchanged, unless the probe must stop a call that would
hang). Drivers return the records to the parent, where the checks decide.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from grader.rank.child import GraderAbort, rendezvous_target


@contextlib.contextmanager
def patched(owner, name: str, replacement):
    """Replace ``owner.name`` for the duration of the block."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, original)


def torchrun_environment(rank: int, world_size: int) -> None:
    """Set the variables torchrun sets in each process it starts (one machine), for this rank.

    For the exercises whose processes and group the grader provides (05-10): code
    that reads its rank from RANK, or its GPU from LOCAL_RANK, works as under torchrun.
    """
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0"})


@contextlib.contextmanager
def platform_start_method():
    """Processes the learner's code starts (DataLoader workers) start as in a rank torchrun started.

    A rank inherits the grader's forkserver as its default start method; under it
    every DataLoader worker is a fresh interpreter that imports torch again, a
    second or more each time a loader is iterated. Under torchrun the platform's
    own default applies (fork on Linux before Python 3.14), and so it does here.
    """
    import multiprocessing
    import multiprocessing.context

    before = multiprocessing.get_start_method(allow_none=True)
    platform = getattr(multiprocessing.context._default_context, "_default_context", None)
    method = getattr(platform, "_name", None)
    if method is None or method == before:
        yield
        return
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(before, force=True)


def _timeout_seconds(value) -> float | None:
    if value is None:
        return None
    if hasattr(value, "total_seconds"):
        return float(value.total_seconds())
    return float(value)


@contextlib.contextmanager
def watch_init(calls: list, *, expected_port: str | None = None, dry_run: bool = False):
    """Record every ``init_process_group`` call: arguments and the rendezvous it would use.

    ``expected_port``: a call that would meet anywhere else is recorded and
    stopped (raising :class:`GraderAbort`) instead of waiting for peers that
    will never come. ``dry_run``: record and stop every call.
    """
    original = c10d.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                           store=None, *args, **kwargs):
        addr, port = rendezvous_target(init_method, store)
        call = {
            "backend": None if backend is None else str(backend),
            "init_method": init_method,
            "timeout_s": _timeout_seconds(timeout),
            "world_size": int(world_size),
            "rank": int(rank),
            "uses_store": store is not None,
            "master_addr": addr,
            "master_port": port,
        }
        calls.append(call)
        if dry_run:
            raise GraderAbort("init_process_group recorded, not run")
        if expected_port is not None and store is None and port != expected_port:
            raise GraderAbort(f"init_process_group would meet at port {port}, not MASTER_PORT={expected_port}")
        return original(backend, init_method, timeout, world_size, rank, store, *args, **kwargs)

    with patched(c10d, "init_process_group", init_process_group), \
            patched(dist, "init_process_group", init_process_group):
        yield calls


@contextlib.contextmanager
def watch_saves(saves: list):
    """Record every ``torch.save``: the path written and the keys of a dict saved."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        target = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
        saves.append({"path": None if target is None else os.path.abspath(target),
                      "keys": [str(k) for k in obj.keys()] if isinstance(obj, dict) else None})
        return original(obj, f, *args, **kwargs)

    with patched(torch, "save", save), patched(torch.serialization, "save", save):
        yield saves


_WRITE_WATCHERS: list = []  # (records, folder) of every watch_writes now active
_AUDIT_HOOK_ADDED = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _path_of(value) -> str | None:
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fspath(value)
        return os.path.abspath(path.decode(errors="replace") if isinstance(path, bytes) else path)
    return None  # a file descriptor


def _audit(event: str, args: tuple) -> None:
    """Python's audit hook: files opened for writing and renames, under a watched folder."""
    if not _WRITE_WATCHERS or event not in ("open", "os.rename"):
        return
    try:
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                bool(isinstance(flags, int) and flags & _WRITE_FLAGS)
            record = {"op": "open", "path": _path_of(path)} if writing else None
        else:
            record = {"op": "rename", "src": _path_of(args[0]), "path": _path_of(args[1])}
        if record is None or record["path"] is None:
            return
        record["t"] = time.monotonic()
        for records, folder in list(_WRITE_WATCHERS):
            if record["path"].startswith(folder) or (record.get("src") or "").startswith(folder):
                records.append(dict(record))
    except Exception:  # an audit hook that raises would fail the learner's own call
        pass


@contextlib.contextmanager
def watch_writes(records: list, folder: str):
    """Record every file under ``folder`` opened for writing or renamed onto, from any thread.

    Each record: ``{"op": "open" | "rename" | "torch.save", "path", "src" (renames), "t"}``.
    Python's audit events see ``open``, ``os.open``, ``os.rename`` and ``os.replace``
    whoever calls them; ``torch.save`` to a path writes from C++, so it is
    recorded by wrapping it.
    """
    import sys

    global _AUDIT_HOOK_ADDED
    if not _AUDIT_HOOK_ADDED:
        sys.addaudithook(_audit)  # for the rest of this process: audit hooks cannot be removed
        _AUDIT_HOOK_ADDED = True
    entry = (records, os.path.join(os.path.abspath(folder), ""))
    original = torch.save

    def save(obj, f, *args, **kwargs):
        path = _path_of(f) if isinstance(f, (str, os.PathLike)) else None
        if path is not None and path.startswith(entry[1]):
            records.append({"op": "torch.save", "path": path, "t": time.monotonic()})
        return original(obj, f, *args, **kwargs)

    _WRITE_WATCHERS.append(entry)
    try:
        with patched(torch, "save", save), patched(torch.serialization, "save", save):
            yield records
    finally:
        _WRITE_WATCHERS.remove(entry)


def writers_of(path: str, writes: list[list[dict]]) -> dict[int, list[dict]]:
    """From every rank's ``watch_writes`` records: which ranks wrote the file at ``path``, and how.

    Writing counts when it reaches ``path``: writing ``path`` itself, renaming a
    file onto it, or writing a file that was later renamed onto it (by anyone).
    Returns ``{rank: [records]}`` for each rank that did.
    """
    path = os.path.abspath(path)
    feeders, grown = {path}, True
    while grown:
        grown = False
        for records in writes:
            for w in records:
                if w["op"] == "rename" and w["path"] in feeders and w.get("src") and w["src"] not in feeders:
                    feeders.add(w["src"])
                    grown = True
    out: dict[int, list[dict]] = {}
    for rank, records in enumerate(writes):
        mine = [w for w in records if w["path"] in feeders]
        if mine:
            out[rank] = mine
    return out


def describe_write(write: dict, path: str) -> str:
    """One write record in words, for a failure message."""
    name = os.path.basename(write["path"])
    if write["op"] == "rename":
        return f"renamed {os.path.basename(write.get('src') or '?')} onto {name}"
    if write["op"] == "torch.save":
        return f"torch.save to {name}" + ("" if write["path"] == os.path.abspath(path) else
                                          ", which became the checkpoint")
    return f"opened {name} for writing" + ("" if write["path"] == os.path.abspath(path) else
                                           ", which became the checkpoint")


def threads_left_running(grace_s: float) -> list[dict]:
    """Threads that would keep this process from exiting, now that the learner's function returned.

    As at interpreter exit: the callbacks registered with threading's exit hooks
    run first (they stop concurrent.futures' idle workers), then every
    non-daemon thread is waited for, here at most ``grace_s`` in all. Returns
    those still running: ``{"name", "function"}``.
    """
    import threading

    def run_exit_callbacks():
        for callback in list(getattr(threading, "_threading_atexits", ())):
            try:
                callback()
            except Exception:
                pass

    deadline = time.monotonic() + grace_s
    helper = threading.Thread(target=run_exit_callbacks, name="ddp-grade-exit-callbacks", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()))
    left = []
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread is threading.current_thread() or thread.daemon \
                or thread is helper:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            target = getattr(thread, "_target", None)
            left.append({"name": thread.name,
                         "function": getattr(target, "__qualname__", None) or type(thread).__qualname__})
    return left


COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
    "all_gather_single", "reduce_scatter_single",  # torch 2.13's names (the *_tensor ones call them)
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# The names of the collectives that gather and that reduce-scatter, as the events call them.
DISPATCHED_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base")
REDUCE_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")
# torch.distributed._functional_collectives runs collectives without calling the functions above
# (its autograd-aware forms too). Each is recorded under the name of the collective it runs; the
# bytes are those of its input.
FUNCTIONAL_COLLECTIVES = {
    "all_reduce": "all_reduce", "all_reduce_inplace": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_tensor": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
    "all_gather_tensor_autograd": "all_gather_into_tensor", "all_gather_single_autograd": "all_gather_into_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd": "reduce_scatter_tensor",
    "reduce_scatter_single_autograd": "reduce_scatter_tensor",
    "broadcast": "broadcast", "all_to_all_single": "all_to_all_single",
    "all_to_all_single_autograd": "all_to_all_single",
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


_FIRST_ARGUMENT = ("tensor", "tensor_list", "output", "output_tensor", "object_list", "input_tensor")


@contextlib.contextmanager
def watch_collectives(events: list, *, forbid: tuple[str, ...] = ()):
    """Record every collective and point-to-point call made through ``torch.distributed``
    (and its functional collectives).

    Each event: ``{"op", "bytes", "peer", "dtype", "itemsize", "async_op"}`` (``peer`` for send/recv,
    a global rank). Only the outermost call is recorded (torch's ``send`` is
    built on ``isend``, for instance). Calls pass through unchanged. Names in
    ``forbid`` are recorded and then refused with a RuntimeError, so a
    forbidden call cannot also hang.
    """
    import inspect
    import threading

    originals = {}
    depth = threading.local()

    def wrap(name, original):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        def observed(*args, **kwargs):
            if getattr(depth, "value", 0) == 0:
                events.append(_describe_call(name, signature, args, kwargs))
                if name in forbid:
                    raise RuntimeError(f"torch.distributed.{name} is not allowed in this exercise")
            depth.value = getattr(depth, "value", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.value -= 1

        observed.__name__ = name
        observed.__wrapped__ = original
        return observed

    names = [n for n in COLLECTIVES + POINT_TO_POINT if hasattr(c10d, n)]
    for name in names:
        originals[name] = getattr(c10d, name)
        replacement = wrap(name, originals[name])
        setattr(c10d, name, replacement)
        setattr(dist, name, replacement)
    import torch.distributed._functional_collectives as funcol

    functional = {}
    for name, op in FUNCTIONAL_COLLECTIVES.items():
        if hasattr(funcol, name):
            functional[name] = getattr(funcol, name)
            setattr(funcol, name, wrap(op, functional[name]))
    try:
        yield events
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        for name, original in functional.items():
            setattr(funcol, name, original)


def group_ranks(group) -> list[int] | None:
    """The global ranks of a collective's ``group`` argument, in any form torch takes: None (the
    world), a ProcessGroup, a group name, a DeviceMesh, (DeviceMesh, dim) or a list of ranks."""
    import torch.distributed._functional_collectives as funcol

    try:
        if group is None:
            return list(range(dist.get_world_size()))
        if isinstance(group, (list, tuple)) and all(isinstance(r, int) for r in group):
            return sorted(group)
        resolved = funcol._resolve_group(group)
        if isinstance(resolved, str):
            resolved = c10d._resolve_process_group(resolved)
        return sorted(dist.get_process_group_ranks(resolved))
    except Exception:
        return None


def _first_tensor(value):
    if isinstance(value, (list, tuple)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return value if isinstance(value, torch.Tensor) else None


@contextlib.contextmanager
def watch_groups(events: list):
    """Record every collective made through torch.distributed, its functional collectives (DTensor's
    redistributions) and DTensor's scatters and broadcasts of parameters: ``{"op", "via" ("c10d" or
    "functional"), "bytes", "dtype", "group"}``, ``group`` the global ranks it ran among. Only the
    outermost call is recorded; calls pass through unchanged. (watch_collectives records the same calls
    without their groups, and point-to-point ones with their peers.)"""
    import inspect
    import threading

    import torch.distributed._functional_collectives as funcol
    import torch.distributed.tensor._collective_utils as dtensor_collectives

    depth = threading.local()

    def wrap(name: str, via: str, original):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        def observed(*args, **kwargs):
            if getattr(depth, "value", 0) == 0:
                try:
                    bound = dict(signature.bind_partial(*args, **kwargs).arguments) if signature else dict(kwargs)
                except TypeError:
                    bound = dict(kwargs)
                first = _first_tensor(next((bound[k] for k in ("self", "tensor", "input", "output", "tensor_list",
                                                               "input_tensor", "output_tensor") if k in bound),
                                           args[0] if args else None))
                events.append({"op": name, "via": via, "group": group_ranks(bound.get("group")),
                               "bytes": first.numel() * first.element_size() if first is not None else 0,
                               "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None})
            depth.value = getattr(depth, "value", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.value -= 1

        observed.__name__ = name
        observed.__wrapped__ = original
        return observed

    owners = [(c10d, n, n, "c10d") for n in COLLECTIVES if hasattr(c10d, n)]
    owners += [(dist, n, n, "c10d") for n in COLLECTIVES if hasattr(dist, n)]
    owners += [(funcol, n, op, "functional") for n, op in FUNCTIONAL_COLLECTIVES.items() if hasattr(funcol, n)]
    owners += [(dtensor_collectives, n, n, "c10d") for n in ("scatter", "broadcast") if hasattr(dtensor_collectives, n)]
    with contextlib.ExitStack() as stack:
        for owner, name, op, via in owners:
            stack.enter_context(patched(owner, name, wrap(op, via, getattr(owner, name))))
        yield events


@functools.cache
def _dispatch_watch_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveOps(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # nothing here is compiled: without this, the first use imports torch._dynamo

        def __init__(self, record):
            super().__init__()
            self.record = record

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in DISPATCHED_NAMESPACES:
                self.record(func, args)
            return func(*args, **(kwargs or {}))

    return CollectiveOps


def watch_dispatched_collectives(record):
    """A context (a TorchDispatchMode) that calls ``record(func, args)`` for every collective op
    dispatched while it is on: torch.distributed's, the functional collectives' and their autograd
    forms, including the backwards autograd runs from C++, which no Python wrapper (and so neither
    :func:`watch_collectives`) sees. ``func.name()`` is e.g. ``"_c10d_functional::all_gather_into_tensor"``."""
    return _dispatch_watch_class()(record)


def _describe_call(name: str, signature, args, kwargs) -> dict:
    bound = {}
    if signature is not None:
        try:
            bound = dict(signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            bound = dict(kwargs)
    tensor = next((bound[k] for k in _FIRST_ARGUMENT if k in bound), args[0] if args else None)
    peer = None
    if name in POINT_TO_POINT:
        for key in ("dst", "src", "group_dst", "group_src"):
            if bound.get(key) is not None:
                peer = int(bound[key])
                if key.startswith("group_") and bound.get("group") is not None:
                    peer = int(c10d.get_global_rank(bound["group"], peer))
                break
    first = next((v for v in tensor if isinstance(v, torch.Tensor)), None) if isinstance(tensor, (list, tuple)) \
        else tensor
    return {"op": name, "bytes": _nbytes(tensor), "peer": peer, "dtype": _dtype_name(tensor),
            "itemsize": first.element_size() if isinstance(first, torch.Tensor) else None,
            "async_op": bool(bound.get("async_op", False)) or name in ("isend", "irecv")}


def _dtype_name(value) -> str | None:
    """"float32", "bfloat16", ... of the tensor a collective sends (the first one's, for a list), or None."""
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None
