"""Split a batch across machines (``batch --shard I/N``) and put the pieces back (``batch merge``).

The split is a pure function of the submissions' names: sorted, the k-th name goes to shard
``k mod N + 1``. Every machine of a job array that is given the same paths computes the same
split, whatever order its file system lists them in, so each submission is graded by exactly
one shard and no machine needs to talk to another.

A shard's JSON output records the split: its index, the count, and every name of the whole
batch. ``merge`` refuses outputs that do not fit together (the same shard twice, a shard
missing, shards cut from different lists of submissions or into different counts), naming the
files and the shards, before it writes anything.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from grader.batch_output import Outcome


@dataclass(frozen=True)
class Shard:
    index: int  # 1 .. count
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse(text: str) -> Shard:
    """``"2/8"`` -> Shard(2, 8); ValueError with a message a user acts on."""
    match = re.fullmatch(r"\s*(-?\d+)\s*/\s*(-?\d+)\s*", text or "")
    if not match:
        raise ValueError(f"--shard takes I/N, e.g. 2/8 for the second of 8 shards, not {text!r}")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1:
        raise ValueError(f"--shard {text}: the number of shards must be at least 1")
    if not 1 <= index <= count:
        extra = " (a 0-based array index needs $((INDEX + 1))/N)" if index == 0 else ""
        raise ValueError(f"--shard {text}: shards are numbered 1 to {count}{extra}")
    return Shard(index, count)


def split(names: Sequence[str], count: int) -> list[list[int]]:
    """For each shard 1..count, the positions in ``names`` it grades, in the order of the sorted names.

    Equal names (the same path given twice) keep their given order.
    """
    order = sorted(range(len(names)), key=lambda k: (names[k], k))
    shards: list[list[int]] = [[] for _ in range(count)]
    for rank, position in enumerate(order):
        shards[rank % count].append(position)
    return shards


def positions(names: Sequence[str], shard: Shard) -> list[int]:
    """The positions in ``names`` that ``shard`` grades."""
    return split(names, shard.count)[shard.index - 1]


def record(names: Sequence[str], shard: Shard) -> dict:
    """What a shard's JSON output says about the split (``merge`` reads it back)."""
    return {"index": shard.index, "count": shard.count, "submissions": sorted(names)}


class MergeError(ValueError):
    """Shard outputs that cannot be merged; the message names the files and the shards."""


@dataclass
class Piece:
    """One shard's output as ``merge`` reads it."""

    source: str  # the file it came from
    shard: Shard
    names: list[str]  # every submission of the whole batch, sorted
    outcomes: list[Outcome]


def piece(source: str, outcomes: list[Outcome], shard_field: dict | None) -> Piece:
    """A shard output's outcomes and split; an output of an unsplit batch is shard 1/1 of itself."""
    if shard_field is None:
        return Piece(source, Shard(1, 1), sorted(o.submission.name for o in outcomes), outcomes)
    try:
        shard = Shard(int(shard_field["index"]), int(shard_field["count"]))
        names = sorted(str(n) for n in shard_field["submissions"])
    except (KeyError, TypeError, ValueError):
        raise MergeError(f"{source}: its 'shard' field is not one `ddp-grade batch --shard` writes") from None
    if not 1 <= shard.index <= shard.count:
        raise MergeError(f"{source}: shard {shard} is not a shard")
    return Piece(source, shard, names, outcomes)


def merge(pieces: list[Piece]) -> list[Outcome]:
    """Every submission's outcome, in the order of the sorted names; MergeError when the pieces do not fit."""
    if not pieces:
        raise MergeError("no shard outputs given")
    first = pieces[0]
    for p in pieces[1:]:
        if p.shard.count != first.shard.count:
            raise MergeError(f"the outputs were split into different numbers of shards: {first.source} is shard "
                             f"{first.shard}, {p.source} is shard {p.shard}")
        if p.names != first.names:
            raise MergeError(f"{first.source} and {p.source} were cut from different submissions "
                             f"({len(first.names)} and {len(p.names)}; {_first_difference(first, p)}): "
                             "give every shard the same paths")
    seen: dict[int, Piece] = {}
    for p in pieces:
        if p.shard.index in seen:
            raise MergeError(f"overlapping shards: shard {p.shard} is in both {seen[p.shard.index].source} and "
                             f"{p.source}; each shard's output must be given once")
        seen[p.shard.index] = p
    count = first.shard.count
    missing = [i for i in range(1, count + 1) if i not in seen]
    if missing:
        lost = [first.names[k] for i in missing for k in positions(first.names, Shard(i, count))]
        example = f", e.g. {lost[0]}" if lost else ""
        raise MergeError(f"missing shard{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(f'{i}/{count}' for i in missing)}: {len(lost)} submission"
                         f"{'s' if len(lost) != 1 else ''} not graded{example}; merge needs all {count}")
    by_name: dict[str, list[Outcome]] = {}
    for p in pieces:
        expected = Counter(p.names[k] for k in positions(p.names, p.shard))
        found = Counter(o.submission.name for o in p.outcomes)
        if found != expected:
            extra, lacking = sorted((found - expected).elements()), sorted((expected - found).elements())
            what = (f"{extra[0]!r} is not one of its submissions" if extra
                    else f"{lacking[0]!r} is missing from it")
            raise MergeError(f"{p.source} does not hold what shard {p.shard} grades: {what}")
        for o in p.outcomes:
            by_name.setdefault(o.submission.name, []).append(o)
    return [by_name[name].pop(0) for name in first.names]


def _first_difference(a: Piece, b: Piece) -> str:
    only_a = sorted(set(a.names) - set(b.names))
    only_b = sorted(set(b.names) - set(a.names))
    if only_b:
        return f"{only_b[0]!r} is only in {b.source}"
    if only_a:
        return f"{only_a[0]!r} is only in {a.source}"
    return "the same names, given a different number of times"
