"""The one way to grade out of process: the grading server and batch workers (and the Gradescope
bundle, through batch) all speak it; :func:`grade_in_sandbox` is how ``--sandbox`` and a
sandboxed batch grade one file: the verdicts here, the ranks in a sandbox of their own.

A request is one JSON line::

    {"path": "/abs/03_train.py", "shown_as": "exercises/03_train.py", "exercise_id": null,
     "options": GradeOptions.to_dict(), "sandbox": null}

(``sandbox``: the tool that gives the request's ranks a fresh sandbox, or null; the server's
requests also carry its ``key`` and the client's code ``version``). The answer is
JSON lines: any number of ``{"type": "event", "kind": ..., ...}`` as the grading goes (what the
live line shows), then one ``{"type": "report", "report": Report.to_dict()}``, or
``{"type": "error", "why": ...}`` when the grader itself failed on the file.

The worker is ``python -m grader.worker``: requests on stdin, answers on stdout, one after
another, with a warm pool kept between them. How long a client waits for an answer is
:func:`wait_s`: the grading's own deadline (:func:`grader.grading.deadline_s`) plus
:data:`START_MARGIN_S` for a fresh interpreter to import torch and start its pool.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import uuid
from typing import Callable, Iterable

from grader import catalog
from grader.options import GradeOptions
from grader.results import Report, report_from_dict

START_MARGIN_S = 60.0  # beyond a grading's own deadline: a fresh interpreter, torch and a pool (in a sandbox too)
DYNAMO_ENV = "DDP_GRADE_WORKER_DYNAMO"  # "0": the worker's pool skips torch._dynamo (no exercise it grades needs it)
EXERCISES_ENV = "DDP_GRADE_WORKER_EXERCISES"  # "01 02": the exercises it will grade, whose drivers its pool preloads
POOL_ENV = "DDP_GRADE_WORKER_POOL"  # "0": no warm pool here (every request's ranks run in a sandbox of their own)
SANDBOX_START_S = 60.0  # beyond wait_s, for a request graded with a sandbox: starting the sandbox


class Failed(Exception):
    """The other side could not answer: it ended, sent something unreadable, or the grader failed."""


class Unreadable(Failed):
    """A line that is no answer of the other side's: what a submission's rank wrote into its pipe."""


def request(path: str, exercise_id: str | None, options: GradeOptions, shown_as: str | None = None,
            sandbox: str | None = None) -> dict:
    """The request to grade ``path`` (sent with its absolute path: the worker may start elsewhere);
    ``sandbox``: the tool that gives its ranks a sandbox of their own (:func:`grade_in_sandbox`)."""
    return {"path": os.path.abspath(path), "shown_as": shown_as or path, "exercise_id": exercise_id,
            "options": options.to_dict(), "sandbox": sandbox, "id": uuid.uuid4().hex}


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
    reply_to = req.get("id")

    def send_tagged(message: dict) -> None:  # every answer line names the request it answers
        send({**message, "id": reply_to})

    events = lambda kind, **info: send_tagged({"type": "event", "kind": kind, **info})  # noqa: E731
    try:
        if req.get("sandbox"):
            report = grade_in_sandbox(req["path"], req.get("exercise_id"), options, events, tool=req["sandbox"])
        else:
            report = grade_file(req["path"], session(options) if callable(session) else session, options,
                                req.get("exercise_id"), on_event=events)
    except Exception as exc:  # the grader's own failure on this file: said as such, the worker goes on
        send_tagged({"type": "error", "why": f"{type(exc).__name__}: {exc}"})
        return None
    report.path = req.get("shown_as") or report.path
    send_tagged({"type": "report", "report": report.to_dict()})
    return report


def read_answer(lines: Iterable[bytes | str], on_event=None, request_id: str | None = None) -> Report:
    """The report from an answer's lines, calling ``on_event(kind, **info)`` for each event; Failed when
    the lines end first, cannot be read, say the grader failed, or (``request_id``) answer another request."""
    from grader.rank import wire

    try:
        for line in lines:
            message = wire.parse_json(line.encode() if isinstance(line, str) else line)  # its nesting bounded first
            if not isinstance(message, dict):
                raise ValueError("a line that is not an object")
            if request_id is not None and message.get("id") != request_id:
                raise Unreadable("a line that answers no request of this client (forged, or left from another one)")
            kind = message.get("type")
            if kind == "event":
                if on_event is not None:
                    on_event(message.get("kind", ""), **{k: v for k, v in message.items() if k not in ("type", "kind")})
            elif kind == "report":
                return report_from_dict(message["report"])
            elif kind in ("error", "stale", "refused"):
                raise Failed(str(message.get("why", kind))[:2000])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise Unreadable(f"an answer that cannot be read: {exc}") from None
    raise Failed("the answer ended before the report")


def grade_in_sandbox(path: str, exercise_id: str | None, options: GradeOptions, on_event=None,
                     tool: str | None = None, shown_as: str | None = None) -> Report:
    """Grade ``path`` here, with its ranks in a fresh sandbox (:class:`grader.sandbox.confined.ConfinedSession`)
    started for this submission alone: the checks, the report and the verdicts are decided in this
    process, from what the sandbox sends. Failed when the sandbox cannot be started (the grader's
    failure: no learner code has run by then)."""
    from grader import grading
    from grader.rank import untrusted
    from grader.sandbox import confined
    from grader.results import UNUSABLE, UNUSABLE_FILE, RunProblem

    shown = shown_as or path
    exercise = catalog.by_id(exercise_id) if exercise_id else catalog.from_filename(path)
    try:
        source = untrusted.read_submission(path)
    except untrusted.Unreadable as exc:
        return Report(exercise.id if exercise else "", exercise.title if exercise else "", shown, UNUSABLE,
                      run_problem=RunProblem(UNUSABLE_FILE, UNUSABLE, message=untrusted.clean_line(exc),
                                             file=untrusted.clean_line(os.path.basename(path))))
    ranks = max([*(exercise.world_sizes if exercise else [4]), options.world_size or 0, 2]) + 1
    session = confined.ConfinedSession(
        source, os.path.basename(path), options.limits, tool=tool, ranks=ranks,
        modules=grading.driver_modules([exercise]), dynamo=exercise is None or exercise.preload_dynamo)
    try:
        if exercise is not None:  # torch and the checks here while the sandbox starts
            importlib.import_module(exercise.module)
        try:
            session.wait_ready()
        except (confined.Broken, Exception) as exc:
            raise Failed(f"the sandbox could not be started: {exc}") from None
        report = grading.grade_file(session.learner_path, session, options, exercise_id, on_event=on_event)
    finally:
        session.close()
    report.path = shown
    return report


class Sessions:
    """Warm sessions kept between requests, one per set of limits (spares on, as watch has them)."""

    def __init__(self):
        self._sessions: dict = {}

    def get(self, options: GradeOptions):
        from grader.rank import harness

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

    if os.environ.get(POOL_ENV, "1") != "0":
        grading.warm_up(dynamo=os.environ.get(DYNAMO_ENV, "1") != "0", exercises=announced_exercises())
    else:  # only the checks' modules: the ranks' pools start in the sandboxes
        for exercise in announced_exercises() or []:
            importlib.import_module(exercise.module)
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
            answer(req, sessions.get, send)
    except KeyboardInterrupt:
        pass
    finally:
        sessions.close()


def main() -> None:
    """``python -m grader.worker``: stdout carries only answers; anything else printed goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    serve(sys.stdin, out)
