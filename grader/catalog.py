"""The exercise catalog: ``catalog.toml`` read into typed records."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


WRITE, DEBUG = "write", "debug"  # the tracks: write the functions of a stub, or fix a broken script
TRACKS = (WRITE, DEBUG)

# What a check's verdict stands on (docs/guarantees.md, "What a check stands on").
VALUE = "value"  # the learner's returned values, compared in the grader with answers computed there
KERNEL = "kernel"  # what the kernel saw: bytes on the connections between ranks, files, memory, tasks
CLAIM = "claim"  # what the submission's own processes recorded about themselves (probes, a driver's events)
EVIDENCE = (VALUE, KERNEL, CLAIM)
ON_EVIDENCE = (VALUE, KERNEL)  # what a check decided on evidence stands on


@dataclass(frozen=True)
class CheckInfo:
    """One named check of an exercise."""

    id: str  # stable id shown in reports, e.g. "params-identical"
    title: str  # what the check establishes
    hint: str = ""  # what to look at when it fails
    points: float = 1.0  # weight in the score
    after: tuple[str, ...] = ()  # checks whose failure explains this one's: they are shown and fixed first
    evidence: str = CLAIM  # what its verdict stands on: value, kernel or claim (EVIDENCE)


@dataclass(frozen=True)
class Exercise:
    """One exercise: its files, the names it defines, its checks and hints."""

    id: str  # "03"
    slug: str  # "train"
    title: str
    functions: tuple[str, ...]  # the names the grader imports from the learner's file
    world_sizes: tuple[int, ...]  # graded by default
    minutes: int  # time budget in interview mode
    hints: tuple[str, ...]  # in levels: nudge, API, code shape
    summary: str = ""  # what it practises, for the README's table of exercises
    quiz_topics: tuple[str, ...] = ()  # asked about in interview mode after this exercise (all when empty)
    preload_dynamo: bool = False  # its ranks build a DDP or torch optimizer: preload torch._dynamo, which they import
    timeout_s: float = 0.0  # the least deadline of its grading (whole torchrun jobs); --timeout applies above it
    checks: tuple[CheckInfo, ...] = field(default_factory=tuple)
    track: str = WRITE  # "write": functions to write; "debug": a broken training script to fix
    symptom: tuple[str, ...] = ()  # debug track: the checks the script as shipped fails (what the report shows)

    @property
    def filename(self) -> str:
        """The file's path under exercises/ (and solutions/, grader/stubs/): ``03_train.py``,
        ``debug/NN_slug.py`` for the debugging track."""
        name = f"{self.id}_{self.slug}.py"
        return name if self.track == WRITE else f"{self.track}/{name}"

    @property
    def is_debug(self) -> bool:
        return self.track == DEBUG

    @property
    def module(self) -> str:
        """The grader module holding this exercise's checks (``grade``)."""
        return f"grader.checks.ex{self.id}_{self.slug}"

    @property
    def drivers(self) -> str:
        """The module holding what this exercise's ranks and workers run (the rank side, :mod:`grader.rank`)."""
        return f"grader.rank.drivers.ex{self.id}_{self.slug}"

    def check(self, check_id: str) -> CheckInfo:
        for c in self.checks:
            if c.id == check_id:
                return c
        raise KeyError(f"exercise {self.id} has no check {check_id!r}")


@lru_cache(maxsize=1)
def exercises() -> tuple[Exercise, ...]:
    """Every exercise, in order."""
    return read(resources.files("grader").joinpath("catalog.toml").read_text(encoding="utf-8"))


def read(text: str) -> tuple[Exercise, ...]:
    """The exercises of a catalog's text (``tests/template/catalog.toml`` holds the template's)."""
    return tuple(_exercise(entry) for entry in tomllib.loads(text)["exercise"])


def _exercise(entry: dict) -> Exercise:
    checks = tuple(
        CheckInfo(c["id"], c["title"], c.get("hint", ""), float(c.get("points", 1)), tuple(c.get("after", [])),
                  _evidence(entry, c))
        for c in entry.get("check", [])
    )
    return Exercise(
        id=entry["id"],
        slug=entry["slug"],
        title=entry["title"],
        functions=tuple(entry["functions"]),
        world_sizes=tuple(entry.get("world_sizes", [2])),
        minutes=int(entry.get("minutes", 20)),
        hints=tuple(entry.get("hints", [])),
        summary=entry.get("summary", ""),
        quiz_topics=tuple(entry.get("quiz_topics", [])),
        preload_dynamo=bool(entry.get("preload_dynamo", False)),
        timeout_s=float(entry.get("timeout_s", 0.0)),
        checks=checks,
        track=_track(entry),
        symptom=tuple(entry.get("symptom", [])),
    )


def _evidence(entry: dict, check: dict) -> str:
    evidence = check.get("evidence")
    if evidence not in EVIDENCE:
        raise ValueError(f"exercise {entry.get('id')}, check {check.get('id')}: evidence {evidence!r} (one of "
                         f"{', '.join(EVIDENCE)})")
    return evidence


def _track(entry: dict) -> str:
    track = entry.get("track", WRITE)
    if track not in TRACKS:
        raise ValueError(f"exercise {entry.get('id')}: unknown track {track!r} (one of {', '.join(TRACKS)})")
    return track


def of_track(track: str) -> tuple[Exercise, ...]:
    """The exercises of one track, in catalog order."""
    return tuple(ex for ex in exercises() if ex.track == track)


def longest_timeout(timeout_s: float) -> float:
    """The longest a grading with ``--timeout timeout_s`` can take, whichever exercise it grades."""
    return max([timeout_s] + [ex.timeout_s for ex in exercises()])


def by_id(exercise_id: str) -> Exercise | None:
    """The exercise with this id; accepts "3", "03" and "03_train"."""
    match = re.match(r"^(\d{1,2})", str(exercise_id).strip())
    if not match:
        return None
    wanted = match.group(1).zfill(2)
    for ex in exercises():
        if ex.id == wanted:
            return ex
    return None


def from_filename(path: str | Path) -> Exercise | None:
    """The exercise a file is for, from a name like ``03_train.py`` wherever it lives."""
    name = Path(path).name
    match = re.match(r"^(\d{2})_", name)
    return by_id(match.group(1)) if match else None
