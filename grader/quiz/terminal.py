"""A quiz in the terminal, under ``ddp-grade quiz``: it asks, reads the answers (typed or scripted), saves
and renders; what to ask and how an answer scores is in session.py."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import click

from grader.quiz import render
from grader.quiz.bank import DIFFICULTIES, TOPICS, load_bank, topic_counts
from grader.quiz.session import (
    Answer,
    AnswerError,
    Presented,
    clean_progress,
    letters_of,
    filter_questions,
    order_questions,
    parse_answer_for,
    plural,
    save_answer,
    review_questions,
    score,
    shuffle_choices,
    split_answer_lines,
    split_inline_answers,
)
from grader.exits import EXIT_INTERRUPTED, EXIT_OK
from grader.state import StateFile

STATE_NAME = "quiz.json"


class QuizInputError(Exception):
    """Input the quiz cannot use; shown as one line, exit code 2."""


class QuizStopped(Exception):
    """The user stopped the quiz (Ctrl-C or end of input)."""


def read_line(prompt: str, err: bool = False) -> str:
    """Read one answer from the terminal (tests replace this function).

    When the input is not a terminal (piped), the answer is echoed after the prompt, so the
    output reads as a dialogue instead of the next text running into the prompt.
    """
    click.echo(prompt, nl=False, err=err)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    if not _is_tty(sys.stdin):
        click.echo(line.rstrip("\r\n"), err=err)
    return line


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def run_quiz(topic_args, count, difficulty, seed, answers_arg, fmt, review, list_topics) -> int:
    """The whole command; returns the exit code."""
    bank = load_bank()
    if list_topics:
        counts = topic_counts(bank)
        if fmt == "json":
            click.echo(json.dumps(render.topics_json(counts), indent=2))
        else:
            click.echo(render.topics_text(counts))
        return EXIT_OK
    topics = parse_topics(topic_args)
    difficulty = parse_difficulty(difficulty)
    if count < 1:
        raise QuizInputError(f"-n/--count must be at least 1 (got {count})")
    state = StateFile(STATE_NAME)
    progress = clean_progress(state.load())
    if state.warning():
        click.echo(state.warning(), err=True)
    seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    pool = filter_questions(bank, topics, difficulty)
    if not pool:
        raise QuizInputError("no question matches the chosen topics and difficulty")
    if review:
        chosen = review_questions(pool, progress)
        if not chosen:
            message = "Nothing to review: no question (of those chosen) was last answered wrong."
            if fmt == "json":
                click.echo(message, err=True)
                click.echo(json.dumps(render.quiz_json([], score([]), 0, True, seed), indent=2))
            else:
                click.echo(message)
            return EXIT_OK
    else:
        chosen = order_questions(pool, progress, seed)
    if len(chosen) < count:
        click.echo(fewer_than_asked(len(chosen), count, review), err=fmt == "json")
    presented = [shuffle_choices(q, seed) for q in chosen[:count]]
    scripted = answers_arg is not None
    source = scripted_answers(answers_arg, presented) if scripted else None
    return ask_all(presented, state, progress, seed, fmt, source)


def fewer_than_asked(matched: int, count: int, review: bool) -> str:
    """The notice when the filters leave fewer questions than ``-n`` asked for."""
    verb = "is" if matched == 1 else "are"
    what = f"{verb} due for review" if review else ("matches" if matched == 1 else "match") + " the filters"
    return f"Only {plural(matched, 'question')} {what} (-n {count}); asking {plural(matched, 'question')}."


def parse_topics(topic_args: tuple[str, ...]) -> list[str]:
    """``("sampler,launch", "core")`` -> ``["sampler", "launch", "core"]``, each a known topic.

    A ``--topic`` that names no topic at all (``''`` or ``,``) is refused rather than read as
    "every topic".
    """
    topics = []
    for arg in topic_args:
        names = [t.strip().lower() for t in arg.split(",") if t.strip()]
        if not names:
            raise QuizInputError(f"--topic {arg!r} names no topic; valid topics: {', '.join(TOPICS)}")
        topics.extend(names)
    unknown = [t for t in topics if t not in TOPICS]
    if unknown:
        raise QuizInputError(f"unknown topic {unknown[0]!r}; valid topics: {', '.join(TOPICS)}")
    return topics


def parse_difficulty(difficulty: str | None) -> str | None:
    """A known difficulty in lower case, or None for all."""
    if difficulty is None:
        return None
    if difficulty.lower() not in DIFFICULTIES:
        raise QuizInputError(f"unknown difficulty {difficulty!r}; choose from {', '.join(DIFFICULTIES)}")
    return difficulty.lower()


def scripted_answers(answers_arg: str, presented: list[Presented]) -> list[frozenset[int]]:
    """The ``--answers`` value read and checked against the questions, before anything is asked."""
    tokens = read_answer_tokens(answers_arg)
    if len(tokens) != len(presented):
        few = "too few" if len(tokens) < len(presented) else "too many"
        raise QuizInputError(f"{few} answers: got {len(tokens)} for {plural(len(presented), 'question')}")
    parsed = []
    for number, (token, p) in enumerate(zip(tokens, presented), 1):
        try:
            parsed.append(parse_answer_for(p, token))
        except AnswerError as exc:
            raise QuizInputError(f"answer {number} ({token!r}): {exc}") from None
    return parsed


def read_answer_tokens(answers_arg: str) -> list[str]:
    """Inline tokens, or the lines of the file named by ``@FILE``.

    Only ``@`` names a file: ``--answers a`` is the letter a even when a file ``a`` exists.
    """
    if answers_arg.startswith("@"):
        path = Path(answers_arg[1:])
        try:
            return split_answer_lines(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise QuizInputError(f"cannot read answers file {str(path)!r}: {exc}") from None
    return split_inline_answers(answers_arg)


def ask_all(presented, state, progress, seed, fmt, scripted) -> int:
    """Ask every question, saving after each answer; render the score; return the exit code."""
    to_err = fmt == "json"  # keep stdout for the JSON object
    quiet = to_err and scripted is not None  # scripted JSON: nothing but the object

    def show(text: str) -> None:
        if not quiet:
            click.echo(text, err=to_err)

    answers: list[Answer] = []
    warned_unsaved = False
    given_iter = iter(scripted) if scripted is not None else None
    completed = True
    try:
        for number, p in enumerate(presented, 1):
            show("\n" + render.question_text(number, len(presented), p))
            given = next(given_iter) if given_iter else ask_until_valid(p, to_err)
            if given_iter:
                show(f"Your answer: {letters_of(given)}")
            answer = Answer(p, given)
            progress, unsaved = save_answer(state, progress, answer)
            if unsaved and not warned_unsaved:
                click.echo(f"ddp-grade: answers are not being saved ({unsaved}); the quiz goes on.", err=True)
                warned_unsaved = True
            answers.append(answer)
            show(render.feedback_text(answer))
    except (KeyboardInterrupt, QuizStopped):
        completed = False
    result = score(answers)
    if fmt == "json":
        click.echo(json.dumps(render.quiz_json(answers, result, len(presented), completed, seed), indent=2))
    else:
        click.echo("\n" + render.score_text(result, len(presented), completed))
    return EXIT_OK if completed else EXIT_INTERRUPTED


def ask_until_valid(p: Presented, to_err: bool) -> frozenset[int]:
    """Prompt until the answer names only valid letters; Ctrl-C or end of input stops the quiz."""
    while True:
        try:
            line = read_line("Your answer: ", err=to_err)
        except EOFError:
            raise QuizStopped from None
        try:
            return parse_answer_for(p, line)
        except AnswerError as exc:
            click.echo(f"{exc}; try again.", err=to_err)

