"""``ddp-grade interview``: a timed mock interview, one exercise then a few quiz questions.

The logic takes its input, output, clock and grading as arguments, so a test can script a whole
interview (``read_line`` raising EOFError means the input ended: the interview finishes).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

from grader import catalog
from grader.progress import Progress
from grader.quiz import render as quiz_render
from grader.quiz.bank import load_bank
from grader.quiz.session import (
    Answer,
    AnswerError,
    Presented,
    clean_progress,
    filter_questions,
    order_questions,
    parse_answer_for,
    save_answer,
    shuffle_choices,
)
from grader.results import PASS, SKIP, Report
from grader.state import StateFile

TRACK_CHOICES = ("any", catalog.WRITE, catalog.DEBUG)  # --track: which exercises an interview may draw


def pick_exercise(progress: Progress, exists: Callable[[catalog.Exercise], bool],
                  track: str = "any") -> catalog.Exercise | None:
    """The first exercise (catalog order) of ``track`` that exists in the kit and has not passed.

    ``any``: the writing exercises come first in the catalog, so the debugging track is drawn
    once they have all passed; ``debug`` draws a broken job at once.
    """
    for ex in catalog.exercises():
        if track != "any" and ex.track != track:
            continue
        if exists(ex) and not progress.passed(ex.id):
            return ex
    return None


def pick_questions(ex: catalog.Exercise, count: int, seed: int, quiz_progress: dict) -> list[Presented]:
    """``count`` questions on the exercise's topics (wrong-before first, then new ones)."""
    if count <= 0:
        return []
    bank = load_bank()
    pool = filter_questions(bank, list(ex.quiz_topics) or None) or bank
    chosen = order_questions(pool, quiz_progress, seed)[:count]
    return [shuffle_choices(q, seed) for q in chosen]


@dataclass
class Outcome:
    """What the summary shows."""

    exercise: catalog.Exercise
    minutes: float
    coding_s: float = 0.0
    total_s: float = 0.0
    gradings: int = 0
    hints: int = 0
    over_time: bool = False
    final: Report | None = None
    answers: list[Answer] = field(default_factory=list)
    questions: int = 0
    unsaved: str | None = None  # why answers could not be saved, if they could not

    @property
    def passed(self) -> bool:
        return self.final is not None and self.final.status == "passed"


class Interview:
    def __init__(self, ex: catalog.Exercise, path: str, minutes: float, questions: list[Presented], *,
                 grade: Callable[[], Report], read_line: Callable[[str], str], echo: Callable[[str], None],
                 render_report: Callable[[Report], str], progress: Progress, quiz_state: StateFile | None,
                 clock: Callable[[], float] = time.monotonic):
        self.ex, self.path, self.minutes, self.questions = ex, path, minutes, questions
        self.grade, self.read_line, self.echo, self.render_report = grade, read_line, echo, render_report
        self.progress, self.quiz_state, self.clock = progress, quiz_state, clock

    def run(self) -> Outcome:
        out = Outcome(self.ex, self.minutes, questions=len(self.questions))
        started = self.clock()
        deadline = started + self.minutes * 60
        self.echo(f"Mock interview: exercise {self.ex.id}, {self.ex.title}. You have {self.minutes:g} minutes.")
        if self.ex.is_debug:
            self.echo(f"A colleague's job misbehaves: read the report at the top of {self.path}, find the cause "
                      "and fix the script.")
        else:
            self.echo(f"Write the TODOs in {self.path}; functions to write: {', '.join(self.ex.functions)}.")
        self.echo("Commands: Enter = grade now, h = a hint (counted), q = finish and grade.")
        if self.questions:
            self.echo(f"After the code: {len(self.questions)} quiz question{'s' if len(self.questions) != 1 else ''}.")
        self.echo("The clock is running.")
        while True:
            left = deadline - self.clock()
            if left <= 0:
                out.over_time = True
                self.echo("Time is up: final grading.")
                break
            try:
                command = self.read_line(f"[{_mmss(left)} left] grade (Enter) / h / q: ").strip().lower()
            except EOFError:
                self.echo("")
                break
            if self.clock() >= deadline:
                out.over_time = True
                self.echo("Time is up: final grading.")
                break
            if command in ("q", "quit", "done", "finish"):
                break
            if command in ("h", "hint"):
                shown = self.progress.next_hint(self.ex)
                out.hints += 1
                if shown:
                    self.echo(f"hint {shown[0]}/{len(self.ex.hints)}: {shown[1]}")
                continue
            if command in ("", "g", "grade"):
                report = self.grade()
                out.gradings += 1
                self.echo(self.render_report(report))
                if report.status == "passed":
                    self.echo("All checks pass. Type q to finish, or keep polishing.")
                continue
            self.echo(f"unknown command {command!r}: Enter grades, h shows a hint, q finishes")
        out.coding_s = self.clock() - started
        out.final = self.grade()
        out.gradings += 1
        self.echo(self.render_report(out.final))
        self._ask(out)
        out.total_s = self.clock() - started
        return out

    def _ask(self, out: Outcome) -> None:
        quiz_progress = clean_progress(self.quiz_state.load()) if self.quiz_state else {}
        for number, p in enumerate(self.questions, 1):
            self.echo("\n" + quiz_render.question_text(number, len(self.questions), p))
            while True:
                try:
                    line = self.read_line("Your answer: ")
                except EOFError:
                    return
                try:
                    given = parse_answer_for(p, line)
                    break
                except AnswerError as exc:
                    self.echo(f"{exc}; try again.")
            answer = Answer(p, given)
            out.answers.append(answer)
            self.echo(quiz_render.feedback_text(answer))
            if self.quiz_state is not None:
                quiz_progress, unsaved = save_answer(self.quiz_state, quiz_progress, answer)
                if unsaved and not out.unsaved:
                    self.echo(f"(answers are not being saved: {unsaved})")
                out.unsaved = unsaved


def summary(out: Outcome) -> str:
    """Time used and how it went, as the last thing shown."""
    lines = ["", "Interview summary", "-----------------"]
    lines.append(f"Exercise {out.exercise.id} ({out.exercise.title})")
    limit = f"of {out.minutes:g} min" + (" - over time" if out.over_time else "")
    lines.append(f"  time used:   {_mmss(out.coding_s)} {limit} (code), {_mmss(out.total_s)} in all")
    if out.final is not None:
        graded = [c for c in out.final.checks if c.status != SKIP]
        passed = sum(c.status == PASS for c in graded)
        lines.append(f"  final grade: {out.final.status}, {passed}/{len(graded)} checks, "
                     f"{out.final.points:g}/{out.final.max_points:g} points")
    lines.append(f"  gradings:    {out.gradings}   hints taken: {out.hints}")
    if out.questions:
        right = sum(a.right for a in out.answers)
        lines.append(f"  quiz:        {right}/{out.questions} right"
                     + ("" if len(out.answers) == out.questions else f" ({len(out.answers)} answered)"))
    verdict = "Passed" if out.passed and not out.over_time else \
        "Passed, but over time" if out.passed else "Not passed"
    lines.append(f"  verdict:     {verdict}.")
    if not out.passed:
        lines.append(f"  next:        `ddp-grade hint {out.exercise.id}`, then `ddp-grade watch {out.exercise.id}`")
    return "\n".join(lines)


def _mmss(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


def default_seed() -> int:
    return random.SystemRandom().randrange(2**31)
