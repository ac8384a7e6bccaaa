"""The one way to grade out of process: the grading server, batch workers, ``--sandbox`` and the
Gradescope bundle (through batch) all speak it.

A request is one JSON line::

    {"path": "/abs/03_train.py", "shown_as": "exercises/03_train.py", "exercise_id": null,
     "options": GradeOptions.to_dict()}

(the server's requests also carry its ``key`` and the client's code ``version``). The answer is
JSON lines: any number of ``{"type": "event", "kind": ..., ...}`` as the grading goes (what the
live line shows), then one ``{"type": "report", "report": Report.to_dict()}``, or
``{"type": "error", "why": ...}`` when the grader itself failed on the file.

The worker is ``python -m grader.worker``: requests on stdin, answers on stdout, one after
another, with a warm pool kept between them. How long a client waits for an answer is
:func:`wait_s`: the grading's own deadline (:func:`grader.grading.deadline_s`) plus
:data:`START_MARGIN_S` for a fresh interpreter to import torch and start its pool.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable

from grader import catalog
from grader.options import GradeOptions
from grader.results import Report, report_from_dict

START_MARGIN_S = 60.0  # beyond a grading's own deadline: a fresh interpreter, torch and a pool (in a sandbox too)
DYNAMO_ENV = "DDP_GRADE_WORKER_DYNAMO"  # "0": the worker's pool skips torch._dynamo (no exercise it grades needs it)
EXERCISES_ENV = "DDP_GRADE_WORKER_EXERCISES"  # "01 02": the exercises it will grade, whose drivers its pool preloads


class Failed(Exception):
    """The other side could not answer: it ended, sent something unreadable, or the grader failed."""


def request(path: str, exercise_id: str | None, options: GradeOptions, shown_as: str | None = None) -> dict:
    """The request to grade ``path`` (sent with its absolute path: the worker may start elsewhere)."""
    return {"path": os.path.abspath(path), "shown_as": shown_as or path, "exercise_id": exercise_id,
            "options": options.to_dict()}


def wait_s(path: str, exercise_id: str | None, options: GradeOptions) -> float:
    """How long a client waits for a grading's answer before it gives the worker up."""
    from grader.grading import deadline_s

    exercise = catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)
    return deadline_s(exercise, options) + START_MARGIN_S


def encode(message: dict) -> bytes:
    return json.dumps(message).encode() + b"\n"


def answer(req: dict, session, send: Callable[[dict], None]) -> Report | None:
    """Grade what ``req`` asks with ``session``: events, then the report (or an error), each through
    ``send``; the report, or None when the grader failed."""
    from grader.grading import grade_file

    options = GradeOptions.from_dict(req.get("options") or {})
    try:
        report = grade_file(req["path"], session, options, req.get("exercise_id"),
                            on_event=lambda kind, **info: send({"type": "event", "kind": kind, **info}))
    except Exception as exc:  # the grader's own failure on this file: said as such, the worker goes on
        send({"type": "error", "why": f"{type(exc).__name__}: {exc}"})
        return None
    report.path = req.get("shown_as") or report.path
    send({"type": "report", "report": report.to_dict()})
    return report


def read_answer(lines: Iterable[bytes | str], on_event=None) -> Report:
    """The report from an answer's lines, calling ``on_event(kind, **info)`` for each event; Failed when
    the lines end first, cannot be read, or say the grader failed."""
    try:
        for line in lines:
            message = json.loads(line)
            kind = message.get("type")
            if kind == "event":
                if on_event is not None:
                    on_event(message.get("kind", ""), **{k: v for k, v in message.items() if k not in ("type", "kind")})
            elif kind == "report":
                return report_from_dict(message["report"])
            elif kind in ("error", "stale", "refused"):
                raise Failed(message.get("why", kind))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Failed(f"an answer that cannot be read: {exc}") from None
    raise Failed("the answer ended before the report")


def grade_in_sandbox(path: str, exercise_id: str | None, options: GradeOptions, on_event=None,
                     tool: str | None = None) -> Report:
    """Grade ``path`` with a worker started in a fresh sandbox (:mod:`grader.sandbox`) for this request
    alone; Failed when it gives no report in :func:`wait_s`."""
    from grader import sandbox

    from grader import catalog

    size = options.limits["tmp_bytes"]
    exercise = catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)
    env = sandbox.environment({"DDP_GRADE_STATE_DIR": "/tmp/ddp-grade-state", "DDP_GRADE_SERVER": "0",
                               **exercise_env([exercise])}, size)
    argv = sandbox.wrap([sys.executable, "-m", "grader.worker"], [path], tool, tmp_bytes=size)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    errors: list[bytes] = []

    def pump(stream, into) -> None:
        for line in stream:
            into(line)
        if stream is proc.stdout:
            lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout, lines.put), daemon=True).start()
    threading.Thread(target=pump, args=(proc.stderr, lambda b: errors.append(b) if len(errors) < 200 else None),
                     daemon=True).start()
    until = time.monotonic() + wait_s(path, exercise_id, options)

    def answer_lines():
        while True:
            try:
                line = lines.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                raise Failed(f"the sandboxed grading gave no report within {wait_s(path, exercise_id, options):g} s")
            if line is None:
                return
            yield line

    try:
        proc.stdin.write(encode(request(path, exercise_id, options)))
        proc.stdin.close()  # one request: the worker ends once it has answered
        return read_answer(answer_lines(), on_event)
    except (Failed, OSError) as exc:
        proc.poll()
        said = b"".join(errors).decode(errors="replace").strip()[-500:]
        raise Failed(f"{exc} (exit {proc.returncode}){': ' + said if said else ''}") from None
    finally:
        if proc.poll() is None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()


class Sessions:
    """Warm sessions kept between requests, one per set of limits (spares on, as watch has them)."""

    def __init__(self):
        self._sessions: dict = {}

    def get(self, options: GradeOptions):
        from grader import harness

        key = json.dumps(options.limits, sort_keys=True)
        if key not in self._sessions:
            self._sessions[key] = harness.Session(limits=options.limits, spares=True)
        return self._sessions[key]

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()


def exercise_env(exercises) -> dict:
    """What tells a worker which exercises it will grade (catalog entries; any None: it cannot know)."""
    exercises = list(exercises)
    if not exercises or None in exercises:
        return {}
    return {EXERCISES_ENV: " ".join(sorted({e.id for e in exercises}))}


def announced_exercises() -> list | None:
    """The exercises this worker was told it will grade, or None (then every exercise's drivers)."""
    from grader import catalog

    ids = os.environ.get(EXERCISES_ENV, "").split()
    found = [catalog.by_id(i) for i in ids]
    return found if found and None not in found else None


def serve(requests: Iterable[str], out) -> None:
    """The worker's loop: answer each request line on ``out`` (a text stream), with warm sessions."""
    from grader import grading

    grading.warm_up(dynamo=os.environ.get(DYNAMO_ENV, "1") != "0", exercises=announced_exercises())
    sessions = Sessions()

    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    try:
        for line in requests:
            if not line.strip():
                continue
            try:
                req = json.loads(line)
            except ValueError as exc:
                send({"type": "error", "why": f"a request that cannot be read: {exc}"})
                continue
            answer(req, sessions.get(GradeOptions.from_dict(req.get("options") or {})), send)
    except KeyboardInterrupt:
        pass
    finally:
        sessions.close()


def main() -> None:
    """``python -m grader.worker``: stdout carries only answers; anything else printed goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    serve(sys.stdin, out)
