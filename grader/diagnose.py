"""From what the harness saw to a :class:`~grader.results.RunProblem`: the facts, no prose.

The harness returns a :class:`~grader.rank.harness.WorldOutcome` (statuses, exceptions as data,
stacks, output). This module reads it for the learner: which rank failed first, where in the
learner's file, what a stuck rank was waiting in. The report turns the record into words.
"""

from __future__ import annotations

import linecache
import os
import re

from grader.rank.harness import RankOutcome, WorldOutcome
from grader.results import (EXITED, FAILED, IMPORT_ERROR, LIMIT, MISMATCHED_COLLECTIVE, MISSING_NAME,
                            NOT_IMPLEMENTED, RAISED, STOPPED, STUCK_COLLECTIVE, STUCK_DEBUGGER, STUCK_LEARNER_LOOP,
                            STUCK_RENDEZVOUS, STUCK_SEND_RECV, TIMEOUT, TIMEOUT_KIND, UNUSABLE, Location,
                            RankRecord, RunProblem)

STACK_LINES_PER_RANK = 25
TRACEBACK_LINES = 40
OUTPUT_LINES = 15


# --- ranks as records ---------------------------------------------------------------------


def rank_record(r: RankOutcome, learner_path: str) -> RankRecord:
    """One rank's outcome as plain data: where it was, what it raised, its trimmed stack and output."""
    err = r.error if isinstance(r.error, dict) else {}
    where = _where(err, learner_path) if err else None
    inside = ""
    if r.stack.strip():
        frames = main_thread_frames(r.stack)
        mine = [f for f in frames if _same_file(f[0], learner_path)]
        if mine and where is None:
            where = Location(os.path.basename(learner_path), mine[0][1], mine[0][2],
                             linecache.getline(mine[0][0], mine[0][1]).strip()[:200])
        if frames and frames[0] not in mine:
            inside = f"{frames[0][2]} ({short_path(frames[0][0])})"
    return RankRecord(
        rank=r.rank, status=r.status, exception=str(err.get("type") or ""), message=str(err.get("message") or ""),
        where=where, inside=inside, exitcode=r.exitcode, limit=r.limit, limit_detail=r.limit_detail,
        lost_peer=r.status == "killed" and bool(r.error), seconds=r.seconds,
        traceback=trim_traceback(err.get("traceback", "")) if err.get("traceback") else "",
        stack=trim_stack(r.stack) if r.stack.strip() else "",
        output="\n".join(r.output.rstrip().splitlines()[-OUTPUT_LINES:]) if r.output.strip() else "",
    )


def _where(err: dict, learner_path: str) -> Location | None:
    where = err.get("where")
    if not isinstance(where, dict) or not where:
        return None
    line = where.get("line")
    return Location(os.path.basename(str(where.get("file") or learner_path)), line if type(line) is int else 0,
                    str(where.get("function") or ""), str(where.get("code") or "")[:200])


def _raised_by_learner(err: dict) -> bool:
    """Whether the exception was raised by a ``raise`` of the learner's own (its innermost frame the learner's,
    at a raise statement), not by a library the learner called (records without the facts: assumed so)."""
    code = str((err.get("where") or {}).get("code") or "raise")
    return bool(err.get("raised_in_learner", True)) and code.lstrip().startswith("raise")


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


# --- a run that failed ------------------------------------------------------------------------


def first_cause(failures: list[RankOutcome]) -> RankOutcome:
    """Prefer a rank that raised over one that only exited, and the earliest one."""
    raised = [r for r in failures if r.status == "error"]
    return min(raised or failures, key=lambda r: r.seconds)


def failure_problem(outcome: WorldOutcome, learner_path: str, single: bool = False) -> RunProblem | None:
    """The problem of a run in which a rank raised or ended early (None when every rank finished)."""
    records = [rank_record(r, learner_path) for r in outcome.ranks]
    failures = outcome.failures()
    if not failures:
        if outcome.still_running():  # stopped after another rank failed: cannot happen alone
            return RunProblem(STOPPED, FAILED, world_size=outcome.world_size, ranks=records,
                              file=os.path.basename(learner_path))
        return None
    first = first_cause(failures)
    err = first.error if isinstance(first.error, dict) else {}
    file = os.path.basename(learner_path)
    base = dict(rank=None if single else first.rank, world_size=None if single else outcome.world_size, file=file)
    if err.get("phase") == "import":
        if err.get("missing"):
            return RunProblem(MISSING_NAME, UNUSABLE, name=str(err["missing"]), file=file)
        return RunProblem(IMPORT_ERROR, UNUSABLE, exception=str(err.get("type")), message=str(err.get("message")),
                          where=_where(err, learner_path), file=file, ranks=[records[outcome.ranks.index(first)]])
    if err.get("phase") == "rendezvous":
        return RunProblem(STUCK_RENDEZVOUS, FAILED, exception=str(err.get("type")), message=str(err.get("message")),
                          where=_where(err, learner_path), evidence=dict(err.get("rendezvous") or {}),
                          stopped=[r.rank for r in outcome.ranks if r.status == "killed"], ranks=records, **base)
    if err.get("type") == "BdbQuit":  # a debugger prompt with no terminal: pdb reads end-of-file and quits
        return RunProblem(STUCK_DEBUGGER, FAILED, exception="BdbQuit", where=_where(err, learner_path),
                          stopped=[r.rank for r in outcome.ranks if r.status == "killed"], ranks=records, **base)
    if err.get("type") == "NotImplementedError" and _raised_by_learner(err):
        # A stub's TODO. Raised inside torch (an API used in a way it does not support) it is the learner's
        # failure like any other exception, shown with the learner's line that led there.
        return RunProblem(NOT_IMPLEMENTED, FAILED, name=(err.get("where") or {}).get("function") or "a function",
                          file=file)
    stopped = [r.rank for r in outcome.ranks if r.status == "killed"]
    finished = [r.rank for r in outcome.ranks if r.ok]
    record = records[outcome.ranks.index(first)]
    if first.limit:
        kind = LIMIT
    elif first.status == "error":
        kind = MISMATCHED_COLLECTIVE if finished and "by peer" in str(err.get("message", "")) else RAISED
    else:
        kind = EXITED
    evidence = {"exitcode": first.exitcode, "limit": first.limit, "limit_detail": first.limit_detail,
                "single_process": single}
    if kind == EXITED:
        evidence["said"] = last_words(first.output)
    return RunProblem(kind, FAILED, exception=record.exception, message=record.message, where=record.where,
                      finished=finished, stopped=stopped, ranks=records, evidence=evidence, **base)


