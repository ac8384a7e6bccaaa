"""An exception the learner's code raised in a rank, caught there to be judged, in words that keep the
learner's own frame: "RuntimeError: ... (31_fsdp2.py line 57, in train_step: `loss = loss_fn(...)`)".

Drivers that catch an exception to record it (so that what was seen before it can still be judged) record
this text, so that the report shows the file, the line and its text whichever check names it.
"""

from __future__ import annotations

import os

ERROR_CHARS = 500  # an exception's message is cut here (never its frame)


def learner_error(exc: BaseException, limit: int = ERROR_CHARS, learner_path: str | None = None) -> str:
    """``exc`` as "Type: message (file line N, in function: `the line`)", the message cut at ``limit``
    characters (never the frame); ``learner_path`` defaults to this rank's learner's file."""
    from grader.rank import child

    info = child.describe_exception(exc, learner_path or child._LEARNER_PATH or None)
    return error_words(info, learner_path or child._LEARNER_PATH, limit)


def learner_frame(exc: BaseException, learner_path: str | None = None) -> str:
    """Only the frame of :func:`learner_error`: " (file line N, in function: `the line`)", or ""."""
    from grader.rank import child

    path = learner_path or child._LEARNER_PATH
    return frame_words(child.describe_exception(exc, path or None).get("where"), path)


def error_words(info: dict, learner_path: str, limit: int = ERROR_CHARS) -> str:
    """The words of :func:`learner_error` from describe_exception's record."""
    text = f"{info.get('type')}: {str(info.get('message') or '')[:limit]}"
    return text + frame_words(info.get("where"), learner_path)


def frame_words(where: dict | None, learner_path: str) -> str:
    """" (31_fsdp2.py line 57, in train_step: `loss = ...`)", or "" when no frame of the learner's file was met."""
    if not isinstance(where, dict) or not where.get("line"):
        return ""
    code = f": `{where['code']}`" if where.get("code") else ""
    return f" ({os.path.basename(learner_path or '')} line {where['line']}, in {where.get('function')}{code})"


def checked_record(info) -> dict | None:
    """A rank's describe_exception record as sent, its fields checked (plain strings, a frame of plain values);
    None when it is not one."""
    if not isinstance(info, dict) or not isinstance(info.get("type"), str):
        return None
    where = info.get("where")
    if isinstance(where, dict):
        where = {"line": where.get("line") if isinstance(where.get("line"), int) else 0,
                 "function": str(where.get("function") or ""), "code": str(where.get("code") or "")[:200]}
    else:
        where = None
    return {"type": info["type"][:100], "message": str(info.get("message") or "")[:2000],
            "traceback": str(info.get("traceback") or "")[-6000:], "where": where, "phase": "run",
            "raised_in_learner": bool(info.get("raised_in_learner", True))}


def _lost_a_peer(record: dict) -> bool:
    message = record["message"].lower()
    return any(words in message for words in ("by peer", "timed out", "timeout", "connection reset"))


def stop_on_learner_error(g, world_size: int, failed: list[tuple[int, dict]], context: str) -> None:
    """Stop the grading as an exception that left a driver stops it: the run problem names the rank, the
    exception and the learner's frame, with its traceback in the details. ``failed``: (rank, describe_exception
    record) of each rank whose learner's code raised, the cause first (peers that only lost it after)."""
    from grader.rank.outcomes import RankOutcome, WorldOutcome

    records = {rank: checked_record(info) for rank, info in failed}
    cause = failed[0][0]
    ranks = []
    for rank in range(world_size):
        record = records.get(rank)
        first = 0.0 if rank == cause else 1.0  # the cause is the one the problem names (the earliest)
        if rank == cause or (record is not None and not _lost_a_peer(record)):
            ranks.append(RankOutcome(rank, "error", error=record, seconds=first))  # its own exception
        elif record is not None:
            ranks.append(RankOutcome(rank, "killed", error=record, seconds=first))  # left waiting by the cause
        else:
            ranks.append(RankOutcome(rank, "ok", seconds=first))
    try:
        g.stop_on_failures(WorldOutcome(world_size, ranks))
    except g.Stopped as stop:
        raise g.with_context(stop, context) from None
