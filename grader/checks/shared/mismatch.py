"""Messages that did not match, in words: gloo aborts a rank whose receive meets a message of another size
("Is there a distributed collective mismatch in your code?"), and its record is lost with it. Each rank of 36
and 37 notes every message before it goes (:class:`grader.rank.drivers.shared.recording.MessageJournal`); from those
notes this says which receive of which rank met which send of its peer, and what each carried."""

from __future__ import annotations

import os
import re

from grader.rank import untrusted, wire
from grader.rank.drivers.shared.recording import JOURNAL_LIMIT, journal_name

MARKS = ("distributed collective mismatch", "op.preamble.length <= op.nbytes")
SIZES = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)")
SENDS, RECEIVES = ("send",), ("recv_", "recv_any_source_")
GLOO_WORDS = "Received data size doesn't match expected size. Is there a distributed collective mismatch?"


def _number(value) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _entry(value) -> dict | None:
    """One note as the driver writes it, each field checked (a learner's code shares the rank's process)."""
    if not isinstance(value, dict) or value.get("op") not in SENDS + RECEIVES or _number(value.get("bytes")) is None:
        return None
    shape = value.get("shape")
    return {"op": value["op"], "bytes": value["bytes"], "peer": _number(value.get("peer")),
            "tag": _number(value.get("tag")) or 0, "phase": untrusted.clean_line(value.get("phase", ""))[:120],
            "dtype": untrusted.clean_line(value.get("dtype") or "?")[:40],
            "shape": shape if isinstance(shape, list) and len(shape) <= 8 and all(_number(n) is not None
                                                                                  for n in shape) else None,
            "what": untrusted.clean_line(value["what"])[:120] if isinstance(value.get("what"), str) else None}


def read_journal(run_dir: str | None, rank: int) -> list[dict]:
    """What ``rank`` noted of its messages, in order (nothing when there is no readable note)."""
    if not run_dir:
        return []
    path = os.path.join(run_dir, journal_name(rank))
    try:  # each line's nesting bounded before it is parsed, all of them within one budget
        values = untrusted.read_json_lines(path, wire.Budget(bytes=400 * JOURNAL_LIMIT))
    except (OSError, untrusted.Unreadable):  # none written (the rank never reached a message), or not the driver's
        return []
    out = []
    for value in values[:JOURNAL_LIMIT]:
        entry = _entry(value)
        if entry is not None:
            out.append(entry)
    return out


def _aborted(outcome) -> list[tuple[int, str]]:
    """(rank, its last words) of each rank gloo aborted on a message of another size."""
    out = []
    for r in outcome.ranks:
        said = (r.output or "") + "\n" + str((r.error or {}).get("message") or "")
        if r.status != "ok" and any(mark in said for mark in MARKS):
            out.append((r.rank, said))
    return out


def _pairs(journals: dict[int, list[dict]], rank: int):
    """Each receive ``rank`` noted, with the send of its peer it meets: the n-th receive from a peer (with a tag,
    in a phase) meets the n-th send of that peer to it (with that tag, in that phase)."""
    seen: dict[tuple, int] = {}
    for entry in journals.get(rank, []):
        if entry["op"] not in RECEIVES or entry["peer"] is None:
            continue
        key = (entry["peer"], entry["tag"], entry["phase"])
        n = seen.get(key, 0)
        seen[key] = n + 1
        sends = [e for e in journals.get(entry["peer"], []) if e["op"] in SENDS and e["peer"] == rank
                 and e["tag"] == entry["tag"] and e["phase"] == entry["phase"]]
        yield entry, n + 1, sends[n] if n < len(sends) else None


def _carried(entry: dict) -> str:
    shape = f" {entry['shape']}" if entry["shape"] is not None else ""
    what = f", {entry['what']}" if entry["what"] else ""
    return f"{entry['bytes']} bytes: {entry['dtype']}{shape}{what}"


def _ordinal(n: int) -> str:
    return f"{n}{'tsnrhtdd'[(n // 10 % 10 != 1) * (n % 10 < 4) * n % 10::4]}"


def explain(outcome) -> tuple[int, str] | None:
    """(rank, words) when gloo aborted a rank on a message of another size: which receive of which rank met
    which send, and what each carried; None when no rank was aborted so."""
    aborted = _aborted(outcome)
    if not aborted:
        return None
    journals = {r.rank: read_journal(getattr(outcome, "run_dir", None), r.rank) for r in outcome.ranks}
    for rank, said in aborted:
        for receive, n, send in _pairs(journals, rank):
            if send is None or send["bytes"] == receive["bytes"]:
                continue
            tag = f" (tag {receive['tag']})" if receive["tag"] else ""
            where = f"{receive['phase']}: " if receive["phase"] else ""
            return rank, (f"{where}rank {rank}'s {_ordinal(n)} receive from rank {receive['peer']}{tag} "
                          f"({_carried(receive)}) met rank {receive['peer']}'s {_ordinal(n)} send to it "
                          f"({_carried(send)}): the first of its messages whose sizes differ; gloo aborted rank "
                          f"{rank}: \"{GLOO_WORDS}\" Messages between "
                          "two ranks pair up in the order they are posted: send and receive the same tensors, in "
                          "the same order, with the same shapes and dtypes, on both sides")
    rank, said = aborted[0]
    sizes = SIZES.search(said)
    got = f" a message of {sizes.group(1)} bytes arrived for a receive of {sizes.group(2)}:" if sizes else ""
    return rank, (f"rank {rank} was aborted by gloo:{got} \"{GLOO_WORDS}\" Messages between two ranks pair up in "
                  "the order they are posted: send and receive the same tensors, in the same order, with the same "
                  "shapes and dtypes, on both sides")


def stop_on_mismatch(g, outcome, check_id: str, world_size: int) -> None:
    """When gloo aborted a rank on a message of another size: ``check_id`` (the check of the messages) fails with
    which messages did not match, and the grading stops (the aborted rank's record is lost)."""
    found = explain(outcome)
    if found is None:
        return
    rank, words = found
    g.record(check_id, False, words, rank=rank, world_size=world_size)
    g.stop(f"gloo aborted rank {rank} on a message that did not match its peer's ({check_id} says which); nothing "
           "after it could be checked", rank=rank, world_size=world_size)