def last_words(output: str) -> str:
    """What a process that ended without a result last said about why: the ``what():`` line of a C++ abort
    (gloo's enforce failures, a size mismatch), else the last line with an error in it, else its last line."""
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    for marks in (("what():",), ("Error", "error", "Abort", "abort", "gloo")):
        found = [line for line in lines if any(m in line for m in marks)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else ""


def timeout_problem(outcome: WorldOutcome, timeout_s: float, learner_path: str, single: bool = False) -> RunProblem:
    """The problem of a run that passed its deadline: which ranks were still running, and where."""
    records = [rank_record(r, learner_path) for r in outcome.ranks]
    stuck = [r.rank for r in outcome.still_running()]
    waits = {r.rank: waiting_in(r.stack) for r in outcome.still_running()}
    kind = TIMEOUT_KIND if single else stuck_kind(list(waits.values()))
    first = next((rec for rec in records if rec.rank in stuck), None)
    return RunProblem(kind, TIMEOUT, rank=first.rank if first else None, world_size=outcome.world_size,
                      where=first.where if first else None, timeout_s=timeout_s, stopped=stuck,
                      finished=[r.rank for r in outcome.ranks if r.ok], ranks=records,
                      file=os.path.basename(learner_path),
                      evidence={"single_process": single, "waiting_in": {str(k): v for k, v in waits.items()}})


# What a stuck rank waits in, from the innermost frames of its main thread.
_RENDEZVOUS_FRAMES = ("init_process_group", "rendezvous", "_env_rendezvous_handler", "_tcp_rendezvous_handler",
                      "_create_c10d_store", "_store_based_barrier")
_DEBUGGER_FILES = ("pdb.py", "bdb.py", "cmd.py")
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
                "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "wait")


def waiting_in(stack: str) -> str:
    """"rendezvous", "debugger", "send", "all_reduce" ... or "code" (running Python), "" when no stack."""
    frames = main_thread_frames(stack)
    if not frames:
        return ""
    for file, _, function in frames:
        if os.path.basename(file) in _DEBUGGER_FILES:
            return "debugger"
    for file, _, function in frames[:6]:
        if function in _RENDEZVOUS_FRAMES:
            return "rendezvous"
    for file, _, function in frames[:4]:
        if "torch" in file and "distributed" in file and function in _POINT_TO_POINT + _COLLECTIVES:
            return function
    return "code"


def stuck_kind(waits: list[str]) -> str:
    """The kind of a timeout from what each stuck rank waits in."""
    known = [w for w in waits if w]
    if not known:
        return TIMEOUT_KIND
    if "debugger" in known:
        return STUCK_DEBUGGER
    if "rendezvous" in known:
        return STUCK_RENDEZVOUS
    if all(w in _POINT_TO_POINT for w in known):
        return STUCK_SEND_RECV
    if any(w in _COLLECTIVES or w in _POINT_TO_POINT for w in known):
        return STUCK_COLLECTIVE
    if all(w == "code" for w in known):
        return STUCK_LEARNER_LOOP
    return TIMEOUT_KIND


# --- reading stacks and tracebacks ------------------------------------------------------------------


def main_thread_frames(stack: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the thread that looks like the main one, innermost first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip())
    chosen = None
    for block in blocks:
        if block and "Current thread" in block.splitlines()[0]:
            chosen = block
    for block in blocks:  # the main thread is the one that entered through grader/rank/child.py
        if "grader/rank/child.py" in block or "grader\\child.py" in block:
            chosen = block
    if chosen is None and blocks:
        chosen = blocks[-1]
    return [(m.group(1), int(m.group(2)), m.group(3))
            for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', chosen or "")]


def short_path(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.basename(path)


def trim_traceback(tb: str) -> str:
    """Drop the grader's own frames from a traceback; keep its last lines."""
    kept, skipping = [], False
    for line in tb.rstrip().splitlines():
        if line.startswith('  File "') and ("/grader/" in line or "\\grader\\" in line):
            skipping = True
            continue
        if skipping and line.startswith("    ") and not line.startswith('  File "'):
            continue
        skipping = False
        kept.append(line)
    return "\n".join(kept[-TRACEBACK_LINES:])


_PLUMBING = ("/multiprocessing/", "\\multiprocessing\\", "grader/rank/child.py", "grader\\child.py", 'File "<string>"')


def trim_stack(stack: str) -> str:
    """faulthandler's dump without the process plumbing below the driver."""
    lines = [ln for ln in stack.rstrip().splitlines() if ln.strip() and not any(p in ln for p in _PLUMBING)]
    return "\n".join(lines[:STACK_LINES_PER_RANK]) + ("\n  ..." if len(lines) > STACK_LINES_PER_RANK else "")
