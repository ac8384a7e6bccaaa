"""Turning quiz records into text for the terminal and into the documented JSON object."""

from __future__ import annotations

import textwrap

from grader.quiz.bank import TOPICS
from grader.quiz.question import LETTERS, Question
from grader.quiz.session import Answer, Presented, Score, letters_of, plural

WIDTH = 78
JSON_SCHEMA = "ddp-grade.quiz/1"
TOPICS_SCHEMA = "ddp-grade.quiz-topics/1"


def fill(text: str, initial_indent: str = "", subsequent_indent: str = "") -> str:
    """Wrap one paragraph to the terminal width at spaces only: never inside a hyphenated word
    (``find_unused_parameters=True``, ``reduce-scatter``) or a long name."""
    return textwrap.fill(" ".join(text.split()), WIDTH, initial_indent=initial_indent,
                         subsequent_indent=subsequent_indent, break_on_hyphens=False,
                         break_long_words=False)


def paragraphs(text: str, indent: str = "") -> str:
    """Wrap prose to the terminal width; blocks with indented lines (code) are kept as written."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if any(line.startswith("    ") for line in block.splitlines()):
            blocks.append(textwrap.indent(block, indent))
        else:
            blocks.append(fill(block, indent, indent))
    return "\n\n".join(blocks)


def question_text(number: int, total: int, presented: Presented) -> str:
    """The question as asked: header, text, lettered choices, a hint for multi-select.

    The id is not shown here (it can name the answer); :func:`feedback_text` shows it after answering.
    """
    q = presented.question
    lines = [f"Question {number}/{total}  [{q.topic}, {q.difficulty}]", paragraphs(q.text), ""]
    for letter, choice in zip(LETTERS, presented.choices):
        lines.append(fill(choice, f"  {letter}) ", "     "))
    if q.multi:
        lines.append("  (several letters, e.g. ac or a,c)")
    return "\n".join(lines)


def feedback_text(answer: Answer) -> str:
    """Right or wrong, the correct letters, the explanation, the source and the question's id."""
    p = answer.presented
    q = p.question
    if answer.right:
        verdict = "Right."
    else:
        right_ones = "; ".join(f"{LETTERS[i]}) {p.choices[i]}" for i in sorted(p.correct))
        verdict = f"Wrong (you said {letters_of(answer.given) or '-'}). Correct: {right_ones}"
    tail = [f"Source: {q.source}"]
    if q.demo:
        tail.append(f"Shown by: {q.demo}")
    tail.append(f"Question id: {q.id}")
    return "\n\n".join([paragraphs(verdict), paragraphs(q.explanation) + "\n" + "\n".join(tail)])


def score_text(result: Score, planned: int, completed: bool) -> str:
    """The final (or partial) score, per topic and overall."""
    lines = []
    if not completed:
        lines.append(f"Interrupted after {result.total} of {plural(planned, 'question')}; "
                     "the answers given are saved.")
    width = max((len(t) for t in result.per_topic), default=5)
    lines.append("Score per topic:")
    for topic, (right, total) in result.per_topic.items():
        lines.append(f"  {topic:<{width}}  {right}/{total}")
    lines.append(f"Overall: {result.right}/{result.total}{_percent(result.right, result.total)}")
    return "\n".join(lines)


def _percent(right: int, total: int) -> str:
    return f" ({100 * right // total}%)" if total else ""


def topics_text(counts: dict[str, int]) -> str:
    """``--list-topics``: each topic, its question count and its title, then the total."""
    width = max(len(t) for t in TOPICS)
    lines = [f"{topic:<{width}}  {counts.get(topic, 0):>3}  {title}" for topic, title in TOPICS.items()]
    total = sum(counts.get(topic, 0) for topic in TOPICS)
    lines.append(f"{plural(total, 'question')} in {plural(len(TOPICS), 'topic')}")
    return "\n".join(lines)


def topics_json(counts: dict[str, int]) -> dict:
    """``--list-topics --format json``: the topics in order, with counts and titles, and the total."""
    return {
        "schema": TOPICS_SCHEMA,
        "topics": [{"topic": t, "title": title, "questions": counts.get(t, 0)} for t, title in TOPICS.items()],
        "total": sum(counts.get(t, 0) for t in TOPICS),
    }


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
        "question": q.text,
        "choices": list(answer.presented.choices),
        "given": letters_of(answer.given),
        "correct": answer.presented.correct_letters,
        "right": answer.right,
        "explanation": q.explanation,
        "source": q.source,
        "demo": q.demo or None,
        "checked": q.checked,
    }
