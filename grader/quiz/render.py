"""Turning quiz records into text for the terminal and into the documented JSON object."""

from __future__ import annotations

import textwrap

from grader.quiz.bank import LETTERS, TOPICS, Question
from grader.quiz.session import Answer, Presented, Score, letters_of

WIDTH = 78
JSON_SCHEMA = "ddp-grade.quiz/1"


def paragraphs(text: str, indent: str = "") -> str:
    """Wrap prose to the terminal width; blocks with indented lines (code) are kept as written."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if any(line.startswith("    ") for line in block.splitlines()):
            blocks.append(textwrap.indent(block, indent))
        else:
            blocks.append(textwrap.fill(" ".join(block.split()), WIDTH, initial_indent=indent,
                                        subsequent_indent=indent))
    return "\n\n".join(blocks)


def question_text(number: int, total: int, presented: Presented) -> str:
    """The question as asked: header, text, lettered choices, a hint for multi-select."""
    q = presented.question
    lines = [f"Question {number}/{total}  [{q.topic}, {q.difficulty}]  {q.id}", paragraphs(q.text), ""]
    for letter, choice in zip(LETTERS, presented.choices):
        wrapped = textwrap.fill(" ".join(choice.split()), WIDTH, initial_indent=f"  {letter}) ",
                                subsequent_indent="     ")
        lines.append(wrapped)
    if q.multi:
        lines.append("  (several letters, e.g. ac or a,c)")
    return "\n".join(lines)


def feedback_text(answer: Answer) -> str:
    """Right or wrong, the correct letters, the explanation and the source."""
    p = answer.presented
    if answer.right:
        verdict = "Right."
    else:
        right_ones = "; ".join(f"{LETTERS[i]}) {p.choices[i]}" for i in sorted(p.correct))
        verdict = f"Wrong (you said {letters_of(answer.given) or '-'}). Correct: {right_ones}"
    return "\n\n".join([paragraphs(verdict), paragraphs(p.question.explanation) + f"\nSource: {p.question.source}"])


def score_text(result: Score, planned: int, completed: bool) -> str:
    """The final (or partial) score, per topic and overall."""
    lines = []
    if not completed:
        lines.append(f"Interrupted after {result.total} of {planned} questions; the answers given are saved.")
    width = max((len(t) for t in result.per_topic), default=5)
    lines.append("Score per topic:")
    for topic, (right, total) in result.per_topic.items():
        lines.append(f"  {topic:<{width}}  {right}/{total}")
    lines.append(f"Overall: {result.right}/{result.total}{_percent(result.right, result.total)}")
    return "\n".join(lines)


def _percent(right: int, total: int) -> str:
    return f" ({100 * right // total}%)" if total else ""


def topics_text(counts: dict[str, int]) -> str:
    """``--list-topics``: each topic, its question count and its title."""
    width = max(len(t) for t in TOPICS)
    return "\n".join(f"{topic:<{width}}  {counts.get(topic, 0):>3}  {title}" for topic, title in TOPICS.items())


def quiz_json(answers: list[Answer], result: Score, planned: int, completed: bool, seed: int) -> dict:
    """The ``--format json`` object (schema ``ddp-grade.quiz/1``, documented in docs/quiz.md)."""
    return {
        "schema": JSON_SCHEMA,
        "seed": seed,
        "completed": completed,
        "questions": [answer_json(number, a) for number, a in enumerate(answers, 1)],
        "summary": {
            "planned": planned,
            "answered": result.total,
            "right": result.right,
            "wrong": result.total - result.right,
            "per_topic": {t: {"right": r, "answered": n} for t, (r, n) in result.per_topic.items()},
        },
    }


def answer_json(number: int, answer: Answer) -> dict:
    """One answered question in the JSON object."""
    q: Question = answer.presented.question
    return {
        "number": number,
        "id": q.id,
        "topic": q.topic,
        "difficulty": q.difficulty,
        "multi": q.multi,
        "choices": list(answer.presented.choices),
        "given": letters_of(answer.given),
        "correct": answer.presented.correct_letters,
        "right": answer.right,
        "source": q.source,
    }
