"""An exception the learner's code raised in a rank, as the grader reads it: the record a rank sent, its fields
checked, and a grading stopped on it as an exception that left a driver stops it (the words, the learner's
frame included, come from :mod:`grader.rank.drivers.shared.learner_errors`, where the rank caught it)."""

from __future__ import annotations


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
