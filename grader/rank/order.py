"""The order of a rank's work: when each collective and point-to-point call is issued and when it is waited for,
and each matrix product among them (runs in a rank).

Overlap is an order of events: a transfer issued, something computed, the transfer waited for. These probes
record that order as plain data, no clock (what the checks read is which came first, never how long; two shared
cores cannot show a speedup). Like every probe, they record what the learner's process did about itself.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from grader.rank.probes import COLLECTIVES, POINT_TO_POINT, _describe_call, patched


COMPLETED_ONLY_WHEN_WAITED = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")


class IssueAndWait:
    """What :func:`watch_issue_and_wait` yields: the events, and the calls still in flight."""

    def __init__(self, events: list):
        self.events = events
        self.in_flight: dict[int, tuple[int, str, object]] = {}  # id(Work or Future) -> (call id, op, object)
        self.depth = threading.local()

    def _quiet(self) -> bool:
        return bool(getattr(self.depth, "value", 0))

    def settle(self, timeout_s: float = 10.0) -> None:
        """Let every collective in flight finish (at most ``timeout_s``), so that what it writes is in memory now.
        It polls Work.is_completed() and waits for nothing: no recording sees a wait, and the learner's own waits
        later still count as theirs. Point-to-point calls are left alone, and so are reduce-scatters: gloo's Work
        of one reports is_completed() only once it has been waited for (torch 2.13), so polling it would last the
        whole timeout."""
        deadline = time.monotonic() + timeout_s
        for _, op, work in list(self.in_flight.values()):
            if op in POINT_TO_POINT or op in COMPLETED_ONLY_WHEN_WAITED or not isinstance(work, dist.Work):
                continue
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.0002)


@contextlib.contextmanager
def watch_issue_and_wait(events: list):
    """Record when each collective or point-to-point call is issued and when it is waited for.

    An issue: ``{"op", "bytes", "peer", "dtype", "itemsize", "async_op", "id"}`` (as
    :func:`watch_collectives` records a call, ``id`` counting the calls from 0). A wait:
    ``{"op": "wait", "id"}``, appended when ``Work.wait()`` (or the ``wait()`` of its ``get_future()``)
    is first called on the work that call returned; a blocking call (no ``async_op``) is followed at
    once by its own wait, ``"blocking": True``. Only the outermost call is recorded; calls pass through
    unchanged. The events' order is the order in which they happened (no clock: what the checks read is
    which came first). Yields an :class:`IssueAndWait`.
    """
    import inspect

    calls = IssueAndWait(events)
    counter = [0]

    def wrap(name, original):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        def observed(*args, **kwargs):
            if calls._quiet():
                return original(*args, **kwargs)
            event = _describe_call(name, signature, args, kwargs)
            event["id"] = counter[0]
            counter[0] += 1
            events.append(event)
            calls.depth.value = 1
            try:
                result = original(*args, **kwargs)
            finally:
                calls.depth.value = 0
            if isinstance(result, (dist.Work, torch._C.Future)):
                calls.in_flight[id(result)] = (event["id"], name, result)
            if not event["async_op"]:
                events.append({"op": "wait", "id": event["id"], "blocking": True})
            return result

        observed.__name__ = name
        observed.__wrapped__ = original
        return observed

    def waited(original):
        def wait(self, *args, **kwargs):
            if not calls._quiet() and id(self) in calls.in_flight:
                events.append({"op": "wait", "id": calls.in_flight.pop(id(self))[0]})
            calls.depth.value = getattr(calls.depth, "value", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                calls.depth.value -= 1

        return wait

    def future_of(original):
        def get_future(self, *args, **kwargs):
            future = original(self, *args, **kwargs)
            if id(self) in calls.in_flight:
                call_id, op, _ = calls.in_flight[id(self)]
                calls.in_flight[id(future)] = (call_id, op, future)
            return future

        return get_future

    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES + POINT_TO_POINT:
            if hasattr(c10d, name):
                replacement = wrap(name, getattr(c10d, name))
                stack.enter_context(patched(c10d, name, replacement))
                if hasattr(dist, name):
                    stack.enter_context(patched(dist, name, replacement))
        stack.enter_context(patched(dist.Work, "wait", waited(dist.Work.wait)))
        stack.enter_context(patched(dist.Work, "get_future", future_of(dist.Work.get_future)))
        stack.enter_context(patched(torch._C.Future, "wait", waited(torch._C.Future.wait)))
        yield calls


# The aten operators a matrix product reaches, whatever Python spelled it (@, torch.matmul, F.linear, einsum, mm).
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation")


def watch_matmuls(record):
    """A context (a TorchDispatchMode) that calls ``record(name, args)`` as each matrix product is about to run
    (``name`` one of :data:`MATMULS`), in forward and in the backward autograd runs; other operators pass
    through untouched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # nothing here is compiled: without this, the first use imports torch._dynamo

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten" and func._schema.name.split("::")[-1] in MATMULS:
                record(func._schema.name.split("::")[-1], args)
            return func(*args, **(kwargs or {}))

    return Matmuls()
