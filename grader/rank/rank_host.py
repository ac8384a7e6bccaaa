"""``python -m grader.rank.rank_host``: inside a sandbox, the one process of the grader that runs there.

It holds the warm pool and starts the ranks (a :class:`grader.rank.harness.Session`), and answers the
grader outside (:mod:`grader.sandbox.confined`), which decides everything: this process only starts
runs and workers when asked and sends back what they did, which holds what the ranks sent about
themselves: their claim, read by the grader outside as untrusted data.

No rank can speak as this process: the grader's two pipes are descriptors of its own (their numbers
are its arguments), never its standard input or output; nothing it starts inherits them; and it is not
dumpable (``PR_SET_DUMPABLE`` 0), so a process of the same user without privileges (every rank: they
hold no capability) can neither open its descriptors through ``/proc/PID/fd``, nor read or write its
memory, nor trace it, nor take a descriptor with ``pidfd_getfd``; its pool is not dumpable either
(:mod:`grader.rank.pool`). It is the first process of the sandbox's PID namespace (bwrap's
``--as-pid-1``; under unshare the first step inside execs it), which ignores the signals a rank sends
it, and which takes every process of the sandbox with it when it ends: it ends as soon as the grader's
end of its requests pipe closes. A rank can forge what its own pipe to this process carries (its own
claim), nothing else.

Frames both ways are an 8-byte length and a message of :mod:`grader.rank.wire` (data, never a
pickle, either way). The first frame from the grader is the configuration; the host
answers ``ready`` once its pool has started, then one answer per request:

* ``run_many`` -> ``starting`` (before the first rank gets its spec), ``started`` (every rank has
  its spec: the run's deadline starts), then ``outcomes``;
* ``worker`` -> ``worker`` (its number); ``call`` -> ``reply``, or ``raised`` (timeout or died)
  with the worker's outcome; ``close_worker`` -> ``closed``;
* ``close`` ends the host (its session closed, every process it started stopped).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from grader.rank import sock_diag, wire
from grader.rank.wire import frame, read_frame

def _outcome_fields(outcome) -> dict:
    """A dataclass outcome as a dict, its fields as they are (the result kept as the rank sent it)."""
    return {f.name: getattr(outcome, f.name) for f in dataclasses.fields(outcome)}


def world_dict(world) -> dict:
    data = _outcome_fields(world)
    data["ranks"] = [_outcome_fields(r) for r in world.ranks]
    return data


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte (a write to a pipe may be cut short by a signal)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _set_task_limit(tasks: int) -> None:
    """At most ``tasks`` processes and threads for this user in the sandbox (its user namespace
    counts its own: RLIMIT_NPROC is per user and namespace since Linux 5.14)."""
    if not tasks:
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        value = tasks if hard == resource.RLIM_INFINITY else min(tasks, hard)
        resource.setrlimit(resource.RLIMIT_NPROC, (value, value))
    except (ImportError, ValueError, OSError):
        pass


PR_SET_DUMPABLE = 4
POOL_MODULE = "grader.rank.pool"  # imported by the pool as it starts: not dumpable either


def out_of_reach() -> None:
    """Make this process unreachable for the ranks (see the module): not dumpable, and no current folder
    on the import path (Python 3.10 has no ``-P``: ``/tmp`` is the ranks' to write a module in). Exits when
    the kernel refuses: the sandbox is then not started rather than started open."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(3, 0, 0, 0, 0) != 0:  # 3: PR_GET_DUMPABLE
        raise SystemExit(f"the sandbox's host cannot make itself non-dumpable (errno {ctypes.get_errno()})")
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] == os.getcwd():
        del sys.path[0]


def end_with_the_grader(requests_fd: int) -> None:
    """End this process as soon as the grader's end of the requests pipe closes, however the grader ended
    (killed included): as the PID namespace's first process, it takes every process of the sandbox with it."""
    import select
    import threading

    def watch() -> None:
        poller = select.poll()
        poller.register(requests_fd, 0)  # the end of the pipe (POLLHUP) is reported whatever is asked
        while True:
            for _, event in poller.poll():
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)

    threading.Thread(target=watch, name="ddp-grade grader's end", daemon=True).start()


