"""What crosses the sandbox's boundary, and how the grader checks it before anything reads it.

Both sides of :mod:`grader.sandbox.confined` and :mod:`grader.rank.rank_host` frame their messages the
same way (:func:`grader.rank.wire.frame`): an 8-byte length, then a message of :mod:`grader.rank.wire`.
What comes out of the sandbox is the submission's to forge (a rank can reach the host's pipes), so the
grader outside reads at most :data:`MAX_ANSWER_BYTES` of it, decodes it as data within the wire's limits
(nesting, values and tensor elements, counted before anything is built), and then takes each outcome
apart field by field here: a status it knows, rank numbers 0 to n - 1, integers where integers go, text
cut to :data:`MAX_TEXT` characters. Anything else is :class:`Unreadable`, which the grader reports as the
submission's failure.
"""

from __future__ import annotations

import math

from grader.rank import limits as _limits
from grader.rank.outcomes import RankOutcome, WorldOutcome

MAX_ANSWER_BYTES = 80 * 2**20  # one answer from the sandbox: what a run's ranks may send (wire.MAX_BYTES), their text
MAX_TEXT = 20_000  # characters of any one text field of an outcome (stacks, output, tracebacks)
STATUSES = ("ok", "error", "exited", "killed")


class Unreadable(Exception):
    """An answer that is not what the host sends: the submission's forgery, or a broken stream."""


def world_from(data, expected: int) -> WorldOutcome:
    """A :class:`WorldOutcome` from an answer's data, checked field by field; Unreadable when it is not
    an outcome of ``expected`` ranks, numbered 0 to ``expected`` - 1."""
    if not isinstance(data, dict):
        raise Unreadable("an outcome that is not a mapping")
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != expected:
        raise Unreadable(f"an outcome of {len(ranks) if isinstance(ranks, list) else 'no'} ranks, expected {expected}")
    outcomes = [rank_from(r) for r in ranks]
    if [o.rank for o in outcomes] != list(range(expected)):
        raise Unreadable("an outcome whose ranks are not 0 to world size - 1 in order")
    return WorldOutcome(
        world_size=expected,
        ranks=outcomes,
        timed_out=_flag(data.get("timed_out")),
        seconds=_number(data.get("seconds")),
        run_dir=text(data.get("run_dir"), 4096),
        stray_processes=int(_number(data.get("stray_processes"))),
        start_s=0.0,  # the grader measures the start itself
    )


def rank_from(data) -> RankOutcome:
    if not isinstance(data, dict):
        raise Unreadable("a rank's outcome that is not a mapping")
    status = data.get("status")
    if status not in STATUSES:
        raise Unreadable(f"a rank's status {str(status)[:40]!r}")
    rank = data.get("rank")
    if type(rank) is not int:
        raise Unreadable("a rank number that is not an integer")
    exitcode = data.get("exitcode")
    if exitcode is not None and type(exitcode) is not int:
        raise Unreadable("an exit code that is not an integer")
    return RankOutcome(rank=rank, status=status, result=data.get("result") if status == "ok" else None,
                       error=error_from(data.get("error")) if status == "error" else None,
                       exitcode=exitcode, stack=text(data.get("stack")), output=text(data.get("output")),
                       seconds=_number(data.get("seconds")), limit=_choice(data.get("limit"),
                                                                            ("", *_limits.OPTIONS)),
                       limit_detail=text(data.get("limit_detail"), 400), pid=_pid(data.get("pid")))


def _pid(value) -> int | None:
    """A process id as the sandbox's host saw it (translated by the grader, never trusted as its own)."""
    return value if type(value) is int and 0 < value < 1 << 22 else None


ERROR_TEXT = {"type": 200, "message": 4000, "traceback": MAX_TEXT, "phase": 40, "missing": 200}


def error_from(data) -> dict:
    """A rank's error, each field checked (unknown fields are dropped, except plain evidence)."""
    if not isinstance(data, dict):
        return {"type": "Unknown", "message": "", "traceback": "", "where": None, "phase": "run"}
    out: dict = {key: text(data.get(key), size) for key, size in ERROR_TEXT.items() if key in data}
    out.setdefault("type", "Unknown")
    out.setdefault("message", "")
    out.setdefault("traceback", "")
    out.setdefault("phase", "run")
    where = data.get("where")
    out["where"] = None
    if isinstance(where, dict) and type(where.get("line")) is int:
        out["where"] = {"line": where["line"], "function": text(where.get("function"), 200),
                        "code": text(where.get("code"), 400)}
    at = data.get("at")
    if isinstance(at, float) and math.isfinite(at):
        out["at"] = at
    for key, value in data.items():  # kind-specific evidence (the rendezvous address, collectives)
        if key not in out and key not in ("at", "where") and isinstance(key, str) and len(key) < 64:
            out[key] = value
    return out


def text(value, size: int = MAX_TEXT) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise Unreadable(f"a {type(value).__name__} where text was expected")
    return value[-size:] if len(value) > size else value


def _number(value) -> float:
    if value is None:
        return 0.0
    if type(value) not in (int, float) or not math.isfinite(value):
        raise Unreadable("a number that is not a finite number")
    return float(value)


def _flag(value) -> bool:
    if value is None:
        return False
    if type(value) is not bool:
        raise Unreadable("a flag that is not True or False")
    return value


def _choice(value, allowed: tuple) -> str:
    value = value or ""
    if value not in allowed:
        raise Unreadable(f"an unknown value {str(value)[:40]!r}")
    return value
