"""The question bank: TOML files in ``grader/quiz/bank/``, loaded into dataclasses and validated.

One file per topic, ``<topic>.toml``::

    topic = "sampler"

    [[question]]
    id = "sampler-set-epoch-01"
    difficulty = "easy"              # easy | medium | hard
    question = "..."
    choices = ["...", "...", "..."]  # 3 to 5, in the order the letters below refer to
    answer = "b"                     # one letter: single choice; a list ["a", "c"]: choose all that apply
    explanation = "..."
    source = "torch/utils/data/distributed.py"   # or a PyTorch docs URL

Loading is lenient (a missing field becomes empty); :func:`validate_bank` reports every problem.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

BANK_DIR = Path(__file__).parent / "bank"

#: Known topics, in the order they are listed, with a one-line title each.
TOPICS: dict[str, str] = {
    "core": "Core idea and math of data parallelism",
    "sampler": "Data sharding and DistributedSampler",
    "collectives": "Collectives and the ring all-reduce",
    "launch": "Launching processes: mp.spawn, torchrun, backends",
    "internals": "DDP internals: broadcast, buckets, hooks, options",
    "accumulation": "Gradient accumulation and no_sync",
    "checkpoint": "Checkpointing under DDP",
    "debugging": "Debugging hangs, timeouts and errors",
    "beyond": "Beyond DDP: DataParallel, FSDP/ZeRO, SyncBatchNorm",
    "mixed-precision": "Mixed precision with DDP",
    "elastic": "torchrun, rendezvous and restarts",
}
DIFFICULTIES = ("easy", "medium", "hard")
LETTERS = "abcde"
MIN_CHOICES, MAX_CHOICES = 3, 5
MIN_PER_TOPIC, MIN_TOTAL = 8, 80
MULTI_MARK = "choose all that apply"
MIN_EXPLANATION_CHARS = 80
MIN_SOURCE_CHARS = 10


class BankError(Exception):
    """A bank file that cannot be parsed at all (bad TOML, wrong types)."""


@dataclass(frozen=True)
class Question:
    """One multiple-choice question, with its choices in the order of the bank file."""

    id: str
    topic: str
    difficulty: str
    text: str
    choices: tuple[str, ...]
    answer_letters: tuple[str, ...]
    """Letters of the correct choices, referring to ``choices`` as written in the file."""
    multi: bool
    """True for a choose-all-that-apply question (answer given as a list)."""
    explanation: str
    source: str
    origin: str = ""
    """The file the question came from (for error messages)."""

    @property
    def correct(self) -> frozenset[int]:
        """Indices into ``choices`` of the correct answers (letters outside the choices are dropped)."""
        return frozenset(
            LETTERS.index(letter)
            for letter in self.answer_letters
            if letter in LETTERS and LETTERS.index(letter) < len(self.choices)
        )


def load_bank(directory: Path | None = None) -> list[Question]:
    """Every question of every ``*.toml`` file in ``directory`` (the packaged bank by default)."""
    directory = directory or BANK_DIR
    questions: list[Question] = []
    for path in sorted(directory.glob("*.toml")):
        questions.extend(parse_bank_file(path))
    return questions


def parse_bank_file(path: Path) -> list[Question]:
    """The questions of one bank file; raise :class:`BankError` when it is not usable TOML."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BankError(f"{path.name}: {exc}") from exc
    topic = data.get("topic", path.stem)
    entries = data.get("question", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BankError(f"{path.name}: [[question]] must be a list of tables")
    return [_question_from_entry(entry, str(topic), path.name) for entry in entries]


def _question_from_entry(entry: dict, topic: str, origin: str) -> Question:
    answer = entry.get("answer", [])
    multi = isinstance(answer, list)
    letters = answer if multi else [answer]
    return Question(
        id=_text(entry.get("id")),
        topic=_text(entry.get("topic", topic)),
        difficulty=_text(entry.get("difficulty")),
        text=_text(entry.get("question")),
        choices=tuple(_text(c) for c in entry.get("choices", [])),
        answer_letters=tuple(_text(a).lower() for a in letters),
        multi=multi,
        explanation=_text(entry.get("explanation")),
        source=_text(entry.get("source")),
        origin=origin,
    )


def _text(value) -> str:
    return value.strip() if isinstance(value, str) else ("" if value is None else str(value))


def validate_bank(
    questions: list[Question],
    min_per_topic: int = MIN_PER_TOPIC,
    min_total: int = MIN_TOTAL,
) -> list[str]:
    """Every problem found in the bank, one line each; an empty list means the bank is sound."""
    problems: list[str] = []
    seen: set[str] = set()
    for q in questions:
        if q.id in seen:
            problems.append(f"{q.origin}: duplicate id {q.id!r}")
        seen.add(q.id)
        problems.extend(f"{q.origin}: {q.id or '<no id>'}: {p}" for p in question_problems(q))
    problems.extend(_count_problems(questions, min_per_topic, min_total))
    return problems


def question_problems(q: Question) -> list[str]:
    """The problems of one question on its own."""
    problems = []
    if not q.id:
        problems.append("missing id")
    if q.topic not in TOPICS:
        problems.append(f"unknown topic {q.topic!r}")
    if q.difficulty not in DIFFICULTIES:
        problems.append(f"unknown difficulty {q.difficulty!r}")
    if not q.text:
        problems.append("missing question text")
    if not MIN_CHOICES <= len(q.choices) <= MAX_CHOICES:
        problems.append(f"{len(q.choices)} choices (want {MIN_CHOICES} to {MAX_CHOICES})")
    if any(not c for c in q.choices):
        problems.append("empty choice")
    if len({c.casefold() for c in q.choices}) != len(q.choices):
        problems.append("duplicate choice")
    if not q.answer_letters or not any(q.answer_letters):
        problems.append("no correct answer")
    for letter in q.answer_letters:
        if letter and (letter not in LETTERS or LETTERS.index(letter) >= len(q.choices)):
            problems.append(f"answer {letter!r} is not among the choices")
    if len(set(q.answer_letters)) != len(q.answer_letters):
        problems.append("an answer letter is repeated")
    if q.multi != (MULTI_MARK in q.text.lower()):
        problems.append(f"a multi-select question (and only one) must say {MULTI_MARK!r}")
    if len(q.explanation) < MIN_EXPLANATION_CHARS:
        problems.append("missing or too short explanation")
    if len(q.source) < MIN_SOURCE_CHARS or not _looks_like_source(q.source):
        problems.append("missing source (a PyTorch docs URL or a torch/... file path)")
    return problems


def _looks_like_source(source: str) -> bool:
    return source.startswith(("https://", "torch/", "docs/"))


def _count_problems(questions: list[Question], min_per_topic: int, min_total: int) -> list[str]:
    problems = []
    if len(questions) < min_total:
        problems.append(f"{len(questions)} questions in all (want at least {min_total})")
    counts = topic_counts(questions)
    for topic in TOPICS:
        if counts.get(topic, 0) < min_per_topic:
            problems.append(f"topic {topic!r} has {counts.get(topic, 0)} questions (want at least {min_per_topic})")
    return problems


def topic_counts(questions: list[Question]) -> dict[str, int]:
    """Number of questions per topic."""
    counts: dict[str, int] = {}
    for q in questions:
        counts[q.topic] = counts.get(q.topic, 0) + 1
    return counts
