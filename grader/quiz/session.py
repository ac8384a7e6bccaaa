"""Pure quiz logic: picking and ordering questions, shuffling choices, reading answers, scoring.

Nothing here reads files or the terminal; ``command.py`` does that.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from grader.quiz.question import LETTERS, Question


class AnswerError(ValueError):
    """An answer that cannot be used (a letter that is not a choice, or nothing at all)."""

    def __init__(self, message: str, letter: str = ""):
        super().__init__(message)
        self.letter = letter


@dataclass(frozen=True)
class Presented:
    """A question as shown: its choices in a shuffled order."""

    question: Question
    order: tuple[int, ...]
    """``order[k]`` is the bank index of the choice shown with letter ``LETTERS[k]``."""

    @property
    def choices(self) -> tuple[str, ...]:
        """The choice texts in display order."""
        return tuple(self.question.choices[i] for i in self.order)

    @property
    def correct(self) -> frozenset[int]:
        """Display positions of the correct choices."""
        return frozenset(pos for pos, i in enumerate(self.order) if i in self.question.correct)

    @property
    def correct_letters(self) -> str:
        """Letters of the correct choices, as displayed, e.g. ``"bd"``."""
        return letters_of(self.correct)


@dataclass(frozen=True)
class Answer:
    """One answered question."""

    presented: Presented
    given: frozenset[int]
    """Display positions the user picked."""

    @property
    def right(self) -> bool:
        """All the right choices and nothing else (no partial credit)."""
        return self.given == self.presented.correct

    @property
    def topic(self) -> str:
        return self.presented.question.topic


@dataclass(frozen=True)
class Score:
    """How many answers were right, overall and per topic."""

    right: int
    total: int
    per_topic: dict[str, tuple[int, int]]
    """topic -> (right, answered)"""


def letters_of(positions) -> str:
    """``{0, 2}`` -> ``"ac"``."""
    return "".join(LETTERS[i] for i in sorted(positions))


def shuffle_choices(question: Question, seed: int) -> Presented:
    """Present ``question`` with its choices shuffled, reproducibly for (seed, question id)."""
    order = list(range(len(question.choices)))
    random.Random(f"{seed}:{question.id}").shuffle(order)
    return Presented(question, tuple(order))


def parse_answer(token: str, n_choices: int, single: bool = False) -> frozenset[int]:
    """Read ``"b"``, ``"ac"``, ``"a,c"`` or ``"a c"`` into display positions; raise :class:`AnswerError`.

    With ``single`` (a question with one right answer) more than one letter is refused, so a
    learner who meant one letter is asked again instead of being marked wrong.
    """
    letters = [ch for ch in token.strip().lower() if ch not in ", \t"]
    if not letters:
        raise AnswerError("no answer given")
    valid = LETTERS[:n_choices]
    for ch in letters:
        if ch not in valid:
            raise AnswerError(f"{ch!r} is not a choice (choose from {', '.join(valid)})", ch)
    if single and len(set(letters)) > 1:
        raise AnswerError(f"this question takes one letter, not {len(set(letters))} ({''.join(letters)})")
    return frozenset(valid.index(ch) for ch in letters)


def parse_answer_for(presented: Presented, token: str) -> frozenset[int]:
    """:func:`parse_answer` for one presented question: its number of choices, one letter unless multi-select."""
    return parse_answer(token, len(presented.choices), single=not presented.question.multi)


def plural(count: int, noun: str) -> str:
    """``plural(1, "question")`` -> ``"1 question"``; ``plural(2, "question")`` -> ``"2 questions"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def split_inline_answers(text: str) -> list[str]:
    """``"a,bd c"`` -> ``["a", "bd", "c"]``: one token per question, separated by commas or spaces."""
    return [tok for tok in re.split(r"[,\s]+", text.strip()) if tok]


def split_answer_lines(text: str) -> list[str]:
    """Answers file: one answer per line; blank lines and ``#`` comments are skipped."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def filter_questions(
    questions: list[Question], topics: list[str] | None = None, difficulty: str | None = None
) -> list[Question]:
    """The questions in ``topics`` (all when empty) and of ``difficulty`` (all when None)."""
    return [
        q
        for q in questions
        if (not topics or q.topic in topics) and (difficulty is None or q.difficulty == difficulty)
    ]


def clean_progress(data: dict) -> dict:
    """``data`` with anything of the wrong shape dropped, so a hand-edited file cannot crash the quiz."""
    records = data.get("questions")
    if not isinstance(records, dict):
        records = {}
    records = {str(k): v for k, v in records.items() if isinstance(v, dict)}
    seq = data.get("seq")
    return {"version": 1, "seq": seq if isinstance(seq, int) else 0, "questions": records}


def save_answer(state, progress: dict, answer: Answer) -> tuple[dict, str | None]:
    """Record ``answer`` in the quiz's state file (read afresh under its lock, so quizzes at once keep
    every answer); the new progress, and why it could not be saved (None when it was)."""
    from grader.state import StateUnwritable

    try:
        return state.update(lambda data: record_answer(clean_progress(data), answer)), None
    except StateUnwritable as exc:
        return record_answer(progress, answer), str(exc.strerror or exc)


def wrong_ids_most_recent_first(progress: dict) -> list[str]:
    """Ids whose latest answer was wrong, the most recently answered first."""
    records = progress.get("questions", {})
    wrong = [(rec.get("seq", 0), qid) for qid, rec in records.items() if rec.get("last") == "wrong"]
    return [qid for _, qid in sorted(wrong, reverse=True)]


def order_questions(questions: list[Question], progress: dict, seed: int) -> list[Question]:
    """Previously wrong first (most recent first), then never asked, then the rest; ties shuffled by seed."""
    records = progress.get("questions", {})
    wrong_rank = {qid: k for k, qid in enumerate(wrong_ids_most_recent_first(progress))}
    shuffled = list(questions)
    random.Random(seed).shuffle(shuffled)
    wrong = sorted((q for q in shuffled if q.id in wrong_rank), key=lambda q: wrong_rank[q.id])
    unseen = [q for q in shuffled if q.id not in records]
    rest = [q for q in shuffled if q.id in records and q.id not in wrong_rank]
    return wrong + unseen + rest


def review_questions(questions: list[Question], progress: dict) -> list[Question]:
    """Only the questions whose latest answer was wrong, the most recent first."""
    by_id = {q.id: q for q in questions}
    return [by_id[qid] for qid in wrong_ids_most_recent_first(progress) if qid in by_id]


def record_answer(progress: dict, answer: Answer) -> dict:
    """A copy of ``progress`` with ``answer`` recorded (the caller saves it)."""
    seq = int(progress.get("seq", 0)) + 1
    records = dict(progress.get("questions", {}))
    qid = answer.presented.question.id
    old = records.get(qid, {})
    records[qid] = {
        "last": "right" if answer.right else "wrong",
        "asked": int(old.get("asked", 0)) + 1,
        "right": int(old.get("right", 0)) + int(answer.right),
        "seq": seq,
        "given": letters_of(answer.given),
        "correct": answer.presented.correct_letters,
    }
    return {**progress, "version": 1, "seq": seq, "questions": records}


def score(answers: list[Answer]) -> Score:
    """Right answers overall and per topic (topics in order of first appearance)."""
    per_topic: dict[str, tuple[int, int]] = {}
    for a in answers:
        right, total = per_topic.get(a.topic, (0, 0))
        per_topic[a.topic] = (right + int(a.right), total + 1)
    return Score(right=sum(a.right for a in answers), total=len(answers), per_topic=per_topic)