def main() -> None:
    out_of_reach()
    sock_diag.send_pair()  # before any rank exists: the kernel's counters of this namespace, for the grader
    requests_fd, out_fd = int(sys.argv[1]), int(sys.argv[2])
    for fd in (requests_fd, out_fd):  # nothing this process starts holds either
        os.set_inheritable(fd, False)
    # The first process of its PID namespace ignores every signal sent from inside it that it has no
    # handler for: with Python's Ctrl-C handler gone, no rank can end it or stop it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    end_with_the_grader(requests_fd)
    inbox = os.fdopen(requests_fd, "rb", buffering=0)
    os.dup2(2, 1)  # what this process and its pool print goes to stderr, never into the answers

    first = read_frame(inbox)
    if first is None:
        return
    try:
        config = wire.loads(first)
    except wire.Unreadable:
        return

    from grader.rank import harness

    _set_task_limit(config.get("max_tasks", 0))
    # The pool first: it imports torch in its own process while this one imports torch (the ranks' tensors).
    harness.warm_up(dynamo=config.get("dynamo", True), modules=[*(config.get("modules") or ()), POOL_MODULE])
    import torch  # noqa: F401

    def send(message: dict) -> None:
        _write_all(out_fd, frame(wire.dumps(message)))

    session = harness.Session(limits=config.get("limits"), spares=True, tmp=config["tmp"])
    workers: dict[int, harness.Worker] = {}
    send({"type": "ready", "pid": os.getpid()})
    try:
        while True:
            data = read_frame(inbox)
            if data is None:
                return
            try:
                request = wire.loads(data)
                op = request.get("op")
            except Exception:  # written into this process's input by something else: nothing more is read
                send({"type": "failed", "why": "a request that cannot be read"})
                return
            try:
                if op == "close":
                    return
                if op == "run_many":
                    worlds = [harness.World(*w) for w in request["worlds"]]
                    send({"type": "starting"})  # from here the run's ranks may run the learner's code
                    outcomes = session.run_many(worlds, learner_path=request["learner_path"],
                                                timeout_s=request["timeout_s"], backend=request["backend"],
                                                grace_s=request["grace_s"],
                                                last_read_on_failure=request.get("last_read_on_failure"),
                                                on_started=lambda: send({"type": "started"}))
                    send({"type": "outcomes", "outcomes": [world_dict(w) for w in outcomes]})
                elif op == "worker":
                    worker = session.worker(request["driver"], learner_path=request["learner_path"],
                                            timeout_s=request["timeout_s"], kwargs=request.get("kwargs"),
                                            backend=request["backend"])
                    number = len(workers) + 1
                    workers[number] = worker
                    send({"type": "worker", "id": number, "run_dir": worker.run_dir})
                elif op == "call":
                    worker = workers[request["id"]]
                    try:
                        reply = worker.call(request["name"], within_s=request.get("within_s"),
                                            **request.get("kwargs", {}))
                    except harness.WorkerTimeout as exc:
                        send({"type": "raised", "kind": "timeout", "outcome": _outcome_fields(exc.outcome)})
                    except harness.WorkerDied as exc:
                        send({"type": "raised", "kind": "died", "outcome": _outcome_fields(exc.outcome)})
                    else:
                        send({"type": "reply", "reply": reply})
                elif op == "close_worker":
                    worker = workers.pop(request["id"], None)
                    if worker is not None:
                        worker.close()
                    send({"type": "closed"})
                else:
                    send({"type": "failed", "why": f"unknown request {op!r}"})
            except Exception as exc:  # the host's own failure on this request: said, and the host goes on
                send({"type": "failed", "why": f"{type(exc).__name__}: {exc}"[:2000]})
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        for worker in workers.values():
            try:
                worker.close()
            except Exception:
                pass
        session.close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
